"""``lmc pd-proxy``'s new inputs attacked (docs/threats/http.md, "Choosing by KV events"):
a ``--policy`` that is none, instance specs with bad ``events=``/``replay=``, a
``--tokenizer`` that is none, events
endpoints where nothing listens, a replay socket that never answers, a publisher that lies
(claims a prefix the instance does not hold) and then falls silent, and random bodies
through a proxy whose events are live. Each bad option is refused by name before anything
listens; every request is answered (by the honest instances, the tokens an untouched engine
gives): events can misroute a request, never fail or hold it.

The instances are the reference engine's server in this process (no lmc); the publishers
are real ZMQ sockets the test writes to (``Forger``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings

from lmc.events import wire
from lmc.router.dispatch import InstanceSpec
from lmc.router.pd_proxy import Proxy
from tests.http.kit import (
    BODIES,
    LIMITS,
    NORMAL,
    PROMPT,
    expected_tokens,
    message,
    post,
    running_server,
    tiny_model,
)
from tests.router.helpers import free_port
from tests.router.test_router_attacks import Forger
from tests.server.daemon_proc import ROOT


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("pdev"))


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return expected_tokens(ckpt)


@pytest.fixture(scope="module")
def one(ckpt):
    with running_server(ckpt) as srv:
        yield srv


@pytest.fixture(scope="module")
def two(ckpt):
    with running_server(ckpt) as srv:
        yield srv


def start(p: Proxy) -> Proxy:
    threading.Thread(target=p.serve_forever, daemon=True).start()
    return p


def served(p: Proxy, want: list[int]) -> None:
    status, raw = post(p.port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want


def reasons(p: Proxy, role: str = "decode") -> dict[str, dict[str, int]]:
    return p.state()["routed"][role]


def lmc_pd_proxy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", *args],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ bad options

def test_a_policy_that_is_none_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--policy 'closest': choose one of prefix, "
                                         r"round_robin"):
        Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], policy="closest")
    r = lmc_pd_proxy("--policy", "closest", "--prefill", "http://127.0.0.1:1", "--decode",
                     "http://127.0.0.1:2")
    assert r.returncode == 2 and "--policy" in r.stderr and "invalid choice" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,spec,words", [
    ("--decode", "http://127.0.0.1:2,events=udp://127.0.0.1:3", "not a tcp:// or ipc://"),
    ("--decode", "http://127.0.0.1:2,replay=tcp://127.0.0.1:3", "replay= needs events="),
    ("--prefill", "http://127.0.0.1:2,events=tcp://h:3,events=tcp://h:4", "expected URL"),
    ("--prefill", "http://127.0.0.1:2,colour=blue", "expected URL"),
    ("--decode", "http://127.0.0.1:99999,events=tcp://h:3", "expected http://host:port"),
])
def test_bad_instance_specs_are_refused_naming_the_flag(flag, spec, words):
    other = "--prefill" if flag == "--decode" else "--decode"
    r = lmc_pd_proxy(flag, spec, other, "http://127.0.0.1:5")
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    if "host:port" not in words:
        assert flag in r.stderr


@pytest.mark.parametrize("content", [None, b"\x00\xffnot a tokenizer", b"{}"],
                         ids=["missing", "binary", "empty object"])
def test_a_tokenizer_that_cannot_be_loaded_is_refused_by_name(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    r = lmc_pd_proxy("--tokenizer", str(path), "--prefill", "http://127.0.0.1:1", "--decode",
                     "http://127.0.0.1:2")
    assert r.returncode == 2 and f"--tokenizer {path}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ events that fail

def test_events_endpoints_where_nothing_listens_fall_back_to_turns(one, two, want):
    """Nothing publishes and nothing answers a replay: the sources never sync, every
    request is scored stale (least loaded, in turn) and answered."""
    specs = [InstanceSpec(u.url, f"tcp://127.0.0.1:{free_port()}",
                          f"tcp://127.0.0.1:{free_port()}") for u in (one, two)]
    p = start(Proxy([one.url], specs, limits=LIMITS, policy="prefix", stale_after=1.0))
    try:
        for _ in range(4):
            served(p, want)
        assert reasons(p) == {one.url: {"stale": 2}, two.url: {"stale": 2}}
        assert not any(i["events"]["synced"] for i in p.state()["instances"]["decode"])
    finally:
        p.close()


def test_a_replay_socket_that_never_answers_holds_no_request(one, two, want):
    """The feed asks the replay socket for a dump and gets nothing: its wait is the feed
    thread's, not a request's. Requests go on, scored stale."""
    f = Forger(replay=True)
    p = start(Proxy([one.url], [InstanceSpec(one.url, f.endpoint, f.replay), two.url],
                    limits=LIMITS, stale_after=1.0))
    try:
        assert p.policy == "prefix"  # an instance has events: prefix by default
        for seq in range(3):
            f.send(b"t", wire.seq_bytes(seq), wire.encode_batch([]))  # a dump is asked
            served(p, want)
        src = p.decode.instances[0].source
        assert src is not None and not src.synced
        assert {r for per in reasons(p).values() for r in per} == {"stale"}
    finally:
        p.close()
        f.close()


def claim(seq: int) -> list[bytes]:
    """A forged batch: the instance holds :data:`PROMPT` (two blocks of 4) in CPU memory."""
    ev = wire.block_stored([1001, 1002], None, PROMPT, 4, wire.CPU)
    return [b"t", wire.seq_bytes(seq), wire.encode_batch([ev])]


def test_a_lying_publisher_misroutes_and_its_silence_ends_its_credit(one, two, want):
    """A publisher claims decode instance ONE holds the prompt (it does not): the decode
    goes there by prefix and ONE answers right anyway (it prefills). Once the publisher
    falls silent past ``stale_after``, the claim is worth nothing."""
    f = Forger()
    p = start(Proxy([two.url], [InstanceSpec(one.url, f.endpoint), two.url],
                    limits=LIMITS, stale_after=1.0))
    try:
        src = p.decode.instances[0].source
        assert src is not None
        seq, end = 0, time.monotonic() + 10
        while src.index.blocks < 2:  # PUB/SUB joins late: send until it is heard
            assert time.monotonic() < end, p.state()
            f.send(*claim(seq))
            seq += 1
            time.sleep(0.05)
        for _ in range(3):
            f.send(*claim(seq))
            seq += 1
            served(p, want)
        assert reasons(p) == {one.url: {"prefix": 3}}
        time.sleep(1.5)  # silent past stale_after
        served(p, want)
        served(p, want)
        got = reasons(p)
        assert got[one.url].get("prefix") == 3 and sum(got[two.url].values()) >= 1, got
        assert {r for per in got.values() for r in per} == {"prefix", "stale"}
    finally:
        p.close()
        f.close()


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(BODIES)
def test_fuzz_a_prefix_proxy_answers_200_or_a_4xx(one, two, body):
    """Random bodies (prompts of every shape, salts of every type) through a proxy scoring
    by prefix with a live, lying publisher: 200, or a 4xx with a message."""
    f = Forger()
    p = start(Proxy([one.url], [InstanceSpec(one.url, f.endpoint), two.url], limits=LIMITS))
    try:
        for seq in range(3):
            f.send(*claim(seq))
        status, raw = post(p.port, json.dumps(body).encode(), timeout=20)
        if status != 200:
            assert 400 <= status < 500 and message(raw), (status, raw[:300])
    finally:
        p.close()
        f.close()
