"""KV events for one ``CacheEngine``: the storage listener, the prompt notes, the publisher.

:func:`attach` is the whole wiring, called once after the engine's storage is built (with the
``kv_events`` setting; nothing happens when it is off):

* a :class:`EventsListener` on the storage manager sees every tier's stores, promotions,
  evictions, deletes and clears (after the fact, see
  :class:`lmc.storage.tier.TierListener`) and queues them;
* a :class:`PromptNotes` observes the engine's token database
  (:class:`lmc.token_database.KeysObserver`): a note of each prompt it keys, so the
  publisher learns each chunk's tokens; a tagged request's chunks (a LoRA adapter or a ``cache_salt``: keys from a root of their
  own, :class:`~lmc.token_database.RootedKeys`) are never noted, hence never published: the
  tracker's block hashes chain from the namespace and would claim them for the base model,
  and vLLM's events would carry the salt itself in ``extra_keys``;
* the :class:`~lmc.events.publisher.EventPublisher` thread does the rest.

On the data path each hook is one bounded ``deque.append`` of the arguments (no hashing, no
encoding, no lock): ``benchmarks/bench_router.py --only overhead`` measures its cost per stored
chunk against the store itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmc.events.events_config import EventsConfig
from lmc.events.publisher import EventPublisher
from lmc.events.tracker import MEDIUM_OF, Tracker
from lmc.memory.pool import MemoryObj
from lmc.storage.tier import Key, Medium, TierInfo, TierListener
from lmc.token_database import Chunk, ChunkedTokenDatabase, ChunkKey, Tokens

log = logging.getLogger(__name__)
Offer = Callable[[tuple[Any, ...]], None]


class EventsListener(TierListener):
    """Queues every tier event for the publisher's thread."""

    def __init__(self, offer: Offer) -> None:
        self.offer = offer

    def on_stored(self, keys: Sequence[Key], tier: TierInfo, reason: str) -> None:
        self.offer(("stored", tuple(keys), tier.level))

    def on_removed(self, keys: Sequence[Key], tier: TierInfo, reason: str,
                   objs: Sequence[MemoryObj] | None = None) -> None:
        self.offer(("removed", tuple(keys), tier.level))

    def on_cleared(self, tier: TierInfo) -> None:
        self.offer(("cleared", tier.level))


class PromptNotes:
    """Observes the engine's token database (a :class:`~lmc.token_database.KeysObserver`):
    queues a note of each plain prompt it keys, the tokens and the chunks they were cut
    into. The tokens are referenced, not copied (a prompt is append-only while its request
    lives)."""

    def __init__(self, chunk_size: int, offer: Offer) -> None:
        self.chunk_size = chunk_size
        self.offer = offer

    def on_keys(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int) -> None:
        self.offer(("note_keys", tokens, keys, self.chunk_size, num_tokens))

    def on_chunks(self, tokens: Tokens, keys: Sequence[ChunkKey], num_tokens: int,
                  chunks: list[Chunk]) -> None:
        if chunks:
            self.offer(("note", tokens, chunks))


class EngineEvents:
    """What :func:`attach` set up; :meth:`close` undoes it (before the engine's storage
    closes, so the last events are still published)."""

    def __init__(self, engine: Any, publisher: EventPublisher, listener: EventsListener,
                 notes: PromptNotes) -> None:
        self.engine = engine
        self.publisher = publisher
        self.listener = listener
        self.notes = notes

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def stats(self) -> dict[str, int]:
        return {f"kv_events.{k}": v for k, v in self.publisher.stats().items()}

    def close(self) -> None:
        self.engine.storage.remove_listener(self.listener)
        self.engine.db.remove_observer(self.notes)
        self.publisher.close()


def tier_media(infos: Sequence[TierInfo], publish_remote: bool) -> list[str | None]:
    """Per tier level, the medium its events carry, or None (not published)."""
    out: list[str | None] = []
    for info in infos:
        m = MEDIUM_OF.get(info.medium)
        out.append(None if info.medium is Medium.REMOTE and not publish_remote else m)
    return out


def attach(engine: Any, setting: EventsConfig | Mapping[str, Any] | None
           ) -> EngineEvents | None:
    """Publish ``engine``'s tiers as configured by ``setting`` (the ``kv_events`` mapping);
    None when events are off. ``ValueError`` names a bad key, a block size that does not
    divide the chunk size, or an endpoint that cannot be opened."""
    cfg = setting if isinstance(setting, EventsConfig) else EventsConfig.from_mapping(setting)
    if not cfg.enabled:
        return None
    block_size = cfg.block_size or int(engine.spec.block_size)
    db: ChunkedTokenDatabase = engine.db
    if block_size < 1 or db.chunk_size % block_size:
        raise ValueError(f"kv_events.block_size {block_size} must divide chunk_size "
                         f"{db.chunk_size} (one hash per engine block)")
    storage = engine.storage
    media = tier_media(storage.infos, cfg.publish_remote)
    counts: list[EventPublisher] = []
    tracker = Tracker(block_size, db.namespace, media, cfg.max_chunks,
                      lambda what, n: counts[0].count(what, n))

    def reconcile() -> list[dict[str, Any]]:
        """After lost items: drop what a tier no longer holds (its removal was lost)."""
        out: list[dict[str, Any]] = []
        for level, tier in enumerate(storage.tiers):
            held = tracker.held_keys(level)
            if held and media[level] is not None:
                present = tier.contains(held)
                gone = [k for k, p in zip(held, present) if not p]
                out += tracker.removed(gone, level)
        return out

    publisher = EventPublisher(cfg, tracker, cfg.topic_for(str(engine.model_id)),
                               reconcile=reconcile)
    counts.append(publisher)
    listener = EventsListener(publisher.offer)
    notes = PromptNotes(db.chunk_size, publisher.offer)
    db.add_observer(notes)
    storage.add_listener(listener)
    # an lmc:// tier describes its chunks to a daemon that publishes them (its HELLO says
    # so; nothing is noted before): lmc.events.notes, another observer of the database
    from lmc.events.notes import bind
    bind(engine, block_size)
    return EngineEvents(engine, publisher, listener, notes)
