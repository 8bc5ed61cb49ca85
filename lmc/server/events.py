"""The daemon's KV events: what it holds, published as an engine publishes its own tiers.

With ``kv_events`` on, the daemon runs lmc's :class:`~lmc.events.publisher.EventPublisher`
(the same PUB socket, replay ROUTER, state dump and bounded queue) over its own storage:
``BlockStored`` when a chunk becomes readable in its memory tier (``CPU``) or disk tier
(``STORAGE``), ``BlockRemoved`` when its last copy in that medium goes (eviction, delete,
corruption, quota), ``AllBlocksCleared`` when a tier is cleared and at start.

A chunk is published only if its PUT carried block info (``lmc.events.shared``): checked
here before the values are read (a PUT whose info is malformed or describes another chunk
is refused, ``BAD_REQUEST`` naming what was wrong; the daemon goes on), its blocks derived
on the publisher's thread, scoped to the request's granted namespace (the ``cache_salt``).
The HELLO answer tells clients the block size (``{"kv_events": {"block_size": n}}``) so
they send info only then; a PUT without it (an older client, another block size) is
stored and not published, counted (``no_info``, ``other_block_size``).

Cost on the PUT path: the checks (one XXH3-128 over each chunk's key input) and one
``deque.append`` per value; hashing the blocks and encoding run on the publisher thread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lmc.events import shared
from lmc.events.engine import EventsListener, tier_media
from lmc.events.events_config import EventsConfig
from lmc.events.publisher import EventPublisher
from lmc.events.tracker import Tracker
from lmc.server.interval_log import RateLimitedWarnings
from lmc.storage.backends.server import protocol as P
from lmc.storage.manager import StorageManager
from lmc.storage.serde import Header

log = logging.getLogger(__name__)
_warn = RateLimitedWarnings(logger=log)
DEFAULT_BLOCK = 16
"""vLLM's default block size: the daemon's when ``kv_events.block_size`` is 0."""
MODEL = "lmc-server"


class DaemonEvents:
    """The publisher, tracker and storage listener of one daemon (see the module doc)."""

    def __init__(self, setting: Mapping[str, Any] | EventsConfig, storage: StorageManager
                 ) -> None:
        cfg = setting if isinstance(setting, EventsConfig) else \
            EventsConfig.from_mapping(setting)
        if not cfg.enabled:
            raise ValueError("kv_events: not enabled")
        self.block_size = cfg.block_size or DEFAULT_BLOCK
        self.secret = shared.new_secret()  # keys this run's block hashes (lmc.events.shared)
        self.storage = storage
        media = tier_media(storage.infos, cfg.publish_remote)
        holder: list[EventPublisher] = []
        self.tracker = Tracker(self.block_size, b"\0" * 16, media, cfg.max_chunks,
                               lambda what, n: holder[0].count(what, n))

        def reconcile() -> list[dict[str, Any]]:
            """After lost items: drop what a tier no longer holds (its removal was lost)."""
            out: list[dict[str, Any]] = []
            for level, tier in enumerate(storage.tiers):
                held = self.tracker.held_keys(level)
                if held and media[level] is not None:
                    present = tier.contains(held)
                    out += self.tracker.removed([k for k, p in zip(held, present) if not p],
                                                level)
            return out

        self.publisher = EventPublisher(cfg, self.tracker, cfg.topic_for(MODEL),
                                        reconcile=reconcile)
        holder.append(self.publisher)
        self.listener = EventsListener(self.publisher.offer)
        storage.add_listener(self.listener)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def hello(self) -> dict[str, Any]:
        """What a client's HELLO answer says of the events."""
        return {"block_size": self.block_size}

    def check(self, ns: str, meta: Mapping[str, Any], items: Sequence[Header],
              ikeys: Sequence[bytes]) -> None:
        """A PUT's block info: checked (``ProtocolError(BAD_REQUEST)`` naming what was
        wrong, nothing queued), then each described chunk queued for the publisher."""
        raw = meta.get("blocks")
        if raw is None:
            self.publisher.count("no_info", len(items))
            return
        try:
            infos = shared.parse(raw, [it.key for it in items],
                                 [it.num_tokens for it in items])
        except shared.BlockInfoError as e:
            self.publisher.count("refused", 1)
            _warn("kv_events: a PUT to namespace %r refused: %s", ns[:64], e)
            raise P.ProtocolError(P.BAD_REQUEST, f"block info refused: {e}") from None
        offer = self.publisher.offer
        missing = other = 0
        for it, ikey, info in zip(items, ikeys, infos):
            if info is None:
                missing += 1
            elif info.block_size != self.block_size:
                other += 1
            else:
                offer(("info", ikey, functools.partial(shared.derive, self.secret, ns, it.key,
                                                          info)))
        if missing:
            self.publisher.count("no_info", missing)
        if other:
            self.publisher.count("other_block_size", other)

    def stats(self) -> dict[str, int]:
        return {f"kv_events.{k}": v for k, v in self.publisher.stats().items()}

    def close(self) -> None:
        """Before the storage closes: the last removals are still published."""
        self.storage.remove_listener(self.listener)
        self.publisher.close()
