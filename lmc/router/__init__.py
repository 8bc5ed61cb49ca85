"""``lmc router``: a KV-aware OpenAI-compatible front for several engine instances.

* :mod:`lmc.router.index`: one instance's cached blocks from its events, a prompt's prefix;
* :mod:`lmc.router.feed`: the subscriptions (in order, gaps filled by replay or a dump);
* :mod:`lmc.router.policy`: the choice (medium-weighted prefix against load);
* :mod:`lmc.router.app`: the HTTP front, health checks, metrics and the command line.

Threat model: docs/threats/router.md.
"""
