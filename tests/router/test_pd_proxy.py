"""``lmc pd-proxy`` in front of two reference-engine servers (``python -m
lmc.reference.serve``), a ``kv_producer`` and a ``kv_consumer`` sharing a P2P directory:
a completion through the proxy is prefilled on the producer, pulled by the consumer over
NIXL as an asynchronous load, and decoded there: greedy tokens equal a single instance's
(fp32), streamed or not; the consumer computed only the last prompt token."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmc.reference import LLM, make_tiny_checkpoint
from tests.reference.prompts import random_prompt
from tests.server.daemon_proc import ROOT, DaemonProc
from tests.storage.backends.p2p.conftest import require_nixl

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


def _http(url: str, body: dict | None = None, timeout: float = 120) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _serve(ckpt: Path, role: str, cfg: Path, work: Path, env: dict) -> subprocess.Popen:
    ready = work / f"{role}.json"
    return subprocess.Popen(
        [sys.executable, "-m", "lmc.reference.serve", "--model", str(ckpt), "--port", "0",
         "--lmc-config", str(cfg), "--kv-role", role, "--num-blocks", "128",
         "--engine-id", role, "--ready-file", str(ready)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=open(work / f"{role}.log", "w"))  # noqa: SIM115


def _ready(proc: subprocess.Popen, path: Path, log: Path, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"server not ready (rc={proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return json.loads(path.read_text())["url"]


def test_pd_proxy_prefills_on_the_producer_and_decodes_on_the_consumer(tmp_path):
    require_nixl()
    ckpt = make_tiny_checkpoint(tmp_path / "llama")
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    cfg = tmp_path / "lmc.yaml"
    cfg.write_text(f"chunk_size: 64\nlocal_cpu_size: 64MiB\npin_memory: false\n"
                   f"remote_url: p2p+lmc://127.0.0.1:{d.info['port']}?ns=pd-proxy\n"
                   f"remote_timeout: 5.0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    prompts = [random_prompt(21, 300), random_prompt(22, 200)]
    procs = []
    try:
        procs.append(prod := _serve(ckpt, "kv_producer", cfg, tmp_path, env))
        procs.append(cons := _serve(ckpt, "kv_consumer", cfg, tmp_path, env))
        procs.append(proxy := subprocess.Popen(
            [sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill", "P",
             "--decode", "D"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
            stderr=subprocess.STDOUT))
        assert "expected http://host:port" in proxy.communicate(timeout=60)[0]
        assert proxy.returncode == 2  # bad URLs are refused by name
        with LLM(ckpt, num_blocks=128) as ref:  # the single instance, while servers start
            want = [o.token_ids for o in ref.generate(prompts, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True)]
        p_url = _ready(prod, tmp_path / "kv_producer.json", tmp_path / "kv_producer.log")
        c_url = _ready(cons, tmp_path / "kv_consumer.json", tmp_path / "kv_consumer.log")
        procs.append(proxy := subprocess.Popen(
            [sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill", p_url,
             "--decode", c_url], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
            stderr=open(tmp_path / "proxy.log", "w")))  # noqa: SIM115
        url = re.search(r" at (http://[\d.]+:\d+)", proxy.stdout.readline()).group(1)
        # not streamed
        out = json.loads(_http(url + "/v1/completions", {
            "model": "tiny", "prompt": prompts[0], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "return_token_ids": True}))
        got = out["choices"][0]["token_ids"]
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        # streamed: tokens arrive one event each, then usage
        events = _http(url + "/v1/completions", {
            "prompt": prompts[1], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}).decode().split("\n\n")
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        usage = chunks[-1]["usage"]
        stats = json.loads(_http(c_url + "/lmc/stats"))
        prod_stats = json.loads(_http(p_url + "/lmc/stats"))
        counts = json.loads(_http(url + "/lmc/pd-proxy"))
        for p in (prod, cons, proxy):
            p.send_signal(signal.SIGTERM)
        assert [p.wait(60) for p in (prod, cons, proxy)] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        d.kill()
    assert got == want[0] and streamed == want[1], (got, streamed, want)
    assert cached == len(prompts[0]) - 1, out["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompts[1]) - 1, usage
    assert stats["worker.async_loads"] == 2 and stats["worker.async_load_failures"] == 0
    assert stats["worker.tokens_from_p2p"] == len(prompts[0]) + len(prompts[1]) - 2, stats
    assert stats["worker.saves"] == 0 and prod_stats["worker.loads"] == 0  # the roles held
    assert counts["requests"] == 2 and counts["prefill_failures"] == 0, counts
