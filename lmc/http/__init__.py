"""What every lmc HTTP front shares (the reference engine's server, ``lmc router``, ``lmc
pd-proxy``): the bounded JSON request handling (``json_api``)."""
