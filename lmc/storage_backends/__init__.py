"""lmc storage tiers, one module each; every module registers itself with
``lmc.storage_backend.register_backend`` and is listed in the ``lmc.storage_backends``
entry-point group."""
