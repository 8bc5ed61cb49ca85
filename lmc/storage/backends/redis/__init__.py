"""The Redis / Valkey tier: ``backend`` (the tier), ``url`` (where), ``nodes`` (connections and
key ownership), ``wire`` (RESP), ``jobs`` and ``fetch`` (pipelined writes and reads),
``layered`` (layer-by-layer reads), ``metrics``."""
