"""Steering one engine's cache: pins with a TTL, retention priorities, deletes and clears.

:class:`CacheEngine` exposes these as ``pin``/``unpin``/``set_priority``/``delete``/
``clear``; this module is what they do. Everything is scoped to the engine's namespace
(its tenant: an engine serves exactly one, and a request naming another is refused with
:class:`~lmc.storage.control.NamespaceError`) and bounded: at most ``max_ttl_pins`` chunks
and ``max_pin_share`` of the pool pinned at once, no TTL past ``max_pin_ttl``, priorities
in [-10, 10]; a refusal is a named error (:mod:`lmc.storage.control`) and changes nothing.

* **A pin** holds one reference on each chunk of the prompt's longest stored prefix (lower
  tiers' hits are read into L1 first), so L1's eviction passes over it until its TTL ends
  (:mod:`lmc.storage.pins`: lazily released on the next engine call after that). An
  expired pin is nothing: the chunk is an ordinary one, evicted by priority then recency.
  A pin belongs to its session (``session=``: each turn's pin replaces the last, since the
  new chain contains the old) or else to the exact prompt; pinning again replaces the
  owner's pins and restarts its TTL.
* **A priority** is kept by every tier that orders its own evictions (L1, disk): a chunk of
  a higher priority goes after every lower one (:mod:`lmc.storage.eviction`). It is
  remembered by key (:mod:`lmc.storage.priorities`, bounded) until set to 0, deleted or
  cleared, so a chunk stored later, or again after an eviction, arrives with it.
* **A delete** removes the prompt's chunks from every tier and write-behind queue and
  drops the pins on them; **a clear** removes everything of the namespace from every tier
  (:meth:`lmc.storage.manager.StorageManager.clear_namespace`) and every pin taken here.
  Both reach the tiers' listeners, so KV events publish the removals.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from lmc.storage.control import NamespaceError, check_priority, check_ttl
from lmc.storage.pins import PinTable
from lmc.token_database import ChunkKey, Tokens, request_root, request_tag

if TYPE_CHECKING:
    from lmc.cache_engine import CacheEngine

log = logging.getLogger(__name__)
DEFAULT_NAMESPACE = "default"
"""An engine's namespace when its config names no ``tenant``."""


class CacheControl:
    """The control half of one :class:`CacheEngine` (module doc)."""

    def __init__(self, engine: CacheEngine) -> None:
        cfg = engine.config
        self.engine = engine
        self.namespace = cfg.tenant or DEFAULT_NAMESPACE
        self.max_ttl = cfg.max_pin_ttl
        self.pins = PinTable(cfg.max_ttl_pins, cfg.max_pin_ttl,
                             max_bytes=int(cfg.max_pin_share * cfg.local_cpu_size))

    # ------------------------------------------------------------ helpers
    def check_namespace(self, namespace: str | None) -> None:
        """Refuse a request naming a namespace this engine does not serve."""
        if namespace is not None and namespace != self.namespace:
            raise NamespaceError(f"this engine serves namespace {self.namespace!r}; "
                                 f"{str(namespace)[:64]!r} is not its to change")

    def keys(self, tokens: Tokens, salt: str | None, lora: str | None) -> list[ChunkKey]:
        """The prompt's chunk keys, from its request's root (a salted or LoRA request's
        chain is its own: :func:`lmc.token_database.request_root`)."""
        db = self.engine.db
        tag = request_tag(lora, salt)
        return db.keys(tokens, root=None if tag is None else request_root(db.namespace, tag))

    @staticmethod
    def _owner(session: str | None, keys: Sequence[ChunkKey]) -> tuple[str, Hashable]:
        # the last key chains the whole prompt (its tail included): one owner per prompt
        return ("session", session) if session is not None else ("prompt", keys[-1])

    # ------------------------------------------------------------ operations
    def pin(self, tokens: Tokens, ttl: float, *, priority: int | None = None,
            session: str | None = None, salt: str | None = None, lora: str | None = None,
            namespace: str | None = None, strict: bool = True) -> int:
        """See :meth:`CacheEngine.pin`."""
        self.check_namespace(namespace)
        ttl = check_ttl(ttl, self.max_ttl)
        if priority is not None:
            priority = check_priority(priority)
        keys = self.keys(tokens, salt, lora)
        if not keys:
            return 0
        objs = self.engine.storage.get_prefix(keys)  # lower tiers' hits promoted into L1
        owner = self._owner(session, keys)
        if not objs:
            self.pins.release(owner)
        else:
            n = self.pins.pin(owner, objs, ttl=ttl, keys=keys[:len(objs)], strict=strict)
            objs = objs[:n]
        if priority is not None:
            self.engine.storage.set_priority(keys, priority)
        n_tok = self.engine.db.num_tokens(tokens)
        got = min(len(objs) * self.engine.config.chunk_size, n_tok)
        log.debug("pinned %d of %d tokens for %.3g s (%s)", got, n_tok, ttl, owner[0])
        return got

    def keep_warm(self, keys: Sequence[ChunkKey], ttl: float | None, priority: int | None,
                  owner: tuple[str, Hashable]) -> int:
        """A request's cache hints on its saved chain (``keys``, already computed): pinned
        for ``ttl`` (capped at ``max_pin_ttl``) by ``owner``, replacing its last pins, as
        many leading chunks as the bounds allow; ``priority`` set. Chunks pinned."""
        n = 0
        if ttl is not None and keys:
            objs = self.engine.storage.get_prefix(keys)
            n = self.pins.pin(owner, objs, ttl=min(ttl, self.max_ttl),
                              keys=list(keys[:len(objs)]))
        if priority is not None and keys:
            self.engine.storage.set_priority(keys, check_priority(priority))
        return n

    def unpin(self, tokens: Tokens | None, session: str | None, salt: str | None,
              lora: str | None) -> int:
        """Drop the pins :meth:`pin` took for ``session`` or these tokens; chunks freed."""
        if session is not None:
            return self.pins.release(("session", session))
        if tokens is None:
            return 0
        keys = self.keys(tokens, salt, lora)
        return self.pins.release(self._owner(None, keys)) if keys else 0

    def set_priority(self, tokens: Tokens, priority: int, *, salt: str | None = None,
                     lora: str | None = None, namespace: str | None = None) -> int:
        """See :meth:`CacheEngine.set_priority`."""
        self.check_namespace(namespace)
        priority = check_priority(priority)
        keys = self.keys(tokens, salt, lora)
        return self.engine.storage.set_priority(keys, priority) if keys else 0

    def delete(self, tokens: Tokens, *, salt: str | None = None, lora: str | None = None,
               namespace: str | None = None) -> int:
        """See :meth:`CacheEngine.delete`."""
        self.check_namespace(namespace)
        keys = self.keys(tokens, salt, lora)
        if not keys:
            return 0
        self.pins.release_keys(keys)
        storage = self.engine.storage
        held = [k for k, p in zip(keys, storage.l1_contains(keys)) if p]
        n = storage.delete(keys)
        log.debug("deleted %d chunk copies of a %d-chunk prompt (%d in L1)", n, len(keys),
                  len(held))
        return n

    def clear(self, namespace: str | None = None) -> dict[str, int | None]:
        """See :meth:`CacheEngine.clear`."""
        self.check_namespace(namespace)
        unpinned = self.pins.clear()
        out = self.engine.storage.clear_namespace()
        log.info("cleared namespace %r: %s%s", self.namespace,
                 ", ".join(f"{t} {'?' if n is None else n}" for t, n in out.items()) or "nothing",
                 f" ({unpinned} pinned chunks released)" if unpinned else "")
        return out

    def stats(self) -> dict[str, int]:
        s = self.pins.stats()
        return {"ttl_pinned_chunks": s["pinned_chunks"], "ttl_pin_owners": s["pin_owners"],
                "ttl_pinned_bytes": self.pins.nbytes, "ttl_pins_refused": s["pins_refused"],
                "ttl_pins_expired": s["pins_expired"]}
