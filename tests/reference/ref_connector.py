"""A trivial in-memory KV connector for tests: proves the engine's hooks are enough to
save a prefix's KV and load it back into another request's blocks.

KV is kept per full block, keyed by a chained hash of the token prefix up to that
block's end, one tensor ``[2, block_size, kv_heads, head_size]`` per layer. Loads run
layer by layer in ``wait_for_layer_load``; saves are staged per layer and committed in
``wait_for_save``. ``fail_next_load`` makes the next load write NaN into its first block
and report that block through ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmc.reference import KVConnector, SchedulerOutput


@dataclass
class Load:
    request_id: str
    block_ids: list[int]
    start: int  # first position to load
    end: int  # one past the last
    hashes: list[int]  # hash of each block touched, in order from block start // bs


@dataclass
class StepMeta:
    loads: list[Load] = field(default_factory=list)
    saves: list[tuple[str, int, int]] = field(default_factory=list)  # (req, block_id, hash)


class InMemoryConnector(KVConnector):
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.store: dict[int, list[torch.Tensor]] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.layer_names: list[str] = []
        self.fail_next_load = False
        self.events: list[tuple] = []
        self.finished: list[str] = []
        self._pending: dict[str, Load] = {}
        self._meta: StepMeta | None = None
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        self._staged: dict[int, dict[int, torch.Tensor]] = {}

    def block_hashes(self, tokens: list[int]) -> list[int]:
        hashes, h = [], 0
        for j in range(len(tokens) // self.block_size):
            h = hash((h, tuple(tokens[j * self.block_size : (j + 1) * self.block_size])))
            hashes.append(h)
        return hashes

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        hits = 0
        for h in self.block_hashes(request.all_token_ids):
            if h not in self.store:
                break
            hits += 1
        self.events.append(("lookup", request.request_id, hits * self.block_size))
        return max(0, hits * self.block_size - num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.events.append(("alloc", request.request_id, num_external_tokens))
        if num_external_tokens == 0:
            return
        start = request.num_computed_tokens
        end = start + num_external_tokens
        hashes = self.block_hashes(request.all_token_ids)
        first, last = start // self.block_size, -(-end // self.block_size)
        self._pending[request.request_id] = Load(
            request.request_id, list(block_ids), start, end, hashes[first:last]
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMeta:
        meta = StepMeta()
        bs = self.block_size
        for sched in scheduler_output.scheduled_requests:
            load = self._pending.pop(sched.request_id, None)
            if load is not None:
                assert sched.num_external_tokens == load.end - load.start
                assert sched.num_computed_tokens == load.end
                meta.loads.append(load)
            hashes = self.block_hashes(list(sched.token_ids))
            first = sched.num_computed_tokens // bs
            for j in range(first, sched.end_position // bs):
                if hashes[j] not in self.store:
                    meta.saves.append((sched.request_id, sched.block_ids[j], hashes[j]))
        self.events.append(("meta", len(meta.loads), len(meta.saves)))
        return meta

    def request_finished(self, request: Any) -> None:
        assert request.block_ids or request.num_computed_tokens == 0
        self.finished.append(request.request_id)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layer_names = list(kv_caches)
        self.kv_caches = list(kv_caches.values())

    def start_load_kv(self, meta: StepMeta) -> None:
        self._meta = meta
        self._failed_requests = set()
        if self.fail_next_load and meta.loads:
            self.fail_next_load = False
            load = meta.loads[0]
            bad = load.block_ids[load.start // self.block_size]
            self._failed_blocks.add(bad)
            self._failed_requests.add(load.request_id)
        self.events.append(("start_load",))

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.events.append(("wait_layer", layer_idx))
        kv = self.kv_caches[layer_idx]
        bs = self.block_size
        for load in self._meta.loads:
            for n, h in enumerate(load.hashes):
                j = load.start // bs + n
                block = load.block_ids[j]
                lo = max(load.start, j * bs) - j * bs
                hi = min(load.end, (j + 1) * bs) - j * bs
                if block in self._failed_blocks:
                    kv[:, block, lo:hi] = float("nan")  # what a torn read might leave
                else:
                    kv[:, block, lo:hi] = self.store[h][layer_idx][:, lo:hi]

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: StepMeta) -> None:
        self.events.append(("save_layer", layer_idx))
        assert kv_layer is self.kv_caches[layer_idx]
        for req_id, block, h in meta.saves:
            if req_id not in self._failed_requests:  # its KV was computed from bad input
                self._staged.setdefault(h, {})[layer_idx] = kv_layer[:, block].clone()

    def wait_for_save(self) -> None:
        self.events.append(("wait_save",))
        for h, layers in self._staged.items():
            if len(layers) == len(self.kv_caches):
                self.store.setdefault(h, [layers[i] for i in range(len(layers))])
        self._staged.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
