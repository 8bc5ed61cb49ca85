"""Two tenants on one directory, attacked as tenant B would attack tenant A (a real daemon
with a token per tenant; no NIXL needed: the directory never reads metadata). B must not
learn A's owners, their NIXL metadata or records, must not join or advertise in A's
namespace, must not take A's agent names, and must not fill the peer table for A.
Threat model: ``docs/threats/p2p.md``."""

from __future__ import annotations

import time

import pytest
import torch

from lmc.storage.backends.p2p.directory_client import DirectoryConnection
from lmc.storage.backends.p2p.wire import PeerInfo, Record
from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.client import Address, ServerError
from tests.server.daemon_proc import DaemonProc

MAX_PEERS = 32  # the directory's per-token bound (lmc.server.p2p.directory.PeerDirectory)


def _info(agent: str, marker: int = 1) -> PeerInfo:
    return PeerInfo(agent, b"md-%d-" % marker + agent.encode(), 0x10000 * marker, 1 << 20,
                    0x20000, 64)


def _rec(i: int) -> Record:
    return Record(i.to_bytes(16, "little"), 0, 2 * 2 * 16 * 8 * 2, 1, 0, torch.bfloat16,
                  (2, 2, 16, 8), 16, checksum=1)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A daemon granting ``team-a`` to token A and ``team-b`` to token B."""
    wd = tmp_path_factory.mktemp("tenants")
    tokens = {}
    for t in ("a", "b"):
        tokens[t] = f"token-{t}-0123456789abcdef"
        (wd / f"tok-{t}").write_text(tokens[t])
    d = DaemonProc(wd / "d", ["--size", "8MiB", "--tokens", f"{wd / 'tok-a'}:team-a",
                              "--tokens", f"{wd / 'tok-b'}:team-b"]).start()

    def conn(tenant: str, ns: str | None = None) -> DirectoryConnection:
        return DirectoryConnection(Address.parse(d.url), ns or f"team-{tenant}",
                                   tokens[tenant], 5.0, f"test-{tenant}")
    yield conn
    d.kill()


def _forbidden(fn, *args) -> None:
    with pytest.raises(ServerError) as e:
        fn(*args)
    assert e.value.status == P.FORBIDDEN, e.value


def test_another_tenant_learns_nothing_of_a_namespace(tenants):
    a_owner = tenants("a")
    a_owner.join(_info("prefill-0"))
    a_owner.advertise([_rec(1)])
    b = tenants("b")
    # asked in B's own namespace, A's agent does not exist
    assert b.peer("prefill-0") is None
    assert b.locate([_rec(1).key], me="x") == [[]]
    # and A's namespace is refused outright, for every op
    b_in_a = tenants("b", "team-a")
    _forbidden(b_in_a.peer, "prefill-0")
    _forbidden(b_in_a.locate, [_rec(1).key], "x")
    _forbidden(b_in_a.join, _info("spy"))
    _forbidden(b_in_a.advertise, [_rec(2)])
    _forbidden(b_in_a.withdraw, [_rec(1).key])
    _forbidden(b.conn.call, P.P2P_PEER, {"agent": "prefill-0"})  # no ns: the default one
    # A still sees its own
    a_reader = tenants("a")
    assert a_reader.peer("prefill-0") == _info("prefill-0")
    assert a_reader.locate([_rec(1).key], me="r") == [[("prefill-0", _rec(1))]]
    for c in (a_owner, b, b_in_a, a_reader):
        c.close()


def test_another_tenant_cannot_take_an_agent_name(tenants):
    """B joins first as A's ``decode-0``: that is B's ``decode-0``; A's joins, and A's
    readers get A's metadata, never B's."""
    squatter = tenants("b")
    squatter.join(_info("decode-0", marker=66))
    owner = tenants("a")
    owner.join(_info("decode-0"))
    reader = tenants("a")
    assert reader.peer("decode-0") == _info("decode-0")
    assert tenants("b").peer("decode-0") == _info("decode-0", marker=66)
    # within one namespace a name is still one connection's
    with pytest.raises(ServerError, match="taken"):
        tenants("a").join(_info("decode-0", marker=3))
    for c in (squatter, owner, reader):
        c.close()


def test_one_tenant_cannot_fill_the_peer_table(tenants):
    """B joins as many peers as its token may, then more: refused, naming the bound; A
    joins, advertises and is found as before; a place B frees is B's again."""
    mine = [tenants("b") for _ in range(MAX_PEERS)]
    for i, c in enumerate(mine):
        c.join(_info(f"b-{i}"))
    extra = tenants("b")
    with pytest.raises(ServerError, match="per-token bound"):
        extra.join(_info("b-extra"))
    owner = tenants("a")
    owner.join(_info("prefill-1"))
    assert owner.advertise([_rec(7)]) == 1
    assert tenants("a").locate([_rec(7).key], me="r") == [[("prefill-1", _rec(7))]]
    mine.pop().close()
    for _ in range(100):  # the daemon sees the close, then B's place is free again
        try:
            extra.join(_info("b-extra"))
            break
        except ServerError:
            time.sleep(0.02)
    assert extra.peer("b-extra") == _info("b-extra")
    for c in (*mine, extra, owner):
        c.close()
