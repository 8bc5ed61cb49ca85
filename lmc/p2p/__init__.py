"""Peer-to-peer KV: engines pull chunks straight from each other's export windows over NIXL.

* :mod:`lmc.p2p.wire` -- the fixed-size location record an owner advertises for a chunk
  (with the checksum and keyed tag a reader verifies).
* :mod:`lmc.p2p.directory` -- the daemon's who-holds-what table (per namespace, bounded per
  token and per peer, dropped with the peer's connection).
* :mod:`lmc.p2p.directory_client` -- the engine's side of the directory ops.
* :mod:`lmc.p2p.agent` -- one NIXL agent per engine: only its export window and version table
  published, READs with a deadline.
* ``lmc.storage.backends.p2p`` -- the tier that ties them together.

NIXL is imported only by :mod:`lmc.p2p.agent`, so the daemon and everything else work without
it installed. Threat model: ``docs/threats/p2p.md``.
"""
