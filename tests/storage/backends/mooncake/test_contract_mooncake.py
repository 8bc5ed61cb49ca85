"""The tier contract (:mod:`lmc.testing`, every class) against a real ``mooncake_master`` on
loopback, with and without ``integrity_secret``.

The values live in a holder process's segment (a storage node); the tiers under test are
pure clients (``segment: 0``), so what one tier stored outlives it, as the contract's
second-tier tests need. Killing and pausing hit the master; a dead holder is
``test_mooncake_faults.py``'s.
"""

from __future__ import annotations

import time
import uuid

import pytest

from lmc.storage.serde import HEADER_SIZE, TAG_SIZE, decode_header, encode_header
from lmc.testing import TierContract, TierSpec

from .mooncake_cluster import MooncakeMaster, Peer, require_mooncake

pytestmark = pytest.mark.integration
SECRET = "contract-suite-secret-0123456789"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master and a holder of this module's own (the fault tests kill the master)."""
    require_mooncake()
    import lmc.storage.backends.mooncake  # noqa: F401  (registers mooncake://)
    # client_ttl 60 s: a pause of the master (the hang tests) never expires the holder
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"), client_ttl=60).start()
    holder = raw = None
    try:
        holder = Peer("holder", master, segment=256 << 20)
        raw = Peer("raw", master)
        yield master, holder, raw
    finally:
        for p in (raw, holder):
            if p is not None:
                p.stop()
        master.stop()


def _damage(raw: Peer, keyed: bool):
    """One payload bit flipped, rewritten by another client; keyed, the header's checksums
    are recomputed for the new payload and the old tag kept, so only the tag can tell."""
    def corrupt(tier, key) -> None:
        name = tier.remote_key(key)
        got = raw.ask(op="read", key=name)
        assert got["code"] > 0, f"no value to damage under {name}: code {got['code']}"
        value = bytearray(bytes.fromhex(got["hex"]))
        head = HEADER_SIZE + (TAG_SIZE if keyed else 0)
        value[head + 100] ^= 0x10
        if keyed:
            h = decode_header(value, tagged=True)
            value[:HEADER_SIZE] = encode_header(key, h.shape, h.dtype, h.num_tokens,
                                                bytes(value[head:]), tagged=True)
        assert raw.ask(op="write", key=name, hex=value.hex())["code"] == 0
    return corrupt


def _settled(raw: Peer) -> None:
    """Wait until the cluster stores and serves again (the holder re-mounted its segment):
    the next test must not meet a cluster still recovering from this one's fault."""
    deadline = time.monotonic() + 30
    while True:
        probe = f"probe/{uuid.uuid4().hex}"
        if (raw.ask(op="write", key=probe, hex="ab" * 64)["code"] == 0
                and raw.ask(op="read", key=probe)["code"] == 64):
            return
        assert time.monotonic() < deadline, "the cluster did not serve again in 30 s"
        time.sleep(0.2)


def _revive(master: MooncakeMaster, raw: Peer):
    def revive(tier) -> None:
        master.start()  # empty: every key is gone; clients and the holder re-mount
        _settled(raw)
    return revive


def _unhang(master: MooncakeMaster, raw: Peer):
    def unhang(tier) -> None:
        master.resume()
        _settled(raw)
    return unhang


@pytest.fixture(params=["plain", "keyed"])
def tier_spec(request, cluster):
    master, _holder, raw = cluster
    keyed = request.param == "keyed"
    return TierSpec(
        master.url,
        config=lambda: {"remote_key_prefix": f"c{uuid.uuid4().hex[:10]}", "remote_timeout": 1.0,
                        **({"integrity_secret": SECRET} if keyed else {})},
        kwargs={"segment": 0},
        corrupt=_damage(raw, keyed),
        kill=lambda tier: master.kill(), revive=_revive(master, raw),
        hang=lambda tier: master.pause(), unhang=_unhang(master, raw),
        reopen=lambda tier: {"remote_key_prefix": tier.prefix.rstrip("/")},
        # another engine's key prefix on the same cluster (Mooncake has no tenants' tokens)
        other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}])


class TestMooncakeContract(TierContract):
    """Every contract test, plain and keyed."""
