"""KV-cache events in vLLM's wire format, from lmc's tiers (issue 24).

A router (Dynamo's KV router, llm-d's prefix-cache scorer, ``lmc router``) sends a request
where most of its prefix is cached; it learns what is cached from events. lmc publishes its
tiers' chunks as vLLM 0.32 does its own blocks: ``BlockStored`` once a chunk is readable in a
tier, ``BlockRemoved`` once a medium's last copy is gone, ``AllBlocksCleared`` on a reset,
``medium`` CPU for the memory tier and STORAGE for disk (and shared stores when asked).

* :mod:`lmc.events.wire`: the format (encode; a bounded, checking decoder for routers);
* :mod:`lmc.events.events_config`: the ``kv_events`` setting (vLLM's ``--kv-events-config`` keys);
* :mod:`lmc.events.tracker`: chunk keys -> engine blocks, per-medium reference counts;
* :mod:`lmc.events.publisher`: ZMQ PUB, replay ROUTER, state dump, the bounded queue;
* :mod:`lmc.events.engine`: :func:`attach` wires it all to a ``CacheEngine``.

Threat model: docs/threats/events.md.
"""

from lmc.events.events_config import EventsConfig

__all__ = ["EventsConfig"]
