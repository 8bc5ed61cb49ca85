"""``lmc router`` and ``lmc pd-proxy``: KV-aware OpenAI-compatible fronts for several engine
instances.

* :mod:`lmc.router.index`: one instance's cached blocks from its events, a prompt's prefix;
* :mod:`lmc.router.feed`: the subscriptions (in order, gaps filled by replay or a dump),
  and shared stores' events (``--shared-events``) matched for the instances that use them;
* :mod:`lmc.router.policy`: the choice (medium-weighted prefix against load);
* :mod:`lmc.router.dispatch`: the instance specs and the choosing loop both fronts share;
  :mod:`lmc.router.health` probes the instances, :mod:`lmc.router.relay` talks to one,
  :mod:`lmc.router.metrics` is both fronts' Prometheus series;
* :mod:`lmc.router.app`: ``lmc router`` (the HTTP front and its command line);
  :mod:`lmc.router.pd_proxy`: ``lmc pd-proxy`` (prefill on a producer, decode on a consumer).

Threat models: docs/threats/router.md, docs/threats/http.md.
"""
