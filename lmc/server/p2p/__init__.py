"""The daemon's side of P2P (``lmc.storage.backends.p2p``): the who-holds-what directory
(``directory``: per namespace, bounded per token and per peer, dropped with the peer's
connection) and the handlers of the ``P2P_*`` ops (``ops``). Threat model:
``docs/threats/p2p.md``."""
