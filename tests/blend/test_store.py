"""Segments in a real ``CacheEngine``: a request's tag (``cache_salt``, LoRA) keeps its
segments apart (issue 33, section 5), and the same tag finds them."""

from __future__ import annotations

from pathlib import Path

import torch

from lmc.blend.store import SegmentStore
from lmc.cache_engine import CacheEngine
from lmc.config import CacheConfig
from lmc.reference import LLM
from lmc.reference.attention import slots_for_positions
from lmc.token_database import request_tag
from lmc.transfer.kv_spec import KVSpec
from tests.blend.helpers import tokens


def test_two_salts_share_no_segments_and_one_salt_shares_them(llama_dir: Path) -> None:
    llm = LLM(llama_dir, num_blocks=32)
    caches = llm.runner.kv_caches
    for i, kv in enumerate(caches):  # distinct values in every slot, per layer
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(i)))
    spec = KVSpec.from_tensors(llm.runner.named_kv_caches(), "vllm_flash")
    cfg = CacheConfig.load(overrides={"chunk_size": 16, "local_cpu_size": "8MiB"})
    with CacheEngine(cfg, spec, "m") as engine:
        store = SegmentStore(engine)
        doc = tokens(5, 37)
        table = torch.arange(32)
        src = slots_for_positions(table[:3], torch.arange(37), llm.block_size)
        dst = slots_for_positions(table[8:11], torch.arange(37), llm.block_size)
        alice, bob = request_tag(cache_salt="alice"), request_tag(cache_salt="bob")
        assert store.save(doc, caches, src, alice) == 37
        assert store.contains(doc, alice)
        assert not store.contains(doc, bob) and not store.contains(doc, None)
        assert not store.contains(doc, request_tag(lora_name="alice"))
        assert not store.load(doc, caches, dst, bob)
        assert store.load(doc, caches, dst, alice)
        for kv in caches:  # alice's own KV, bit for bit
            assert torch.equal(kv.flatten(1, 2)[:, dst], kv.flatten(1, 2)[:, src])
        assert store.save(doc, caches, src, bob) == 37  # bob stores his own copy
        assert store.contains(doc, bob) and not store.contains(doc, None)
