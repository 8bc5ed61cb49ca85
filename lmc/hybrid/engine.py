"""A ``CacheEngine``'s stores, lookups and loads for a hybrid model (several KV groups).

The engine keeps its plain paths for one group; with ``spec.groups`` it hands these calls
to :class:`HybridCache`, which applies :mod:`lmc.hybrid.rules` over the same storage:
each chunk's parts (one per group, keyed by :func:`~lmc.hybrid.rules.part_key`) are stored
as the group's kind requires, a lookup reports only the ends every group can serve, and a
load fetches, per group, the parts a continuation at its end needs -- or, if any is missing
by the time it runs, loads only up to the largest end it can still serve whole (nothing, if
none): never one group's KV for a longer prefix than another's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmc.hybrid.layerwise import GroupedRetrieve, GroupedStore, GroupHost
from lmc.hybrid.rules import HitRule, chunk_ends, part_keys
from lmc.layerwise import CopyLease, LayerwiseHost, LayerwiseRetrieve, LayerwiseStore
from lmc.memory.pool import LazyTensors, Lease, MemoryObj, PoolArrays
from lmc.storage.layered_read import READY, LayerGate
from lmc.storage.lookup import LookupResult, servable_end
from lmc.storage.manager import StorageManager
from lmc.storage.speeds import KVBytes
from lmc.token_database import Chunk, ChunkedTokenDatabase, ChunkKey, Tokens
from lmc.transfer.grouped import GroupedTransfer
from lmc.transfer.kv_groups import FULL, SLIDING, STATE
from lmc.transfer.kv_spec import KVSpec
from lmc.transfer.plan import ChunkRanges

log = logging.getLogger(__name__)


@dataclass
class GroupWork:
    """One group's share of a store or a load: its chunks (part keys), objects, plan."""

    group: int
    chunks: list[Chunk]
    objs: list[MemoryObj]
    plan: Any = None
    where: list[int] | None = None
    gate: LayerGate = READY
    needed: int = 0  # parts a load needs of this group (a load: all of them, or short)

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.needed


class HybridCache:
    """Store, lookup and load paths for ``spec.groups`` (see the module doc)."""

    def __init__(self, spec: KVSpec, db: ChunkedTokenDatabase, storage: StorageManager,
                 host: LayerwiseHost, tier_names: Sequence[str], interval: int,
                 metrics: Any = None) -> None:
        self.spec = spec
        self.db = db
        self.storage = storage
        self.host = host
        self.tier_names = tuple(tier_names)
        self.metrics = metrics
        self.rule = HitRule(spec.groups, db.chunk_size, interval)

    @property
    def groups(self) -> tuple:
        return self.spec.groups

    # ----------------------------------------------------------------- keys
    def parts(self, keys: Sequence[ChunkKey]) -> list[list[bytes]]:
        """Per group, the part keys of ``keys``."""
        return [part_keys(keys, gi) for gi in range(len(self.groups))]

    def load_bytes(self) -> KVBytes:
        """What a load of N positions moves, group by group (the load policy's price):
        full groups every position, a sliding group at most its window and the chunk it
        starts in, a state group its rows once."""
        per_token = fixed = 0.0
        windows = []
        cs = self.db.chunk_size
        for gi, g in enumerate(self.groups):
            shape = self.spec.group_chunk_shape(gi, 1)
            row = float(np.prod(shape)) * self.spec.group_dtype(gi).itemsize
            if g.kind == STATE:
                fixed += row
            elif g.kind == SLIDING:
                windows.append((g.window + cs - 1, row))
            else:
                per_token += row
        return KVBytes(per_token, tuple(windows), fixed)

    # ---------------------------------------------------------------- lookup
    def lookup(self, tokens: Tokens, keys: Sequence[ChunkKey]
               ) -> tuple[LookupResult, list[bytes]]:
        """The hit (its servable points) and the part keys a load at its end needs."""
        n = self.db.num_tokens(tokens)
        cs = self.db.chunk_size
        if not keys:
            return LookupResult.miss(cs, self.tier_names), []
        parts = self.parts(keys)
        k = len(keys)
        where = self.storage.sources([p for ps in parts for p in ps])
        per_group = [where[g * k:(g + 1) * k] for g in range(len(parts))]
        present = [[w >= 0 for w in ws] for ws in per_group]
        ends = chunk_ends(n, cs, k)
        points = self.rule.points(present, ends)
        if not points:
            return LookupResult.miss(cs, self.tier_names), []
        end = points[-1]
        last = -(-end // cs)
        sources = [0] * last
        needed: list[bytes] = []
        for gi, g in enumerate(self.groups):
            for i in self.rule.margin(g, end):
                sources[i] = max(sources[i], per_group[gi][i])
                needed.append(parts[gi][i])
        return (LookupResult(end, cs, self.tier_names, bytes(sources), tuple(points),
                             self.rule.slack), needed)

    # ----------------------------------------------------------------- store
    def plan_store(self, tokens: Tokens, tr: GroupedTransfer, slots: list[torch.Tensor],
                   mask: Any, keys: Sequence[ChunkKey] | None, horizon: int | None
                   ) -> list[GroupWork]:
        """Per group, the parts of this call's chunks it keeps (present ones skipped), their
        freshly allocated objects (owned by the caller) and the copy's plan."""
        chunks = self.db.process_tokens(tokens, mask, keys)
        if not chunks:
            return []
        n = self.db.num_tokens(tokens)
        checkpoints = self.rule.checkpoints(n if horizon is None else max(horizon, n))
        out: list[GroupWork] = []
        for gi, g in enumerate(self.groups):
            keep = [c for c in chunks if self.rule.keeps(g, c[0], c[1], checkpoints)]
            todo = self._absent(gi, keep)
            todo = self._mapped(gi, todo, slots[gi])
            objs = self._allocate(gi, todo)
            todo = todo[:len(objs)]
            plan = tr.parts[gi].plan(slots[gi], [(s, e) for s, e, _ in todo]) if todo else None
            out.append(GroupWork(gi, todo, objs, plan))
        return out

    def _absent(self, gi: int, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` re-keyed as group ``gi``'s parts, those already in L1 left out."""
        keyed = [(s, e, k) for (s, e, _), k in zip(chunks, part_keys([c[2] for c in chunks],
                                                                    gi))]
        if not keyed:
            return keyed
        present = self.storage.l1_touch([k for _, _, k in keyed])
        if self.metrics is not None and True in present:
            self.metrics.skipped("present", sum(present))
        return [c for c, p in zip(keyed, present) if not p]

    def _mapped(self, gi: int, chunks: list[Chunk], slots: torch.Tensor) -> list[Chunk]:
        """Chunks whose every slot is mapped (a state part: its last position's row); an
        unmapped part is skipped, never half-stored."""
        if not chunks:
            return chunks
        s = slots.cpu().numpy() if slots.device.type != "cpu" else slots.numpy()
        state = self.groups[gi].kind == STATE
        keep = [c for c in chunks if (s[c[1] - 1] >= 0 if state else s[c[0]:c[1]].min() >= 0)]
        if self.metrics is not None and len(keep) < len(chunks):
            self.metrics.skipped("unmapped_slots", len(chunks) - len(keep))
        return keep

    def _allocate(self, gi: int, chunks: list[Chunk]) -> list[MemoryObj]:
        """Objects for ``chunks``' parts, runs of one size at a time; a full pool stops it
        (the parts after a failed allocation are not stored)."""
        objs: list[MemoryObj] = []
        i = 0
        while i < len(chunks):
            size = chunks[i][1] - chunks[i][0]
            j = i
            while j < len(chunks) and chunks[j][1] - chunks[j][0] == size:
                j += 1
            got = self.storage.allocate_many(self.spec.group_chunk_shape(gi, size),
                                             self.spec.group_dtype(gi), j - i, size)
            objs += got
            if len(got) < j - i:
                if self.metrics is not None:
                    self.metrics.skipped("pool_full", len(chunks) - len(objs))
                break
            i = j
        return objs

    def store(self, works: list[GroupWork], tr: GroupedTransfer) -> int:
        """Copy every group's parts now and make them visible; returns the positions the
        lead (first full) group stored."""
        keys: list[bytes] = []
        objs: list[MemoryObj] = []
        with CopyLease([o for w in works for o in w.objs]) as lease:
            for w in works:
                if not w.chunks:
                    continue
                part = tr.parts[w.group]
                arrays = PoolArrays(w.objs) if tr.device.type == "cpu" else None
                lease.attach(part.gather(w.plan, LazyTensors(w.objs), arrays=arrays)).wait()
                keys += [k for _, _, k in w.chunks]
                objs += w.objs
            if keys:
                self.storage.put(keys, objs)
        return self._lead_tokens(works)

    def _lead_tokens(self, works: list[GroupWork]) -> int:
        lead = next((w for w in works if self.groups[w.group].kind == FULL), None)
        return sum(e - s for s, e, _ in (lead.chunks if lead is not None else ()))

    def store_layer(self, works: list[GroupWork], tr: GroupedTransfer) -> GroupedStore:
        stores = [LayerwiseStore(GroupHost(self.host, self.groups[w.group].num_layers),
                                 tr.parts[w.group], w.plan, w.chunks, w.objs) for w in works]
        return GroupedStore(tr, self.groups, stores)

    # ------------------------------------------------------------------ load
    def fetch(self, tokens: Tokens, mask: Any, keys: Sequence[ChunkKey] | None,
              end: int | None, layered: bool) -> tuple[list[GroupWork], int, int]:
        """Per group, the parts a load ending at ``end`` (default: every token) needs from
        the first unmasked chunk on, acquired; the served end (lower than ``end`` if a part
        went missing since the lookup: then only what every group can serve at that end);
        and the first unmasked position."""
        n = self.db.num_tokens(tokens)
        cs = self.db.chunk_size
        keys = self.db.keys(tokens) if keys is None else self.db.check_keys(keys, n)
        first_pos = -(-self.db.mask_prefix(mask, n) // cs) * cs
        first = first_pos // cs
        end = n if end is None else min(end, n)
        if end <= first_pos:
            return [GroupWork(gi, [], []) for gi in range(len(self.groups))], first_pos, first_pos
        ends = chunk_ends(n, cs, len(keys))
        works = [self._fetch_group(gi, keys, ends, end, first, layered)
                 for gi in range(len(self.groups))]
        served = self._served_end(works, ends, end, first)
        if served < end:  # a part went missing since the lookup: what can still be served?
            held = self.storage.sources([p for ps in self.parts(keys) for p in ps])
            k = len(keys)
            present = [[w >= 0 for w in held[g * k:(g + 1) * k]] for g in range(len(works))]
            alt = servable_end(self.rule.points(present, ends, first, exact=True), 0, end)
            if alt > served:  # a shorter load needs other parts (an earlier window): again
                for w in works:
                    Lease(w.objs).release()
                works = [self._fetch_group(gi, keys, ends, alt, first, layered)
                         for gi in range(len(self.groups))]
                served = self._served_end(works, ends, alt, first)
            if served < end:
                self._trim(works, served, first)
        return works, served, first_pos

    def _fetch_group(self, gi: int, keys: Sequence[ChunkKey], ends: list[int], end: int,
                     first: int, layered: bool) -> GroupWork:
        g = self.groups[gi]
        need = self.rule.needed(g, end, first)
        if g.kind == STATE and (not need or ends[need[-1]] != end):
            return GroupWork(gi, [], [], where=[], needed=1)  # no state stored at that end
        wanted = [(i * self.db.chunk_size, ends[i], keys[i]) for i in need]
        pk = part_keys([k for _, _, k in wanted], gi)
        if layered:
            objs, where, gate = self.storage.fetch_prefix_layered(pk)
        else:
            objs, where = self.storage.fetch_prefix(pk)
            gate = READY
        chunks = [(s, e, k) for (s, e, _), k in zip(wanted, pk)][:len(objs)]
        objs = self._check_shapes(gi, chunks, objs)
        return GroupWork(gi, chunks[:len(objs)], objs, where=where[:len(objs)],
                         gate=gate.prefix(len(objs)), needed=len(need))

    def _check_shapes(self, gi: int, chunks: list[Chunk], objs: list[MemoryObj]
                      ) -> list[MemoryObj]:
        """The objects up to the first of the wrong shape or dtype (deleted: a value no
        part of this engine could have written is never served again)."""
        dtype = self.spec.group_dtype(gi)
        for i, (o, (s, e, k)) in enumerate(zip(objs, chunks)):
            want = self.spec.group_chunk_shape(gi, e - s)
            if o.shape != want or o.dtype != dtype:
                log.error("KV group %d part of chunk %d holds %s %s, expected %s %s: deleted, "
                          "treated as a miss", gi, s // self.db.chunk_size, o.shape, o.dtype,
                          want, dtype)
                self.storage.delete([k])
                Lease(objs[i:]).release()
                return objs[:i]
        return objs

    def _served_end(self, works: list[GroupWork], ends: list[int], end: int,
                    first: int) -> int:
        """The largest end ``<= end`` every group can serve from what was fetched."""
        if all(w.complete for w in works):
            return end
        present = []
        for w in works:
            have = [False] * len(ends)
            for s, _, _ in w.chunks:
                have[s // self.db.chunk_size] = True
            present.append(have)
        return servable_end(self.rule.points(present, ends, first, exact=True), 0, end)

    def _trim(self, works: list[GroupWork], served: int, first: int) -> None:
        """Keep, per group, only the parts a load ending at ``served`` needs: a prefix of
        what was fetched (a shorter load's window starts no later, its last chunk no
        later), or nothing if they are not one (then ``served`` was not servable)."""
        cs = self.db.chunk_size
        for w in works:
            g = self.groups[w.group]
            need = list(self.rule.needed(g, served, first)) if served > first * cs else []
            got = [s // cs for s, _, _ in w.chunks]
            m = len(need) if got[:len(need)] == need else 0
            if g.kind == STATE and m and w.chunks[m - 1][1] != served:
                m = 0
            Lease(w.objs[m:]).release()
            w.chunks, w.objs = w.chunks[:m], w.objs[:m]
            w.where = (w.where or [])[:m]
            w.gate = w.gate.prefix(m)
            w.needed = len(need)

    def retrieve_layer(self, works: list[GroupWork], tr: GroupedTransfer,
                       slots: list[torch.Tensor], served: int, first_pos: int
                       ) -> GroupedRetrieve:
        rets = []
        for w in works:
            part = tr.parts[w.group]
            ranges: Sequence[tuple[int, int]] = [(s, e) for s, e, _ in w.chunks]
            if ranges:  # consecutive chunks as process_tokens cut them: one run
                regular = ChunkRanges(ranges[0][0], self.db.chunk_size, len(ranges),
                                      ranges[-1][1])
                ranges = regular if list(regular) == list(ranges) else ranges
            plan = part.plan(slots[w.group], ranges) if w.chunks else None
            names = [self.tier_names[i] for i in (w.where or [])]
            rets.append(LayerwiseRetrieve(GroupHost(self.host, self.groups[w.group].num_layers),
                                          part, plan, w.chunks, w.objs, names, w.gate))
        return GroupedRetrieve(self.groups, rets, max(0, served - first_pos))

    # -------------------------------------------------------------- prefetch
    def prefetch(self, keys: Sequence[ChunkKey], first: int, n: int,
                 cancelled: Any) -> int:
        """Pull every group's stored parts of chunks ``first..`` into L1 (a piece at a time,
        stopping when ``cancelled()``); returns the end then servable from L1 alone."""
        cs = self.db.chunk_size
        parts = self.parts(keys)
        for gi in range(len(self.groups)):
            todo = parts[gi][first:]
            where = self.storage.sources(todo)
            lower = [k for k, w in zip(todo, where) if w > 0]
            for i in range(0, len(lower), 4):
                if cancelled():
                    return min(first * cs, n)
                Lease(self.storage.get_prefix(lower[i:i + 4])).release()
        present = [self.storage.l1_contains(ps) for ps in parts]
        points = self.rule.points(present, chunk_ends(n, cs, len(keys)))
        return points[-1] if points else 0

    def pinned(self, needed: Sequence[bytes]) -> list[MemoryObj]:
        """The L1 objects of ``needed``, acquired (what a pinned lookup holds)."""
        return [o for o in self.storage.l1.get(list(needed)) if o is not None]
