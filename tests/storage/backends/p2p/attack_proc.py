"""Child process for ``test_p2p_attacks``: an honest owner, a lying peer and a reader, each
with its own NIXL agent in this one process, against the daemon at DIRECTORY_URL; prints one
JSON line of what the reader got, then ends with ``os._exit`` (NIXL's exit-time crash, see
:mod:`lmc.storage.backends.p2p.agent`). Threat model: ``docs/threats/p2p.md``.

``python -m tests.storage.backends.p2p.attack_proc SCENARIO DIRECTORY_URL WORKDIR``; scenarios: ``forged``,
``grouped``, ``window``, ``lying_size``, ``overwrite``, ``renamed``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.p2p.agent import PoolAgent, TransferFailed
from lmc.storage.backends.p2p.backend import P2PBackend, directory_url
from lmc.storage.backends.p2p.directory_client import DirectoryConnection
from lmc.storage.backends.p2p.wire import Record
from lmc.storage.backends.server.client import Address
from lmc.storage.integrity import Geometry, expect_geometry
from lmc.testing import SHAPE, check_hit, fill, key_of

SECRET = "p2p-attack-suite-secret-0123456789"
PROMPTS = 120  # lying_size: prompts the reader caches


def _tier(url: str, name: str, secret: str | None = None, **kw) -> P2PBackend:
    cfg = CacheConfig(remote_timeout=3.0, pin_memory="false", integrity_secret=secret)
    return P2PBackend(url, config=cfg, pool=MemoryPool(4 << 20, pin_memory="false"),
                      agent_name=name, **kw)


def _store(tier: P2PBackend, key: bytes, content: bytes) -> Record:
    """Export a chunk under ``key`` holding ``content``'s bytes; its advertised record."""
    obj = fill(tier.pool.allocate(SHAPE, torch.float16, SHAPE[2]), key_of(content.decode()))
    try:
        assert tier.put([key], [obj]) == 1
    finally:
        obj.release()
    return tier._exports[key].record


def _read(reader: P2PBackend, key: bytes, content: str) -> str:
    """``exact`` (the bytes of ``content``), ``miss``, or ``WRONG`` (anything else)."""
    got = reader.get([key])[0]
    if got is None:
        return "miss"
    try:
        check_hit(got, key_of(content))
        return "exact"
    except AssertionError:
        return "WRONG"
    finally:
        got.release()


def forged(url: str, _: str) -> dict:
    """A keyed owner holds K1..K3; a peer without the secret stores K1 ordinarily (other
    bytes, untagged), re-advertises K2 with the owner's tag copied onto its own bytes, and
    K3 pointing at its bytes with the owner's checksum and tag; it alone stores K4. Each is
    the newest holder. A keyed reader reads each twice; then a key the liar advertises newest
    after its failures."""
    owner, liar = _tier(url, "owner", SECRET), _tier(url, "liar")
    reader = _tier(url, "reader", SECRET)
    plain = _tier(url, "plain-reader")
    keys = [key_of(f"forged-k{i}") for i in range(5)]
    honest = {k: _store(owner, k, f"honest{i}".encode()) for i, k in enumerate(keys[:3])}
    lies = {k: _store(liar, k, f"lie{i}".encode()) for i, k in enumerate(keys[:4])}
    liar._member.advertise([
        dataclasses.replace(lies[keys[1]], tag=honest[keys[1]].tag),
        dataclasses.replace(lies[keys[2]], checksum=honest[keys[2]].checksum,
                            tag=honest[keys[2]].tag)])
    out: dict = {"first": [], "second": [], "contains_after": None}
    for i, k in enumerate(keys[:4]):
        out["first"].append(_read(reader, k, f"honest{i}"))
    out["second"] = [_read(reader, k, f"honest{i}") for i, k in enumerate(keys[:4])]
    out["contains_after"] = reader.contains(keys[:4])
    # the liar failed four times: a key it advertises newest now goes to the honest owner
    # at the first read
    late = key_of("forged-late")
    _store(owner, late, b"honest-late")
    _store(liar, late, b"lie-late")
    out["liar_skipped"] = _read(reader, late, "honest-late")
    # a reader without the secret refuses a tagged record as a keyed one refuses an untagged
    _store(owner, keys[4], b"honest4")
    out["plain_reads_tagged"] = _read(plain, keys[4], "honest4")
    out["stats"] = {k: reader.stats()[k] for k in ("verify_failures", "hits", "distrusted",
                                                   "distrusted_agents")}
    for t in (reader, plain, liar, owner):
        t.close()
    return out


def grouped(url: str, _: str) -> dict:
    """Forged records inside pulls READ in groups and verified as each group lands (the
    grouping threshold lowered to 0 so every multi-chunk pull is grouped): one get of six
    keys, two of them advertised newest by a liar without the secret -- the honest four are
    served exact, the two lies are misses, none is wrong."""
    from lmc.storage.backends.p2p import backend as p2p

    p2p.READ_GROUP_BYTES = 0
    owner, liar = _tier(url, "g-owner", SECRET), _tier(url, "g-liar")
    reader = _tier(url, "g-reader", SECRET)
    keys = [key_of(f"grouped-k{i}") for i in range(6)]
    for i, k in enumerate(keys):
        _store(owner, k, f"grouped{i}".encode())
    for i in (1, 3):
        _store(liar, keys[i], f"lie{i}".encode())
    got = reader.get(keys)
    out: dict = {"got": []}
    for i, o in enumerate(got):
        if o is None:
            out["got"].append("miss")
            continue
        try:
            check_hit(o, key_of(f"grouped{i}"))
            out["got"].append("exact")
        except AssertionError:
            out["got"].append("WRONG")
        finally:
            o.release()
    out["groups"] = p2p.read_groups([1 << 20] * 4)
    out["stats"] = {k: reader.stats()[k] for k in ("verify_failures", "hits")}
    for t in (reader, liar, owner):
        t.close()
    return out


def window(url: str, _: str) -> dict:
    """The reader, given the owner's metadata by the directory, READs inside the owner's
    export window, across its end, before it, and anywhere in the owner's pool."""
    owner, reader = _tier(url, "win-owner", export_bytes=64 << 10), _tier(url, "win-reader")
    _store(owner, key_of("win"), b"win")
    info = reader._peer("win-owner")
    dst = reader.raw.buffer.data_ptr()
    pool = owner.raw.buffer.data_ptr()
    spans = {"window": (info.pool_base, 4096),
             "window_end": (info.pool_base + info.pool_size - 4096, 4096),
             "across_end": (info.pool_base + info.pool_size - 2048, 4096),
             "before": (info.pool_base - 4096, 4096),
             "pool_start": (pool, 4096), "pool_middle": (pool + (1 << 20), 65536)}
    out: dict = {"window_size": info.pool_size, "pool_size": owner.raw.size}
    for what, (addr, n) in spans.items():
        try:
            reader.agent.read(info, [(dst, addr, n)], time.monotonic() + 3.0)
            out[what] = "read"
        except TransferFailed:
            out[what] = "refused"
    out["served"] = _read(reader, key_of("win"), "win")
    for t in (reader, owner):
        t.close()
    return out


def lying_size(url: str, workdir: str) -> dict:
    """A reader engine caches 120 prompts in L1 (27 of its 32 MiB); a peer joins claiming a
    1 TiB window and advertises, for two chunk keys the reader will look up, a ~30 MiB chunk of another
    geometry and a chunk of 61,440 tokens, then (the reader told its geometry) one of another
    dtype. The reader looks the prompts up."""
    from tests.storage.backends.p2p.engine_proc import Engine, _tokens
    eng = Engine(url, workdir)
    n = 100
    for seed in range(PROMPTS):
        eng.store(seed, n)
    l1 = eng.eng.storage.tiers[0]

    def cached() -> int:
        return sum(all(l1.contains([k for _, _, k in eng.eng.db.process_tokens(
            _tokens(seed, n))])) for seed in range(PROMPTS))
    before = cached()
    liar_pool = MemoryPool(1 << 20, pin_memory="false")
    liar_agent = PoolAgent("size-liar", liar_pool, MemoryPool(1 << 16, pin_memory="false"),
                           slots=8)
    lie = dataclasses.replace(liar_agent.info, pool_size=1 << 40)
    conn = DirectoryConnection(Address.parse(directory_url(url, CacheConfig())),
                               eng.p2p.namespace, None, 5.0, "liar")
    conn.join(lie)
    victims = [next(iter(eng.eng.db.process_tokens(_tokens(s, n))))[2] for s in (900, 901)]
    width = 30 * (1 << 20) // (4 * 2 * 16 * 2)
    conn.advertise([Record(victims[0], 0, 4 * 2 * 16 * width * 2, 1, 0, torch.bfloat16,
                           (4, 2, 16, width), 16),
                    Record(victims[1], 0, 4 * 2 * 61440 * 128 * 2, 2, 1, torch.bfloat16,
                           (4, 2, 61440, 128), 61440)])
    loads = [eng.load(s, n)["retrieved"] for s in (900, 901)]
    # told the engine's geometry (as lmc.storage.integrity.expect_geometry tells every tier), a
    # chunk of the right shape in another dtype is refused as well
    assert expect_geometry([eng.p2p], Geometry.of(eng.spec, 16)) == 1
    victim = next(iter(eng.eng.db.process_tokens(_tokens(902, n))))[2]
    conn.advertise([Record(victim, 0, 4 * 2 * 16 * 128 * 2, 3, 2, torch.float16,
                           (4, 2, 16, 128), 16)])
    loads.append(eng.load(902, n)["retrieved"])
    out = {"before": before, "after": cached(), "loads": loads,
           "refused": eng.p2p.stats()["refused"]}
    conn.close()
    liar_agent.close()
    eng.eng.close()
    return out


def overwrite(url: str, _: str) -> dict:
    """A peer of the namespace uses the owner's metadata to WRITE junk over the owner's
    exported copy (NIXL allows WRITEs wherever it allows READs). A reader without a secret
    reads the key: the record the owner advertised still holds the checksum of the honest
    bytes."""
    owner, vandal, reader = (_tier(url, n) for n in ("ow-owner", "ow-vandal", "ow-reader"))
    rec = _store(owner, key_of("overwritten"), b"overwritten")
    info = vandal._peer("ow-owner")
    junk = vandal.pool.allocate(SHAPE, torch.float16, SHAPE[2])
    junk.tensor.fill_(3.0)
    a = vandal.agent.agent
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(vandal.raw.buffer.data_ptr()
                                                      + junk.offset, rec.nbytes, 0)], "DRAM"),
                          a.get_xfer_descs([(info.pool_base + rec.offset, rec.nbytes, 0)],
                                           "DRAM"), "ow-owner")
    state = a.transfer(h)
    while state not in ("DONE", "ERR"):
        state = a.check_xfer_state(h)
    a.release_xfer_handle(h)
    junk.release()
    out = {"write": state, "read": _read(reader, key_of("overwritten"), "overwritten"),
           "verify_failures": reader.stats()["verify_failures"]}
    for t in (reader, vandal, owner):
        t.close()
    return out


def renamed(url: str, _: str) -> dict:
    """A peer joins as ``liar3`` with the metadata of a NIXL agent it named ``owner3``, the
    honest owner's name: loading it would send the reader's READs of the owner to it."""
    owner, reader = _tier(url, "owner3"), _tier(url, "reader3")
    _store(owner, key_of("renamed"), b"renamed")
    impostor = PoolAgent("owner3", MemoryPool(1 << 20, pin_memory="false"),
                         MemoryPool(1 << 16, pin_memory="false"), slots=8)
    conn = DirectoryConnection(Address.parse(directory_url(url, CacheConfig())),
                               reader.namespace, None, 5.0, "impostor")
    conn.join(dataclasses.replace(impostor.info, agent="liar3"))
    out = {"honest_before": _read(reader, key_of("renamed"), "renamed"),
           "impostor_loaded": reader._peer("liar3") is not None}
    reader.agent.forget_peer("owner3")  # the next read fetches the owner's metadata afresh
    out["honest_after"] = _read(reader, key_of("renamed"), "renamed")
    conn.close()
    impostor.close()
    for t in (reader, owner):
        t.close()
    return out


if __name__ == "__main__":
    scenario, url, workdir = sys.argv[1:4]
    print("@lmc " + json.dumps(globals()[scenario](url, workdir)), flush=True)
    os._exit(0)
