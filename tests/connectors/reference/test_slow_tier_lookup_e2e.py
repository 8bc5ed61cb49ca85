"""A slow tier never holds a request up longer than recomputing would (issue 36), on the
reference engine with a fresh lmc engine (new ``CacheEngine``, empty L1) whose prompt sits in
a real disk tier behind a link that blocks until the test releases it.

The shape ``lmc demo --quick`` showed with its disk behind a 2 MiB/s link, after a restart:
lmc chose to recompute what the disk held, started a prefetch of it, and the next request's
lookup waited behind that prefetch on the link (TTFT p50 291 ms, the engine alone 193 ms).
Here the link is an :class:`threading.Event`: each request must finish, its tokens and logits
those of the engine alone, *while* the tier's call is still blocked -- on code that waits
for the tier it never finishes (the hang guard fails it). No clock is read: the tier's calls
block until released, however fast or loaded the machine is."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lmc.connectors.reference import LMCReferenceConnector
from lmc.reference import LLM, RequestOutput
from lmc.storage.wrappers import WrapperTier
from tests.connectors.reference.helpers import BLOCK, assert_same, plain_llm, prompt, run
from tests.connectors.reference.test_load_watch_e2e import fresh_engine
from tests.deadlines import HANG_S

P = prompt(37, 150)
Q = P[:100] + prompt(38, 60)[1:]  # shares P's first chunks


class BlockedLink(WrapperTier):
    """A link to the wrapped tier that carries one thing at a time and is stuck (until
    :meth:`release`): with ``stuck_from_start`` every call waits; otherwise reads
    (``get``) wait, and while one is waiting so does every ``contains`` (queued behind
    it, as on one connection)."""

    def __init__(self, *a, stuck_from_start: bool, **kw) -> None:
        super().__init__(*a, **kw)
        object.__setattr__(self, "stuck_from_start", stuck_from_start)
        object.__setattr__(self, "released", threading.Event())
        object.__setattr__(self, "reading", threading.Event())
        object.__setattr__(self, "blocked", [])  # the calls that had to wait, by name

    def _hold(self, op: str) -> None:
        if not self.released.is_set():
            self.blocked.append(op)
            assert self.released.wait(HANG_S), "never released"

    def release(self) -> None:
        self.released.set()

    def contains(self, keys):
        if self.stuck_from_start or self.reading.is_set():
            self._hold("contains")
        return self.inner.contains(keys)

    def get(self, keys):
        self.reading.set()
        self._hold("get")
        return self.inner.get(keys)


def store_on_disk(tiny_dir: Path, path: Path) -> None:
    """Engine A computes ``P`` and ``Q`` and writes their chunks to the disk directory."""
    conn = LMCReferenceConnector({"chunk_size": 32, "local_cpu_size": "32MiB",
                                  "local_disk": str(path), "local_disk_size": "64MiB"},
                                 model_dir=tiny_dir)
    llm = LLM(tiny_dir, kv_connector=conn, num_blocks=128, block_size=BLOCK)
    run(llm, [P, Q])
    assert conn.cache.flush(HANG_S)
    llm.close()


def finishes_while_blocked(llm, prompts: list[list[int]]) -> list[RequestOutput]:
    """Run ``prompts`` on a thread; fail if they are not done within the hang guard (the
    link is still blocked then: the test releases it only afterwards)."""
    out: list[list[RequestOutput]] = []
    t = threading.Thread(target=lambda: out.append(run(llm, prompts)), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "the request waited for the blocked tier"
    return out[0]


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> dict[str, RequestOutput]:
    p, q = run(plain_llm(tiny_dir), [P, Q])
    return {"P": p, "Q": q}


def _stats(conn, name: str) -> float:
    return sum(v for k, v in conn.cache.storage.stats().items() if k.endswith(f".{name}"))


def test_a_tier_stuck_at_lookup_is_a_miss(tiny_dir: Path, tmp_path: Path, want) -> None:
    """The tier's existence check never answers: the lookup goes on without it, the
    engine computes the prompt."""
    store_on_disk(tiny_dir, tmp_path / "d")
    llm, conn = fresh_engine(tiny_dir, tmp_path / "d", 32, lambda c, p, inner: BlockedLink(
        config=c, pool=p, inner=inner, stuck_from_start=True),
        lookup_min_wait=None)  # the deadline under test: the default
    link = conn.cache.storage.lower[0]
    try:
        got = finishes_while_blocked(llm, [P])
        assert not link.released.is_set() and "contains" in link.blocked
        assert_same(got, [want["P"]])
        assert got[0].num_cached_tokens == 0
        assert _stats(conn, "lookup_late") >= 1
        # said as what it is: not "never seen" but a tier that did not answer
        st = conn.stats()
        assert st["cache.lookup_unanswered_tokens"] == len(P)
        assert st["cache.funnel.miss.unanswered"] == len(P)
        assert st["cache.funnel.miss.never_seen"] == 0
        # a second request: the stuck call holds one of the tier's threads; still a miss
        assert_same(finishes_while_blocked(llm, [Q]), [want["Q"]])
    finally:
        link.release()
        llm.close()


def test_recompute_by_choice_does_not_wait_for_the_prefetch(tiny_dir: Path, tmp_path: Path,
                                                            want) -> None:
    """The demo's restart: the disk known to be slow, so lmc recomputes what it holds and
    prefetches it into L1; the prefetch's read holds the link. The request, and the next
    one (whose lookup queues behind that read on the link), finish without it."""
    store_on_disk(tiny_dir, tmp_path / "d")
    llm, conn = fresh_engine(
        tiny_dir, tmp_path / "d", 32, lambda c, p, inner: BlockedLink(
            config=c, pool=p, inner=inner, stuck_from_start=False),
        # the disk at 1 KiB/s, the engine at a million tokens/s: recomputing always wins
        priors={"local_storage": 1024, "prefill": 1_000_000},
        lookup_min_wait=None)  # the deadline under test: the default
    link = conn.cache.storage.lower[0]
    try:
        got = finishes_while_blocked(llm, [P])
        assert_same(got, [want["P"]])
        assert conn.stats()["policy.recomputed_by_choice"] > 0
        # the prefetch of the recomputed chunks is reading: the link is held
        assert link.reading.wait(HANG_S) and not link.released.is_set()
        got = finishes_while_blocked(llm, [Q])
        assert not link.released.is_set() and "contains" in link.blocked
        assert_same(got, [want["Q"]])
        assert _stats(conn, "lookup_late") + _stats(conn, "lookup_busy") >= 1
    finally:
        link.release()
        llm.close()
