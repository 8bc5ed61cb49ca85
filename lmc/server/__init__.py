"""The daemon: ``lmc server``, the node-wide cache server. Its wire protocol lives with the
side that speaks it to the daemon, the server tier (:mod:`lmc.storage.backends.server`)."""
