"""Prefill/decode with real vLLM (CPU, fp32): a ``kv_producer`` prefills (``max_tokens=1``,
``do_remote_decode``), a ``kv_consumer`` given the producer's ``kv_transfer_params`` reports
the prompt as an asynchronous hit, pulls it over NIXL in the background and decodes.

* its greedy tokens equal a single instance's (the consumer itself, before anything was
  exported, prefilling the same prompts), and it prefilled nothing: lmc loaded the prompt
  less its last token from the P2P tier (vLLM's ``num_cached_tokens`` on a decode
  instance is by design the producer's own prefix hits, passed along as
  ``remote_prefill_cached_tokens``: 0 here);
* a transfer that never comes (parameters naming a prefill no producer did) is recomputed
  after ``remote_prefill_wait``: the same tokens, reported as an async load failure.

Both vLLM processes run ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker in one
process each) and are started together: a start costs 20-40 s here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.connectors.vllm.test_vllm_integration import _env, _vllm_python
from tests.server.daemon_proc import ROOT, DaemonProc

from .conftest import require_nixl

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parent / "vllm_pd_proc.py"
MAX_TOKENS = 8
WAIT = 2.0  # the consumer's remote_prefill_wait


class VllmProc:
    def __init__(self, py: str, role: str, model: Path, url: str, log: Path) -> None:
        env = _env(PYTHONPATH=str(ROOT), NIXL_LOG_LEVEL="WARN")
        self.log = log
        self.proc = subprocess.Popen([py, str(SCRIPT), role, str(model), url, str(WAIT)],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
                                     text=True, start_new_session=True)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@lmc "):
                return json.loads(line[5:])
        tail = self.log.read_text()[-4000:]
        raise RuntimeError(f"vLLM process ended (rc={self.proc.wait(30)}); log tail:\n{tail}")

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self.read()
        assert "error" not in out, out
        return out

    def exit(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.flush()
            assert self.read() == {"closed": True}
        assert self.proc.wait(60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(30)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(14)
    return {name: [rng.randrange(5, 1000) for _ in range(n)]
            for name, n in (("a", 700), ("b", 530), ("late", 600))}


def test_vllm_consumer_pulls_the_producers_prefill(tmp_path):
    require_nixl()
    py = _vllm_python()
    model = make_tiny_checkpoint(tmp_path / "tiny", max_position_embeddings=4096)
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    url = f"p2p+lmc://127.0.0.1:{d.info['port']}?ns=vllm-pd"
    procs: list[VllmProc] = []
    try:
        t0 = time.monotonic()
        procs.append(prod := VllmProc(py, "kv_producer", model, url, tmp_path / "prod.log"))
        procs.append(cons := VllmProc(py, "kv_consumer", model, url, tmp_path / "cons.log"))
        assert prod.read()["ready"] == "kv_producer" and cons.read()["ready"] == "kv_consumer"
        started = time.monotonic() - t0
        prompts = _prompts()
        # the single-instance reference: the consumer prefills everything itself while
        # nothing is exported anywhere (its lookups miss)
        want = cons("generate", prompts=prompts, max_tokens=MAX_TOKENS, params={})
        assert all(w["cached"] == 0 for w in want.values()), want
        pd = {"a": prompts["a"], "b": prompts["b"]}
        pre = prod("generate", prompts=pd, max_tokens=1,
                   params={n: {"do_remote_decode": True} for n in pd})
        for n, out in pre.items():
            kp = out["kv_transfer_params"]
            assert kp["do_remote_prefill"] and kp["lmc_pd"], kp
            assert kp["remote_num_tokens"] == len(pd[n]), kp
            assert out["tokens"] == want[n]["tokens"][:1]
        got = cons("generate", prompts=pd, max_tokens=MAX_TOKENS,
                   params={n: pre[n]["kv_transfer_params"] for n in pd})
        stats = cons("stats")
        # a transfer that never comes: recomputed after the wait, same tokens
        fake = {"do_remote_prefill": True, "do_remote_decode": False, "lmc_pd": 1,
                "remote_num_tokens": len(prompts["late"]), "remote_engine_id": "gone"}
        late = cons("generate", prompts={"late": prompts["late"]}, max_tokens=MAX_TOKENS,
                    params={"late": fake})["late"]
        after = cons("stats")
        prod_stats = prod("stats")
        for p in procs:
            p.exit()
        print(f"vLLM starts {started:.1f}s, whole test {time.monotonic() - t0:.1f}s")
    finally:
        for p in procs:
            p.kill()
        d.kill()
    for n in pd:
        assert got[n]["tokens"] == want[n]["tokens"], (n, got[n], want[n])
        # vLLM reports a decode instance's num_cached_tokens as the *producer's* prefix
        # hits (remote_prefill_cached_tokens, 0 here), not the transfer's size
        assert got[n]["cached"] == pre[n]["kv_transfer_params"].get(
            "remote_prefill_cached_tokens", 0) == 0, (n, got[n])
    # the consumer computed only the last prompt token of each: the rest was pulled
    assert stats["async_loads"] == 2 and stats["async_load_failures"] == 0, stats
    assert stats["loaded_tokens"] == sum(len(p) - 1 for p in pd.values()), stats
    assert stats["tokens_from_p2p"] == stats["loaded_tokens"], stats
    assert stats["p2p"]["hits"] >= 5 and stats["p2p"]["stale"] == 0, stats
    assert prod_stats["p2p"]["exports"] >= 5, prod_stats
    assert late["tokens"] == want["late"]["tokens"], late
    assert after["async_load_failures"] == 1 and after["async_loads"] == 3, after
    assert late["seconds"] >= WAIT
