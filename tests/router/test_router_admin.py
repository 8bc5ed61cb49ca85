"""``lmc router``'s cache control and prefetches (lmc/router/admin.py) in front of two real
reference-engine servers (subprocesses, lmc with a small memory tier, a disk tier and KV
events): a clear reaches both instances, a pin the one the prompt is routed to, a scoped
token cannot steer another namespace, and a prompt held only on an instance's disk is
prefetched into its memory when the router sends it there. Threat model:
docs/threats/router.md."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from lmc.http.admin import AdminAuth, AdminToken
from lmc.reference import make_tiny_checkpoint
from lmc.router.admin import RouterAdmin
from tests.deadlines import HANG_S
from tests.kvutil import random_tokens
from tests.router.helpers import http, instances
from tests.router.test_router import complete, running, synced, wait_indexed

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("admin-fleet")
    ckpt = make_tiny_checkpoint(work / "tiny", hidden=64, layers=2, vocab=512,
                                max_position_embeddings=2048)
    # a 2 MiB pool holds ~40 chunks of 64 tokens; the disk keeps what memory evicts. Lookups
    # wait for the disk's answer and hits load whole: what a prompt's hit is then depends on
    # what the tiers hold, not on how a loaded host schedules the disk's answers and reads
    extra = (f"local_disk: {work}/disk-{{name}}\nlocal_disk_size: 64MiB\n"
             f"lookup_min_wait: {HANG_S}\nload_policy: load_all\n")
    with instances(ckpt, work, 2, pool="2MiB", extra=extra) as insts:
        yield insts


def memory_holder(pair) -> str:
    """The instance holding the most chunks in memory: where the last prompt was computed."""
    return max(pair, key=lambda i: stats(i.url).get("cache.cpu.chunks", 0)).url


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/lmc/stats", timeout=60) as r:
        return json.loads(r.read())


def admin(url: str, op: str, body: dict, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url + f"/admin/cache/{op}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"}
                                             if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_admin_ops_fan_out_and_pins_go_where_the_prompt_goes(pair):
    r = running([i.spec for i in pair])
    try:
        synced(r)
        prompt = [t % 512 for t in random_tokens(256, seed=901)]
        complete(r, prompt)
        # the pin goes where the router's index says the prompt is: once its events are in
        holder = memory_holder(pair)
        wait_indexed(r, holder, prompt)
        status, out = admin(r.url, "pin", {"prompt": prompt, "ttl": 30})
        assert status == 200 and len(out["instances"]) == 1, out
        (url, ans), = out["instances"].items()
        assert ans["status"] == 200 and ans["pinned_tokens"] == 256, out
        assert stats(url)["cache.ttl_pinned_chunks"] == 4
        status, out = admin(r.url, "clear", {})
        assert status == 200 and sorted(out["instances"]) == sorted(i.url for i in pair)
        assert all(a["status"] == 200 for a in out["instances"].values()), out
        assert stats(url)["cache.ttl_pinned_chunks"] == 0
        status, out = admin(r.url, "delete", {"prompt": "text", "sneaky": 1})
        assert status == 400 and "unknown field" in out["error"]["message"]
    finally:
        r.close()


def test_a_scoped_token_must_name_a_namespace_it_holds(pair, tmp_path):
    (tmp_path / "b").write_text("team-b-secret-0123456789")
    auth = AdminAuth([AdminToken.parse(f"{tmp_path / 'b'}:team-b")])
    r = running([i.spec for i in pair], admin=RouterAdmin(auth))
    try:
        tok = "team-b-secret-0123456789"
        assert admin(r.url, "clear", {})[0] == 401
        status, out = admin(r.url, "clear", {}, tok)
        assert status == 403 and "name one in 'namespace'" in out["error"]["message"]
        status, out = admin(r.url, "clear", {"namespace": "default"}, tok)
        assert status == 403 and "does not grant namespace 'default'" in out["error"]["message"]
        # granted at the router, refused by each instance: not their namespace
        status, out = admin(r.url, "clear", {"namespace": "team-b"}, tok)
        assert status == 200 and all(a["status"] == 403 and a["error"]["rule"] == "namespace"
                                     for a in out["instances"].values()), out
    finally:
        r.close()


def test_a_prompt_held_only_on_disk_is_prefetched_where_it_is_routed(pair):
    r = running([i.spec for i in pair])
    try:
        synced(r)
        admin(r.url, "clear", {})
        prompt = [t % 512 for t in random_tokens(512, seed=902)]
        complete(r, prompt)
        holder = memory_holder(pair)
        wait_indexed(r, holder, prompt)
        before = stats(holder)["cache.prefetches"]
        for seed in range(6):  # straight to the holder: 6 x 12 chunks push it out of memory
            status, _ = http(holder + "/v1/completions",
                             {"prompt": [t % 512 for t in random_tokens(768, seed=950 + seed)],
                              "max_tokens": 1})
            assert status == 200
        inst = next(i for i in r.instances if i.url == holder)
        end = time.monotonic() + HANG_S
        while True:  # the events say: on the holder's disk, no longer in its memory
            m = r.fleet.pick(prompt, None)
            r.fleet.done(m.instance)
            if m.instance is inst and m.match is not None and m.match.storage > m.match.cpu:
                break
            assert time.monotonic() < end, (m, r.state())
            time.sleep(0.1)
        answer = complete(r, prompt)
        assert r.admin.prefetches == {"sent": 1, "failed": 0}
        assert stats(holder)["cache.prefetches"] == before + 1
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 448
    finally:
        r.close()
