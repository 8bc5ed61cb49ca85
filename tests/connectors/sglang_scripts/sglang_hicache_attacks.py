"""LMCHiCacheStorage attacked through SGLang 0.5.23's real host pools (run in the SGLang venv;
threat model: ``docs/threats/tiers.md``, the SGLang page store).

* A page whose host indices hold an unmapped slot (``idx[1] = -1``) is refused, stored as
  nothing (``batch_set_v1`` answers False for it): it used to be stored with that token's
  KV never copied, and loaded later as wrong KV. A load into such indices is refused too,
  and the same holds for the linker's device slots.
* A flat page of another dtype than the pool's (``torch.randn`` float32 into a bf16 pool)
  is refused with an error naming both dtypes: it used to be converted and stored.
* A page whose stored header was rewritten on the disk tier (shape or dtype, checksums
  recomputed) is a miss, counted and deleted; the writer's next store puts it back and a
  restarted engine loads it bit-exact.

Prints ``PASS <check>`` per check and ``RESULT: PASS``; exits non-zero on a failure.
"""

from __future__ import annotations

import glob
import logging
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import xxhash  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang_contract import (  # noqa: E402
    DTYPE,
    PS,
    PoolName,
    PoolTransfer,
    backend,
    fill_random,
    host_pool,
    make_linker,
    mha_pool,
    page_bytes,
    passed,
)

TMP = tempfile.mkdtemp(prefix="lmc-sglang-attacks-")
FIELDS = struct.Struct("<4sHH16sB3x4IIQQ")  # lmc.storage.serde's header layout


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOG = Captured()
logging.getLogger("lmc").addHandler(LOG)


def check_unmapped_slot_refused() -> None:
    dev = mha_pool()
    host = host_pool(dev, "layer_first")
    b = backend(host, model="attack-slots")
    try:
        keys = get_hash_str(list(range(7000, 7000 + 2 * PS)), None, page_size=PS)
        idx = fill_random(host, 2, seed=11)
        bad = idx.clone()
        bad[1] = -1
        r = b.batch_set_v1(keys[:1], bad[:PS])
        assert r == [False], f"a page with an unmapped slot was stored: {r}"
        assert b.batch_exists(keys) == 0, "the refused page is visible"
        assert b.stats().get("skipped_unmapped_slots") == 1, b.stats()
        r = b.batch_set_v1(keys, idx)  # the same pages with every slot mapped: stored
        assert r == [True, True], r
        # a load into indices with an unmapped slot loads nothing (never a partial page)
        dst = host.alloc(2 * PS)
        before = page_bytes(host, dst, 2)
        bad_dst = dst.clone()
        bad_dst[PS + 2] = -1
        r = b.batch_get_v1(keys, bad_dst)
        assert r == [True, False], r
        after = page_bytes(host, dst, 2)
        assert torch.equal(after[0], page_bytes(host, idx, 1)[0]), "page 0 not loaded exactly"
        assert torch.equal(after[1], before[1]), "the refused page was partly written"
    finally:
        b.close()
    passed("unmapped slot: batch_set_v1 with idx[1] = -1 answers [False] and stores "
           "nothing; a load into indices with an unmapped slot stops before that page")


def check_linker_refuses_unmapped_slots() -> None:
    """The linker's store (offload) and load refuse pages with an unmapped device slot."""
    dev = mha_pool()
    linker = make_linker(dev)
    try:
        keys = get_hash_str(list(range(7500, 7500 + 2 * PS)), None, page_size=PS)
        slots = torch.arange(PS, 3 * PS)
        bad = slots.clone()
        bad[1] = -1
        assert linker.pages.store(keys, bad) == [False, True]
        assert linker.pages.prefix_hits(keys) == 0, "a page with an unmapped slot was stored"
        assert linker.pages.store(keys, slots) == [True, True]
        bad = slots.clone()
        bad[PS + 3] = -1
        ok = linker.load("r", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=bad)])
        assert ok is False, "a load into an unmapped slot was queued"
        assert linker.counts.get("load_refused_unmapped") == 1, linker.counts
        assert linker.start_layer_wise_loading() == -1  # nothing queued
    finally:
        linker.close()
    passed("linker: pages with an unmapped device slot are neither stored nor loaded "
           "(load answers False: SGLang recomputes)")


def check_foreign_dtype_refused() -> None:
    dev = mha_pool()
    host = host_pool(dev, "layer_first")
    b = backend(host, model="attack-dtype")
    try:
        keys = get_hash_str(list(range(8000, 8000 + PS)), None, page_size=PS)
        n = host.get_data_page(0, flat=True).numel()
        LOG.lines.clear()
        assert b.batch_set(keys, [torch.randn(n)]) is False, "float32 page accepted"
        assert b.batch_exists(keys) == 0, "a converted page was stored"
        said = [x for x in LOG.lines if "float32" in x and "bfloat16" in x]
        assert said, f"the refusal does not name the dtypes: {LOG.lines}"
        good = torch.randint(-32768, 32767, (n,), dtype=torch.int16).view(DTYPE)
        assert b.batch_set(keys, [good]) is True
        out = b.batch_get(keys, [torch.zeros(n, dtype=torch.float32)])
        assert out == [None], "a bf16 page was converted into a float32 target"
        out = b.batch_get(keys, [torch.zeros(n, dtype=DTYPE)])
        assert out[0] is not None and torch.equal(out[0].view(torch.int16),
                                                  good.view(torch.int16))
    finally:
        b.close()
    passed("foreign dtype: batch_set of a float32 page into a bf16 pool is refused, naming "
           "float32 and bfloat16; nothing stored; a float32 get target is refused too")


def _rewrite(path: str, how: str) -> None:
    with open(path, "r+b") as f:
        head = f.read(FIELDS.size)
        magic, ver, flags, key, code, s0, s1, s2, s3, ntok, plen, csum = FIELDS.unpack(head)
        if how == "shape":
            s1, s3 = s3, s1
        else:  # bf16 -> fp16: the same bytes, another dtype
            code = 2
        body = FIELDS.pack(magic, ver, flags, key, code, s0, s1, s2, s3, ntok, plen, csum)
        f.seek(0)
        f.write(body + xxhash.xxh3_64_digest(body))


def check_rewritten_page_on_disk(how: str) -> None:
    dev = mha_pool()
    disk = {"lmc.local_disk": os.path.join(TMP, f"rewrite-{how}")}
    keys = get_hash_str(list(range(9000, 9000 + 2 * PS)), None, page_size=PS)
    host = host_pool(dev, "layer_first")
    idx = fill_random(host, 2, seed=5)
    want = page_bytes(host, idx, 2)
    b = backend(host, model=f"attack-{how}", **disk)
    assert b.batch_set_v1(keys, idx) == [True, True]
    b.close()  # flushed to the disk tier
    files = sorted(glob.glob(os.path.join(disk["lmc.local_disk"], "**", "*.kv"), recursive=True))
    assert len(files) == 2, files
    key0 = b.pages.keys(keys[:1])[0].hex()
    victim = next(f for f in files if os.path.basename(f).startswith(key0))
    _rewrite(victim, how)

    host2 = host_pool(dev, "layer_first")
    b2 = backend(host2, model=f"attack-{how}", **disk)
    try:
        dst = host2.alloc(2 * PS)
        assert b2.batch_get_v1(keys, dst) == [False, False], "a rewritten page was loaded"
        assert not os.path.exists(victim), "the rewritten page was not deleted"
        st = b2.stats()
        assert st.get("disk.checksum_failures") == 1, st
        src = host2.alloc(2 * PS)  # the writer's next store of the same pages
        for p in range(2):
            host2.set_from_flat_data_page(int(src[p * PS]), want[p].view(DTYPE))
        assert b2.batch_set_v1(keys, src) == [True, True]
        b2.flush(10)
    finally:
        b2.close()

    host3 = host_pool(dev, "layer_first")
    b3 = backend(host3, model=f"attack-{how}", **disk)
    try:
        dst = host3.alloc(2 * PS)
        assert b3.batch_get_v1(keys, dst) == [True, True]
        got = page_bytes(host3, dst, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), "not bit-exact"
    finally:
        b3.close()
    passed(f"rewritten page ({how}): a miss, counted and deleted; re-stored and loaded "
           "bit-exact by a restarted engine")


def main() -> None:
    check_unmapped_slot_refused()
    check_linker_refuses_unmapped_slots()
    check_foreign_dtype_refused()
    for how in ("shape", "dtype"):
        check_rewritten_page_on_disk(how)
    print("RESULT: PASS", flush=True)


if __name__ == "__main__":
    main()
