"""The ``kv_events`` settings: vLLM's ``--kv-events-config`` keys, plus what lmc needs.

One mapping, as vLLM takes it (``{"enable_kv_cache_events": true, "endpoint": ...}``), so an
operator copies a vLLM deployment's value over. Off by default. Every value is checked and a
wrong one is a ``ValueError`` naming the key.

vLLM's keys (same meaning, same defaults but two): ``enable_kv_cache_events``,
``publisher`` (``zmq`` or ``null``), ``endpoint`` (bound when it holds ``*``/``::`` or is
``ipc://``/``inproc://``, else connected to, as vLLM does), ``replay_endpoint`` (bound;
``null`` for none), ``buffer_steps`` (batches kept for replay), ``hwm`` (ZMQ send high-water
mark), ``max_queue_size`` (events waiting to be encoded: past it new ones are dropped and
counted, never waited for), ``topic``. The two defaults that differ: vLLM binds
``tcp://*:5557`` (every interface) and serves no replay socket; lmc, with ``endpoint`` or
``replay_endpoint`` unset, binds ``tcp://127.0.0.1:5557`` and ``tcp://127.0.0.1:5558``
(loopback: a router that joins late needs the replay socket, and reaching another host
takes naming an address -- a wildcard is the operator's choice, never a default;
:mod:`lmc.events.endpoints`).

lmc's own: ``block_size`` (tokens per published hash: the engine's block size; 0 = take the
engine's), ``pod`` and ``model_name`` (the topic ``kv@<pod>@<model>`` llm-d parses, when
``topic`` is empty), ``heartbeat`` (seconds between empty batches while idle, so a subscriber
sees a gap or a dead publisher), ``max_chunks`` (chunks whose tokens the publisher remembers;
chunks past it are not published, counted), ``publish_remote`` (also publish shared tiers'
chunks -- off: the store that holds them publishes them), ``dp_rank``; the bytes peers can
make the publisher hold (a size, ``"64MiB"`` or bytes): ``buffer_max_bytes`` (the replay
buffer, 128 MiB, besides ``buffer_steps``), ``pub_max_bytes`` (batches ZMQ holds for
subscribers not done reading, 64 MiB), ``replay_max_bytes`` (replies ZMQ holds for every
replay peer together, 64 MiB; docs/threats/events.md).
"""

from __future__ import annotations

import dataclasses
import math
import socket
from collections.abc import Mapping
from typing import Any

from lmc.events.endpoints import DEFAULT_PUB, DEFAULT_REPLAY, binds
from lmc.settings import parse_size

VLLM_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
             "buffer_steps", "hwm", "max_queue_size", "topic")


@dataclasses.dataclass(frozen=True)
class EventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = ""  # unset: DEFAULT_PUB, bound on loopback
    replay_endpoint: str | None = ""  # unset: DEFAULT_REPLAY; None: no replay socket
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    block_size: int = 0
    pod: str = ""
    model_name: str = ""
    heartbeat: float = 2.0
    max_chunks: int = 1 << 16
    publish_remote: bool = False
    dp_rank: int = 0
    buffer_max_bytes: int = 128 << 20
    pub_max_bytes: int = 64 << 20
    replay_max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events.publisher: {self.publisher!r}, choose zmq or null")
        for key in ("endpoint",) + (("replay_endpoint",) if self.replay_endpoint else ()):
            v = getattr(self, key)
            if v == "":
                continue  # unset: the loopback default
            if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events.{key}: {str(v)[:80]!r} is not a tcp://, ipc:// "
                                 f"or inproc:// endpoint")
        for key, lo, hi in (("buffer_steps", 1, 1 << 24), ("hwm", 0, 1 << 30),
                            ("max_queue_size", 1, 1 << 26), ("block_size", 0, 1 << 16),
                            ("max_chunks", 1, 1 << 26), ("dp_rank", 0, 1 << 16)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"kv_events.{key}: {v!r} is not a whole number in [{lo}, {hi}]")
        for key in ("buffer_max_bytes", "pub_max_bytes", "replay_max_bytes"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 << 16 <= v <= 1 << 40:
                raise ValueError(f"kv_events.{key}: {v!r} is not a size in [64KiB, 1TiB]")
        if not isinstance(self.heartbeat, (int, float)) or not math.isfinite(self.heartbeat) \
                or not 0 < self.heartbeat <= 3600:
            raise ValueError(f"kv_events.heartbeat: {self.heartbeat!r} is not in (0, 3600] s")
        for key in ("topic", "pod", "model_name"):
            v = getattr(self, key)
            if not isinstance(v, str) or len(v) > 256 or "@" in v and key != "topic":
                raise ValueError(f"kv_events.{key}: expected a string of at most 256 characters"
                                 f"{'' if key == 'topic' else ' without @'}")

    @property
    def pub_address(self) -> str:
        """The PUB endpoint: ``endpoint``, or the loopback default when unset."""
        return self.endpoint or DEFAULT_PUB

    @property
    def pub_binds(self) -> bool:
        """Whether PUB binds (vLLM's rule for a named endpoint; the default binds)."""
        return not self.endpoint or binds(self.endpoint)

    @property
    def replay_address(self) -> str | None:
        """The replay endpoint: ``replay_endpoint``, the loopback default when unset (``""``),
        None when off (``null``)."""
        if self.replay_endpoint is None:
            return None
        return self.replay_endpoint or DEFAULT_REPLAY

    def loopback_note(self) -> str:
        """What the INFO line at start adds when a default kept the sockets on loopback."""
        unset = [k for k in ("endpoint", "replay_endpoint") if getattr(self, k) == ""]
        if not unset:
            return ""
        return (f"; loopback only ({' and '.join(unset)} not set: name an address, e.g. "
                "tcp://10.0.0.1:5557 or tcp://*:5557, for routers on other hosts)")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def topic_for(self, model: str) -> str:
        """``topic``, or llm-d's ``kv@<pod>@<model>``."""
        if self.topic:
            return self.topic
        pod = self.pod or socket.gethostname()
        return f"kv@{pod}@{self.model_name or model}"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> EventsConfig:
        """From the ``kv_events`` setting (a mapping, or None = off); unknown keys are refused
        naming the closest known one."""
        if m is None:
            return cls()
        if not isinstance(m, Mapping):
            raise ValueError(f"kv_events must be a mapping, got {type(m).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        out: dict[str, Any] = {}
        for k, v in m.items():
            if k not in names:
                import difflib
                near = difflib.get_close_matches(str(k), names, 1)
                raise ValueError(f"kv_events: unknown key {str(k)[:60]!r}"
                                 + (f" (did you mean {near[0]!r}?)" if near else ""))
            out[k] = v
        for k in ("enable_kv_cache_events", "publish_remote"):
            if k in out and not isinstance(out[k], bool):
                raise ValueError(f"kv_events.{k}: expected true or false, got {out[k]!r}")
        for k in ("buffer_max_bytes", "pub_max_bytes", "replay_max_bytes"):
            if k in out and isinstance(out[k], str):
                out[k] = parse_size(out[k], f"kv_events.{k}")
        if "heartbeat" in out and isinstance(out["heartbeat"], bool):
            raise ValueError("kv_events.heartbeat: expected seconds")
        if "enable_kv_cache_events" in out and "publisher" not in out:
            out["publisher"] = "zmq" if out["enable_kv_cache_events"] else "null"
        return cls(**out)
