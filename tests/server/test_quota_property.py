"""Property test of the daemon's quota ledgers against replies being sent (issue 20's slow
reader): tenants store, read and hold replies unsent, release them and delete in any order;
the memory each namespace makes the pool hold (its chunks in memory plus the objects its
unsent replies reference) never exceeds its quota, so with quotas that sum to less than the
pool no tenant is ever evicted by another. Runs the real store over a real memory tier, and
again with a real disk tier behind it (reads that promote from disk are bounded by what the
namespace's quota has left). Threat model: docs/threats/daemon.md."""

from __future__ import annotations

import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.server.store import NamespacedStore
from lmc.storage.manager import StorageManager
from lmc.storage.tier import create_backend

SHAPE = (1, 2, 16, 64)  # fp32, 8 KiB
NB = 8 << 10
QUOTA = 6 * NB
NAMESPACES = ("a", "b", "c")
KEYS = [bytes([0x51, i]) * 8 for i in range(10)]
POOL = 4 * QUOTA  # room for every quota, and then some: nothing may ever be evicted

keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)
ns_st = st.sampled_from(NAMESPACES)


class SlowReplies(RuleBasedStateMachine):
    POOL = POOL

    def __init__(self) -> None:
        super().__init__()
        cfg = CacheConfig(local_cpu_size=self.POOL, pin_memory="false")
        self.pool = MemoryPool(cfg.local_cpu_size, pin_memory="false")
        self.l1 = create_backend("cpu", cfg, self.pool)
        self.store = NamespacedStore(StorageManager(self.tiers(cfg)), quota_default=QUOTA)
        self.open: list[tuple[str, list]] = []  # replies being "sent": (ns, objects held)

    def tiers(self, cfg: CacheConfig) -> list:
        return [self.l1]

    @rule(ns=ns_st, keys=keys_st)
    def put(self, ns: str, keys: list[bytes]) -> None:
        """What a PUT does: admit, allocate, commit the admitted ones, settle."""
        ik = self.store.internal_keys(ns, keys)
        ok, reserved = self.store.admit(ns, [NB] * len(keys))
        good = []
        try:
            for k, admitted in zip(ik, ok):
                if admitted:
                    [o] = self.store.allocate_many(SHAPE, torch.float32, 1, 16) or [None]
                    assert o is not None, "an admitted value found no memory"
                    o.tensor.fill_(float(k[0]))
                    good.append((k, o))
            self.store.commit(ns, [k for k, _ in good], [o for _, o in good])
        finally:
            for _, o in good:
                o.release()
            self.store.settle(ns, reserved)
        assert self.store.storage.flush(10)  # lower tiers written now: runs replay exactly

    @rule(ns=ns_st, keys=keys_st)
    def get_and_stall(self, ns: str, keys: list[bytes]) -> None:
        """What a GET does up to its send, which then does not finish (a slow reader)."""
        ik = self.store.internal_keys(ns, keys)
        objs = self.store.get(ns, ik, prefix=False)
        self.store.hold(ns, ik, objs)
        self.open.append((ns, objs))

    @rule(data=st.data())
    def reply_sent(self, data) -> None:
        if not self.open:
            return
        ns, objs = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self.store.unhold(ns, objs)
        for o in objs:
            if o is not None:
                o.release()

    @rule(ns=ns_st, keys=keys_st)
    def delete(self, ns: str, keys: list[bytes]) -> None:
        self.store.delete(ns, self.store.internal_keys(ns, keys))

    # ------------------------------------------------------------------ properties
    def _held_by(self, ns: str) -> dict[int, int]:
        """Pool objects ``ns`` makes the daemon hold: its chunks in memory and what its
        unsent replies reference (by identity, each once)."""
        out: dict[int, int] = {}
        for k in self.store.internal_keys(ns, KEYS):
            [o] = self.l1.get([k])
            if o is not None:
                out[id(o)] = o.nbytes
                o.release()
        for owner, objs in self.open:
            if owner == ns:
                out.update({id(o): o.nbytes for o in objs if o is not None})
        return out

    @invariant()
    def every_namespace_within_its_quota(self) -> None:
        for ns in NAMESPACES:
            held = sum(self._held_by(ns).values())
            assert held <= QUOTA, f"{ns} holds {held} bytes, quota {QUOTA}"

    @invariant()
    def no_tenant_evicted_by_another(self) -> None:
        assert self.l1.evictions == 0, "the pool evicted: some tenant held past its quota"

    def teardown(self) -> None:
        for ns, objs in self.open:
            self.store.unhold(ns, objs)
            for o in objs:
                if o is not None:
                    o.release()
        for ns, ledger in self.store._ledgers.items():
            assert (ledger.orphan, ledger.pinned, ledger.held, ledger.held_keys) == \
                (0, 0, {}, {}), f"{ns}: a sent reply left a charge behind"
        self.store.storage.close()
        self.pool.close()


class SlowRepliesOverDisk(SlowReplies):
    """The same with a disk tier: chunks a quota evicted come back from disk (promoted and
    charged), and while replies hold the quota those reads are misses. A promotion
    allocates before the namespace's older chunks leave, hence a larger pool."""

    POOL = 6 * QUOTA

    def tiers(self, cfg: CacheConfig) -> list:
        self.dir = tempfile.TemporaryDirectory(prefix="lmc-quota-prop-")
        disk = create_backend("disk", cfg.replace(local_disk=self.dir.name,
                                                  local_disk_size="16MiB"), self.pool)
        return [self.l1, disk]

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.dir.cleanup()


SlowReplies.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                         deadline=None)
TestSlowReplies = SlowReplies.TestCase
SlowRepliesOverDisk.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                                 deadline=None)
TestSlowRepliesOverDisk = SlowRepliesOverDisk.TestCase
