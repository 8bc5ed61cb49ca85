"""``lmc pd-proxy`` choosing among several prefill and decode instances by the router's policy:
three real reference-engine servers (subprocesses, lmc with a memory tier and KV events on,
the events real ZMQ from the engines' lmc). A prompt whose prefix decode instance B cached
(asked directly, so no proxy saw it) has its decode sent to B under ``--policy prefix``, and
B serves it from its cache with the tokens a single instance computes; the same for a prefill
instance; ``round_robin`` (the default without events) takes turns whatever is cached.

The instances share no tier: a prefill instance answers ``kv_transfer_params`` (``kv_both``),
and a decode instance waits ``--remote-prefill-wait`` (1 s here; 30 s by default, which made
every uncached decode of these tests 30 s long) for chunks that never come, then prefills
itself -- from its own cache when it holds the prefix, which is what makes "routed to where
it is cached" visible in its reported ``cached_tokens``."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from lmc.reference import make_tiny_checkpoint
from lmc.router.dispatch import Fleet
from lmc.router.pd_proxy import Proxy
from lmc.router.policy import PromptKeys
from tests.kvutil import random_tokens
from tests.router.helpers import ROOT, Instance, http, instances

pytestmark = pytest.mark.integration
N = 256  # prompt tokens cached: 4 chunks of 64, 16 engine blocks of 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pdtiny") / "tiny", hidden=64,
                                layers=2, vocab=512, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, ckpt):
    with instances(ckpt, tmp_path_factory.mktemp("pdfleet"), 3,
                   serve_args=["--remote-prefill-wait", "1"]) as insts:
        yield insts


def running(prefill: list[Instance], decode: list[Instance], **kw: Any) -> Proxy:
    p = Proxy([i.spec for i in prefill], [i.spec for i in decode], **kw)
    threading.Thread(target=p.serve_forever, daemon=True).start()
    return p


def synced(fleets: list[Fleet], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not all(i.source is None or i.source.synced for p in fleets for i in p.instances):
        assert time.monotonic() < end, [p.state() for p in fleets]
        time.sleep(0.1)


def indexed(fleet: Fleet, url: str, tokens: list[int], timeout: float = 30.0) -> None:
    """Wait until ``fleet``'s index of ``url`` holds all of ``tokens``' full blocks."""
    src = next(i for i in fleet.instances if i.url == url).source
    assert src is not None
    keys = PromptKeys(tokens)
    end = time.monotonic() + timeout
    while not src.index.block_size or src.index.match(keys.at(src.index.block_size)
                                                      ).storage < N // 16:
        assert time.monotonic() < end, f"{url}: the prompt is not indexed"
        time.sleep(0.05)


def complete(url: str, prompt: list[int], **extra: Any) -> dict:
    status, answer = http(url + "/v1/completions", {
        "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True,
        **extra})
    assert status == 200, answer
    return answer


def routed(p: Proxy, role: str) -> dict[tuple[str, str], int]:
    return {(u, why): n for u, per in p.state()["routed"][role].items()
            for why, n in per.items()}


def test_a_prefix_cached_on_decode_instance_b_is_decoded_on_b(fleet):
    a, b, c = fleet
    p = running([a], [b, c], policy="prefix")
    try:
        synced([p.decode])
        for seed, there in ((11, c), (12, c), (13, b)):  # round robin would say b, c, b
            base = [t % 512 for t in random_tokens(N, seed=seed)]
            complete(there.url, base)  # cached on `there` only, behind the proxy's back
            indexed(p.decode, there.url, base)
            prompt = base + [7, 8, 9]
            want = complete(a.url, prompt)["choices"][0]["token_ids"]
            before = routed(p, "decode")
            answer = complete(p.url, prompt)
            after = routed(p, "decode")
            assert after.get((there.url, "prefix"), 0) == before.get((there.url, "prefix"),
                                                                      0) + 1, after
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == N
            assert answer["choices"][0]["token_ids"] == want  # bit-exact from B's cache
        assert p.state()["instances"]["decode"][0]["events"]["fresh"]
    finally:
        p.close()


def test_a_prefix_cached_on_prefill_instance_c_is_prefilled_on_c(fleet):
    a, b, c = fleet
    p = running([b, c], [a], policy="prefix")
    try:
        synced([p.prefill])
        base = [t % 512 for t in random_tokens(N, seed=21)]
        complete(c.url, base)
        indexed(p.prefill, c.url, base)
        complete(p.url, base + [1, 2], stream=True)  # streamed: relayed as it came
        assert routed(p, "prefill") == {(c.url, "prefix"): 1}
        assert p.counts["prefill_failures"] == 0 and p.counts["decode_failures"] == 0
    finally:
        p.close()


def test_text_prompts_are_scored_with_the_engines_tokenizer(fleet, ckpt):
    """``--tokenizer``: a text prompt whose start decode instance C cached (as text) is
    decoded on C, from its cache."""
    from lmc.reference.tokenizer import Tokenizer
    a, b, c = fleet
    tok = Tokenizer(ckpt / "tokenizer.json")
    rng = random.Random(51)
    text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "omega"]) +
                    str(rng.randrange(100)) for _ in range(200))
    assert len(tok.encode(text)) > N
    p = running([a], [b, c], tokenizer=tok)  # policy: prefix, as an instance has events
    try:
        assert p.policy == "prefix"
        synced([p.decode])
        status, _ = http(c.url + "/v1/completions", {"prompt": text, "max_tokens": 1})
        assert status == 200
        indexed(p.decode, c.url, tok.encode(text))
        answer = complete(p.url, text + " and then", return_token_ids=False)
        assert routed(p, "decode") == {(c.url, "prefix"): 1}
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= N
    finally:
        p.close()


def test_round_robin_takes_turns_whatever_is_cached(fleet):
    a, b, c = fleet
    p = running([a], [b, c], policy="round_robin")
    try:
        base = [t % 512 for t in random_tokens(128, seed=31)]
        complete(b.url, base)
        for _ in range(4):
            complete(p.url, base)
        assert routed(p, "decode") == {(b.url, "round_robin"): 2, (c.url, "round_robin"): 2}
    finally:
        p.close()


def test_the_cli_takes_events_and_policy_and_routes_by_prefix(fleet, tmp_path):
    """``lmc pd-proxy --decode URL,events=...,replay=...``: the default policy is then
    prefix; the choice is visible in ``GET /lmc/pd-proxy``."""
    a, b, c = fleet
    base = [t % 512 for t in random_tokens(N, seed=41)]
    log = tmp_path / "proxy.log"
    args = [sys.executable, "-m", "lmc.cli", "pd-proxy", "--port", "0", "--prefill", a.url]
    for i in (b, c):
        args += ["--decode", f"{i.url},events={i.events},replay={i.replay}"]
    with open(log, "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=err, text=True)

    def c_events() -> dict:
        return http(url + "/lmc/pd-proxy")[1]["instances"]["decode"][1]["events"]

    try:
        line = proc.stdout.readline()
        assert "(prefix)" in line, (line, log.read_text()[-2000:])
        url = re.search(r" at (http://[\d.]+:\d+)", line).group(1)
        end = time.monotonic() + 30
        while not c_events()["synced"]:
            assert time.monotonic() < end, c_events()
            time.sleep(0.1)
        before = c_events()["blocks"]
        complete(c.url, base)  # cached on C, behind the proxy's back
        while c_events()["blocks"] < before + N // 16:  # C's events say so
            assert time.monotonic() < end + 30, c_events()
            time.sleep(0.1)
        answer = complete(url, base + [3])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == N
        _, st = http(url + "/lmc/pd-proxy")
        assert st["routed"]["decode"] == {c.url: {"prefix": 1}}, st
        assert st["policy"] == "prefix" and st["requests"] == 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert "Traceback" not in log.read_text()
