"""``lmc replay`` against real HTTP servers on loopback: lmc's OpenAI-compatible reference
server (``python -m lmc.reference.serve``, a separate process with lmc) and, for the
"unknown" path, a plain HTTP server that is no inference server at all.

Checked: streamed TTFT and usage per request, outputs equal to the engine's in-process
(greedy, fp32), per-tier hits read from the server's own lmc counters and equal to the
per-request ``cached_tokens``, failures (HTTP 400, 501) recorded while the replay goes on,
and hits reported as unknown, never guessed, when the server has no lmc counters."""

from __future__ import annotations

import _thread
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmc.reference import LLM, make_tiny_checkpoint
from lmc.workloads import TraceRequest
from lmc.workloads import generators as g
from lmc.workloads.http_target import replay_http
from lmc.workloads.replay import replay_reference

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("LMC_TEST_SEED", random.randrange(1 << 16)))


def _start(cmd: list[str], ready: Path, log: Path, timeout: float = 120) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"{cmd[2]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{cmd[2]} not ready in {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", hidden=64, layers=2,
                                max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("srv")
    cfg = work / "lmc.yaml"
    cfg.write_text("chunk_size: 64\nlocal_cpu_size: 32MiB\n")
    ready = work / "ready.json"
    proc = _start([sys.executable, "-m", "lmc.reference.serve", "--model", str(model),
                   "--port", "0", "--lmc-config", str(cfg), "--ready-file", str(ready)],
                  ready, work / "server.log")
    try:
        yield json.loads(ready.read_text())["url"]
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def trace(model) -> list[TraceRequest]:
    tok = g.load_tokenizer(model)
    spec = g.PrefixSpec(groups=2, prompts_per_group=3, system_tokens=200, question_tokens=10,
                        output_len=3, seed=SEED)
    return list(g.render(g.prefix_drafts(spec, tok), g.arrival_times(6, None, SEED), tok))


def test_replay_over_http_matches_the_engine_and_counts_hits_per_tier(server, model, trace):
    print("seed", SEED)
    with LLM(model) as llm:
        want = {r.request_id: r.output_ids
                for r in replay_reference(trace, llm, fast=True, concurrency=1).records}
    res = replay_http(trace, server, fast=True, concurrency=1)
    assert not res.failed, [r.error for r in res.failed]
    assert {r.request_id: r.output_ids for r in res.records} == want
    by_id = {r.request_id: r for r in res.records}
    seen: set[str] = set()
    for req in trace:
        rec = by_id[req.request_id]
        assert rec.prompt_tokens == len(req.prompt_tokens) and rec.output_tokens == 3
        assert 0 < rec.ttft_s <= rec.latency_s
        if req.prefix_group in seen:
            assert rec.cached_tokens >= 192, rec
        else:
            assert rec.cached_tokens == 0, rec
            seen.add(req.prefix_group)
    assert "/lmc/stats" in res.tier_source
    assert res.tier_tokens == {"cpu": sum(r.cached_tokens for r in res.records)}
    assert res.load_failures == 0
    again = replay_http(trace, server, fast=True)  # all at once; every prefix now cached
    assert {r.request_id: r.output_ids for r in again.records} == want
    assert again.tier_tokens["cpu"] == sum(r.cached_tokens for r in again.records)
    assert all(r.cached_tokens >= 192 for r in again.records)
    f = again.funnel  # from the server's /lmc/stats, over this replay alone
    assert f is not None and f["engine_used"] == sum(r.cached_tokens for r in again.records)
    assert f["prompt_tokens"] == sum(r.prompt_tokens for r in again.records)
    assert f["best_possible"] == f["prompt_tokens"]  # every prompt seen in the first replay


def test_text_prompts_timed_arrivals_and_failures(server, model):
    ok = [TraceRequest(0.0, "text-0", None, None, None, "The river runs under a bridge.", 2),
          TraceRequest(0.3, "text-1", None, None, None, "A bridge crosses the quiet river.", 2)]
    bad = [TraceRequest(0.3, "too-long", None, None, [5] * 3000, None, 2),
           TraceRequest(0.4, "bad-id", None, None, [5, 10**6], None, 2)]
    res = replay_http(ok + bad, server)
    assert res.mode == "timed"
    by_id = {r.request_id: r for r in res.records}
    for req in ok:
        rec = by_id[req.request_id]
        assert rec.ok and rec.due_s >= req.arrival_s and rec.output_tokens == 2
        assert rec.prompt_tokens > 3  # from the server's usage: it tokenized the text
    # refused before the stream (HTTP 400) or inside it (an error event): the reason is kept
    assert "max_model_len" in by_id["too-long"].error, by_id["too-long"].error
    assert "out of range" in by_id["bad-id"].error, by_id["bad-id"].error
    assert len(res.failed) == 2


def test_an_interrupted_replay_stops_at_once(server):
    """Ctrl-C mid-stream: the open streams are cut and queued requests dropped, so the
    replay ends in about a second, not when the server has finished every answer; what it
    returns is marked interrupted and holds only the requests that finished (none here)."""
    reqs = [TraceRequest(0.0, f"long-{i}", None, None, [5 + i] * 20, None, 1500)
            for i in range(3)]
    timer = threading.Timer(2.0, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    try:
        res = replay_http(reqs, server, fast=True, concurrency=2)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 6
    assert res.interrupted and res.total_requests == 3 and res.records == []
    assert not [t for t in threading.enumerate() if t.name.startswith("lmc-replay")]


def test_a_server_without_lmc_counters_reports_them_unknown(tmp_path, trace):
    """A real HTTP server that is not an inference server: every completion fails with its
    HTTP status, and the tier hits are unknown with the reason, not zero."""
    ready = tmp_path / "ready"
    script = ("import http.server, sys, pathlib\n"
              "s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), "
              "http.server.SimpleHTTPRequestHandler)\n"
              "pathlib.Path(sys.argv[1]).write_text(str(s.server_address[1]))\n"
              "s.serve_forever()\n")
    proc = _start([sys.executable, "-c", script, str(ready)], ready, tmp_path / "log")
    try:
        url = f"http://127.0.0.1:{ready.read_text()}"
        with pytest.raises(OSError, match="/v1/models answered HTTP 404; pass --model"):
            replay_http(trace[:1], url)
        res = replay_http(trace[:2], url, model="m", fast=True)
    finally:
        _stop(proc)
    assert len(res.failed) == 2 and all(r.error.startswith("HTTP 501") for r in res.failed)
    assert res.tier_tokens is None and res.timeline == []
    assert res.tier_source.startswith("unknown:") and "/metrics answered HTTP 404" in \
        res.tier_source and "/lmc/stats answered HTTP 404" in res.tier_source


def test_prometheus_page_parsing():
    """The page format vLLM with lmc serves (prometheus_client text: HELP/TYPE lines, one
    series per engine and stat, a ``_created`` sample per counter)."""
    from lmc.workloads.http_target import parse_lmc_stats, parse_tier_metrics

    page = "\n".join([
        "# HELP lmc:connector_total lmc connector counters summed over workers",
        "# TYPE lmc:connector_total counter",
        'lmc:connector_total{engine="0",model_name="m",stat="tokens_from_cpu"} 768.0',
        'lmc:connector_total{engine="1",model_name="m",stat="tokens_from_cpu"} 64.0',
        'lmc:connector_total{engine="0",model_name="m",stat="tokens_from_disk"} 1.5e3',
        'lmc:connector_total{engine="0",model_name="m",stat="load_failures"} 2.0',
        'lmc:connector_total{engine="0",model_name="m",stat="saved_tokens"} 9.0',
        'lmc:connector_created{engine="0",model_name="m",stat="saved_tokens"} 1.7e9',
        'vllm:external_prefix_cache_hits_total{engine="0"} 999.0',
    ])
    assert parse_tier_metrics(page) == ({"cpu": 832.0, "disk": 1500.0}, 2.0)
    assert parse_tier_metrics('vllm:num_requests_running{engine="0"} 0.0') is None
    assert parse_lmc_stats({"worker.tokens_from_cpu": 5, "worker.load_failures": 0,
                            "cache.hits": 3}) == ({"cpu": 5.0}, 0.0)
    assert parse_lmc_stats([1]) is None
