"""The LMCache #4663 failure as a test: a RAG stream of novel queries must keep its reuse.

Each query retrieves 3 of 8 documents in a random order under one system prompt and asks a
new question. lmc's L1 (3 MiB) holds every document's segment KV a few times over, but not
a prefix chain of the whole prompt per query. With the blend connector, a blended request
stores its segments and its system prompt only, so after the documents have been seen once
every query reuses all of its documents. Saving each query's prefix chain as well (a blender
on the plain connector) floods L1 and evicts the documents: reuse decays, which is what the
control shows.
"""

from __future__ import annotations

from pathlib import Path

from lmc.blend.blender import SegmentBlender
from lmc.blend.rag_workload import make_rag_workload
from lmc.blend.store import SegmentStore
from lmc.reference import LLM

WORKLOAD = make_rag_workload(num_docs=8, doc_words=30, k=3, num_queries=45, question_words=8,
                             system_words=10, seed=1)
LMC = {"chunk_size": 16, "local_cpu_size": "3MiB"}


def _reuse_by_thirds(llm: LLM, blender: SegmentBlender) -> list[float]:
    reuse = []
    for q in WORKLOAD.queries:
        ids, spans = WORKLOAD.prompt_tokens(q, llm.tokenizer.encode)
        before = blender.stats.tokens_reused
        llm.generate(ids, max_tokens=1, segments=spans)
        reuse.append((blender.stats.tokens_reused - before) / sum(e - s for s, e in spans))
    n = len(reuse) // 3
    return [sum(reuse[i:i + n]) / n for i in range(0, 3 * n, n)]


def test_novel_queries_keep_their_reuse(llama_dir: Path) -> None:
    with LLM(llama_dir, num_blocks=96, lmc_config=LMC,
             blend={"override": True, "ratio": 0.15}) as llm:
        blender = llm.kv_connector.blender
        thirds = _reuse_by_thirds(llm, blender)
        stats = llm.kv_connector.stats()
        doc_tokens = sum(len(llm.tokenizer.encode(d, False)) for d in WORKLOAD.documents)
    assert thirds[1] == thirds[2] == 1.0, thirds
    # each document is computed alone and stored once; prefix saves stop at the system prompt
    assert blender.stats.tokens_stored == doc_tokens
    system = len(llm.tokenizer.encode(WORKLOAD.system, True))
    assert doc_tokens < stats["cache.store_tokens"] <= doc_tokens + system


def test_control_prefix_chains_per_query_flood_the_cache(llama_dir: Path) -> None:
    with LLM(llama_dir, num_blocks=96, lmc_config=LMC) as llm:
        blender = SegmentBlender(SegmentStore(llm.kv_connector.cache), llm.config, 0.15)
        llm.runner.blender = blender
        thirds = _reuse_by_thirds(llm, blender)
    assert thirds[2] < 0.7, thirds  # documents evicted by per-query prefix chunks
