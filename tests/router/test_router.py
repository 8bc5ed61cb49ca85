"""``lmc router`` in front of three real reference-engine servers (subprocesses, lmc with a
memory tier and KV events on): a prompt whose prefix one instance cached goes back there and
is served from its cache; round robin ignores that; a killed instance is routed around; an
instance whose events are silent is scored as caching nothing; the metrics say all of it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lmc.reference import make_tiny_checkpoint
from lmc.router.app import InstanceSpec, Router
from lmc.router.index import block_keys
from tests.deadlines import HANG_S
from tests.kvutil import random_tokens
from tests.router.helpers import http, instances

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    ckpt = make_tiny_checkpoint(work / "tiny", hidden=64, layers=2, vocab=512,
                                max_position_embeddings=2048)
    with instances(ckpt, work, 3) as insts:
        yield insts


def running(specs: list[InstanceSpec], **kw: Any) -> Router:
    r = Router(specs, health_interval=0.5, **kw)
    threading.Thread(target=r.serve_forever, daemon=True).start()
    return r


def synced(r: Router, timeout: float = HANG_S) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(i.source is None or i.source.synced for i in r.instances):
            return
        time.sleep(0.1)
    raise AssertionError(f"events not synced: {r.state()}")


def complete(r: Router, prompt: list[int], stream: bool = False) -> dict:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    status, answer = http(r.url + "/v1/completions", body)
    assert status == 200, answer
    return answer if isinstance(answer, dict) else {"raw": answer}


def routed(r: Router) -> dict[tuple[str, str], float]:
    out = {}
    for fam in r.metrics.requests.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[(s.labels["instance"], s.labels["reason"])] = s.value
    return out


def wait_indexed(r: Router, url: str, prompt: list[int], timeout: float = HANG_S) -> None:
    """Until the router's index of ``url`` holds every full block of ``prompt`` itself: a
    count of blocks would be met at once by the blocks of an earlier test's prompts (the
    fleet is the module's, and a router syncs what each instance holds)."""
    inst = next(i for i in r.instances if i.url == url)
    end = time.monotonic() + timeout
    assert inst.source is not None
    while True:
        index = inst.source.index
        bs = index.block_size
        held = index.match(block_keys(prompt, bs)).storage if bs else 0
        if bs and held == len(prompt) // bs:
            return
        assert time.monotonic() < end, f"{url} indexed {held} blocks of the prompt"
        time.sleep(0.05)


def test_prefix_policy_sends_a_cached_prefix_back_where_it_is_cached(fleet):
    r = running([i.spec for i in fleet])
    try:
        synced(r)
        for seed in range(3):
            base = [t % 512 for t in random_tokens(256, seed=500 + seed)]
            before = routed(r)
            complete(r, base)
            first = routed(r)
            (url, _), = [k for k in first if first[k] != before.get(k, 0)]
            wait_indexed(r, url, base)  # its memory tier holds the prompt's 16 blocks
            answer = complete(r, base + [7, 8, 9, 10, 11])
            after = routed(r)
            assert after.get((url, "prefix"), 0) == first.get((url, "prefix"), 0) + 1, after
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        text = r.prometheus().decode()
        assert 'lmc_router_predicted_cached_tokens_total{instance="' in text
        # the router counts an answer's cached tokens after it has relayed the answer, so
        # the client can be back before the last count lands
        deadline, reported = time.monotonic() + HANG_S, 0.0
        while reported < 3 * 256 and time.monotonic() < deadline:
            reported = sum(s.value for f in r.metrics.reported.collect() for s in f.samples
                           if s.name.endswith("_total"))
            time.sleep(0.05)
        assert reported >= 3 * 256
    finally:
        r.close()


def test_streamed_answers_pass_through_and_report_cached_tokens(fleet):
    r = running([i.spec for i in fleet])
    try:
        synced(r)
        base = [t % 512 for t in random_tokens(192, seed=600)]
        before = routed(r)
        complete(r, base, stream=True)
        first = routed(r)
        (url, _), = [k for k in first if first[k] != before.get(k, 0)]
        wait_indexed(r, url, base)  # the prompt's 12 blocks reached the router
        answer = complete(r, base + [1, 2, 3], stream=True)
        raw = answer["raw"]
        assert b"data: [DONE]" in raw and b'"cached_tokens": 192' in raw
        assert any(k[1] == "prefix" for k in routed(r))
    finally:
        r.close()


def test_round_robin_takes_turns_whatever_is_cached(fleet):
    r = running([i.spec for i in fleet], policy="round_robin")
    try:
        base = [t % 512 for t in random_tokens(128, seed=700)]
        for _ in range(6):
            complete(r, base)
        counts = routed(r)
        assert sorted(counts.values()) == [2, 2, 2]
        assert {k[1] for k in counts} == {"round_robin"}
    finally:
        r.close()


def test_silent_events_are_stale_and_requests_still_flow(fleet):
    """Events endpoints where nothing publishes: never synced, so no prefix credit."""
    from tests.router.helpers import free_port
    specs = [InstanceSpec(i.url, f"tcp://127.0.0.1:{free_port()}",
                          f"tcp://127.0.0.1:{free_port()}") for i in fleet]
    r = running(specs, stale_after=1.0)
    try:
        base = [t % 512 for t in random_tokens(128, seed=800)]
        for _ in range(3):
            complete(r, base)
        assert {k[1] for k in routed(r)} == {"stale"}
        assert all(not i["events"]["fresh"] for i in r.state()["instances"])
    finally:
        r.close()


def test_a_killed_instance_is_routed_around(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", hidden=64, layers=2, vocab=512,
                                max_position_embeddings=1024)
    with instances(ckpt, tmp_path, 2) as two:
        r = running([i.spec for i in two], policy="round_robin")
        try:
            two[0].proc.kill()
            two[0].proc.wait(10)
            base = [t % 512 for t in random_tokens(64, seed=900)]
            for _ in range(4):  # every request answered, by the survivor
                complete(r, base)
            assert not next(i for i in r.instances if i.url == two[0].url).healthy
            healthy = f'lmc_router_instance_healthy{{instance="{two[0].url}"}} 0.0'
            assert healthy in r.prometheus().decode()
            two[1].stop()
            status, answer = http(r.url + "/v1/completions", {"prompt": base, "max_tokens": 1})
            assert status == 503 and "no healthy instance" in answer["error"]["message"]
        finally:
            r.close()


def test_cli_refuses_bad_instance_specs(tmp_path: Path):
    for bad in ("http://h:1,events=udp://x:1", "http://h:1,replay=tcp://h:2",
                "http://h:1,events=tcp://h:2,foo=bar", "ftp://h:1"):
        with pytest.raises(ValueError):
            Router([InstanceSpec.parse(bad)])
