"""``lmc router``: a KV-aware OpenAI-compatible front for several engine instances.

* :mod:`lmc.router.index`: one instance's cached blocks from its events, a prompt's prefix;
* :mod:`lmc.router.feed`: the subscriptions (in order, gaps filled by replay or a dump),
  and shared stores' events (``--shared-events``) matched for the instances that use them;
* :mod:`lmc.router.policy`: the choice (medium-weighted prefix against load);
* :mod:`lmc.router.app`: the HTTP front, health checks, metrics and the command line.

The instance specs and the choosing loop are :mod:`lmc.http.dispatch`, shared with
``lmc pd-proxy``; talking to an instance is :mod:`lmc.http.relay`.

Threat model: docs/threats/router.md.
"""
