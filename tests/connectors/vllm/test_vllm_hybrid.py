"""lmc with real vLLM 0.32 (CPU) on a hybrid sliding-window/full model, with vLLM's hybrid
memory allocator on (the connector declares ``SupportsHMA``).

The model: a tiny random-weight Llama made here whose ``layer_types`` alternate 128-token
sliding-window and full attention (vLLM keeps two KV cache groups). Two vLLM processes
(``vllm_scripts/hybrid_scenarios.py``): one process stores, hits, shares prefixes, prefills in
chunks and batches; then the multi-process engine restarts from the disk tier, one prompt's
sliding-window part of one chunk deleted in between. Every output is compared token for
token with vLLM without lmc (float32, greedy). A state-space hybrid is not run: vLLM's CPU
build keeps a Mamba layer's state in place (no state at a chunk's end exists to store), and
lmc refuses such a model at start-up by name (checked with vLLM's own spec classes here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.connectors.vllm.test_vllm_integration import _env, _run, _vllm_python

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).resolve().parents[1] / "vllm_scripts"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-hybrid")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return make_tiny_checkpoint(work / "tiny-swa", max_position_embeddings=4096,
                                sliding_window=128)


def _drive(mode: str, work: Path, model: Path, **env: str) -> dict[str, Any]:
    out, log = work / f"{mode}.json", work / f"{mode}.log"
    _run([_vllm_python(), str(SCRIPTS / "hybrid_scenarios.py"), "--mode", mode,
          "--model", str(model), "--disk", str(work / "disk"), "--out", str(out)], log,
         _env(**env))
    data = json.loads(out.read_text())
    data["log"] = log.read_text()
    return data


@pytest.fixture(scope="module")
def mp0(work: Path, model: Path) -> dict[str, Any]:
    return _drive("mp0", work, model, VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.fixture(scope="module")
def mp1(work: Path, model: Path, mp0: dict[str, Any]) -> dict[str, Any]:
    # the attacker: one chunk of L stored without its sliding-window part (chunk 4, in the
    # windows of L's checkpoints 1280 and 1500)
    victim = mp0["L_parts"]["4"][mp0["sliding_group"]]
    files = [p for p in (work / "disk").rglob("*.kv") if p.name.startswith(victim)]
    assert len(files) == 1, files
    files[0].unlink()
    return _drive("mp1", work, model)


def _same(run: dict[str, Any], baseline: dict[str, Any], names: list[str]) -> None:
    for n in names:
        assert run["results"][n]["tokens"] == baseline[n.removesuffix("_again")]["tokens"], n


def test_vllm_keeps_its_hybrid_allocator_on_with_lmc(mp0, mp1):
    assert mp0["groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert mp0["plain_state"]["hma_disabled"] is False
    assert mp0["state"]["hma_disabled"] is False and mp1["state"]["hma_disabled"] is False
    for run in (mp0, mp1):
        assert "hybrid memory allocator is on" in run["log"]
        assert "Turning off hybrid kv cache manager" not in run["log"]
    assert mp0["lmc_groups"] == [["sliding", [0, 2], 128], ["full", [1, 3], 0]]


def test_kinds_lmc_cannot_serve_are_refused_by_name(mp0):
    """vLLM's own spec classes: a state-space hybrid's Mamba group and chunked local
    attention refuse the connector's start, naming the model kind."""
    assert mp0["refusals"]["mamba"].startswith("refused: KV cache group 1 holds "
                                               "state-space/linear-attention layers")
    assert "hybrid SSM model" in mp0["refusals"]["mamba"]
    assert "ChunkedLocalAttentionSpec" in mp0["refusals"]["chunked_local"]
    assert mp0["refusals"]["chunked_local"].startswith("refused")


def test_hits_are_served_and_outputs_equal_vllm_without_lmc(mp0):
    res, base = mp0["results"], mp0["baseline"]
    _same(mp0, base, list(res))
    cached = {n: r["cached"] for n, r in res.items()}
    assert cached["A"] == 0 and cached["A_again"] == 699  # the last token is vLLM's
    assert cached["B"] == 512  # shares 600 tokens: the last whole chunk, A's windows kept
    assert cached["L"] == 0 and cached["L2"] == 1280  # L's checkpoint
    # the window before 1024 was never stored (L's checkpoints are 1280 and 1500): a miss,
    # never full-attention KV without its sliding-window part
    assert cached["L3"] == 0
    assert (cached["C1"], cached["C2"], cached["C3"]) == (512, 1280, 0)
    s = mp0["stats"]
    assert s["worker.loaded_tokens"] == 699 + 512 + 1280 + 512 + 1280
    assert s["worker.async_loads"] == 5 and s["worker.async_load_failures"] == 0
    assert s["worker.load_failures"] == 0 and mp0["flushed"]


def test_restart_from_disk_multiprocess_and_a_missing_part(mp0, mp1):
    res = mp1["results"]
    _same(mp1, mp0["baseline"], list(res))
    assert res["A"]["cached"] == 699  # another process, from the disk tier
    # L's chunk 4 lost its sliding part: 1280 and 1500 cannot be served; 1024 can (L3's
    # own checkpoint at 1024 kept chunks 2 and 3's windows)
    assert res["L"]["cached"] == 1024
    assert res["L_again"]["cached"] == 1499  # the recompute stored the part again
    assert (res["D"]["cached"], res["D_again"]["cached"]) == (0, 799)
