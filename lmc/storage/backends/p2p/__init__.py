"""The P2P tier (``p2p+lmc://``): engines pull chunks straight from each other's export windows over NIXL.

* :mod:`~lmc.storage.backends.p2p.backend` -- the tier that ties the parts together;
* :mod:`~lmc.storage.backends.p2p.wire` -- the fixed-size location record an owner
  advertises for a chunk (with the checksum and keyed tag a reader verifies);
* :mod:`~lmc.storage.backends.p2p.directory_client` -- the engine's side of the directory
  ops (the directory itself lives with the daemon: :mod:`lmc.server.p2p`);
* :mod:`~lmc.storage.backends.p2p.agent` -- one NIXL agent per engine: only its export
  window and version table published, READs with a deadline.

NIXL is imported only by the agent, so the daemon and everything else work without it
installed. Threat model: ``docs/threats/p2p.md``.
"""
