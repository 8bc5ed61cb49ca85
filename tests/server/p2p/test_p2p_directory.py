"""The directory of who holds which chunk: the table itself, the record format, and the
daemon's P2P ops over a real socket (no NIXL needed: the directory never reads metadata),
attacked as another tenant would: reading a namespace it is not granted, taking another
tenant's agent name, filling the peer table. Threat model: ``docs/threats/p2p.md``."""

from __future__ import annotations

import random
import struct
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.server.p2p.directory import DirectoryFull, PeerDirectory
from lmc.storage.backends.p2p.directory_client import DirectoryConnection
from lmc.storage.backends.p2p.wire import (
    RECORD_SIZE,
    BadRecord,
    PeerInfo,
    Record,
    peer_info,
    unpack_record,
)
from lmc.storage.backends.server.client import Address, ServerError
from tests.server.daemon_proc import DaemonProc


def _info(agent: str, pool_size: int = 1 << 20, slots: int = 64) -> PeerInfo:
    return PeerInfo(agent, b"md-" + agent.encode(), 0x10000, pool_size, 0x20000, slots)


def _rec(key: bytes, offset: int = 0, version: int = 1, slot: int = 0) -> Record:
    return Record(key, offset, 2 * 2 * 16 * 8 * 2, version, slot, torch.bfloat16,
                  (2, 2, 16, 8), 16, checksum=0x1234, tag=b"t" * 32)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ------------------------------------------------------------------ records
def test_record_round_trip_and_checks():
    r = _rec(_key(7), offset=4096, version=9, slot=3)
    raw = r.pack()
    assert len(raw) == RECORD_SIZE and unpack_record(raw) == r
    with pytest.raises(BadRecord, match="bytes"):
        unpack_record(raw[:-1])
    with pytest.raises(BadRecord, match="does not match length"):
        unpack_record(Record(r.key, 0, 100, 1, 0, torch.bfloat16, (2, 2, 16, 8), 16).pack())
    with pytest.raises(BadRecord, match="version 0"):
        unpack_record(_rec(_key(1), version=0).pack())
    with pytest.raises(BadRecord, match="token count"):
        unpack_record(Record(r.key, 0, r.nbytes, 1, 0, torch.bfloat16, (2, 2, 16, 8),
                             15).pack())
    untagged = Record(r.key, 0, r.nbytes, 1, 0, torch.bfloat16, (2, 2, 16, 8), 16, 7)
    assert unpack_record(untagged.pack()) == untagged and untagged.tag is None
    flags = bytearray(raw)
    flags[45] |= 0x80  # an unknown flag bit
    with pytest.raises(BadRecord, match="flags"):
        unpack_record(bytes(flags))
    info = _info("a", pool_size=8192, slots=4)
    info.check(_rec(_key(1), offset=8192 - r.nbytes, slot=3))
    with pytest.raises(BadRecord, match="runs past"):
        info.check(_rec(_key(1), offset=8192 - r.nbytes + 1))
    with pytest.raises(BadRecord, match="slot 4"):
        info.check(_rec(_key(1), slot=4))


def test_peer_info_fields_are_checked():
    good = _info("a").as_meta()
    assert peer_info(good) == _info("a")
    for field, bad in (("agent", ""), ("agent", 5), ("metadata", b""), ("metadata", "x"),
                       ("pool_size", 0), ("slots", -1), ("pool_base", True),
                       ("versions_addr", 1 << 64)):
        with pytest.raises(ValueError, match=field if field != "metadata" else "metadata"):
            peer_info({**good, field: bad})


# ------------------------------------------------------------------ the table
def test_locate_prefers_the_newest_holder_never_the_asker():
    d = PeerDirectory()
    d.join("c1", _info("a"))
    d.join("c2", _info("b"))
    d.advertise("c1", [b"k1", b"k2"], [b"ra1", b"ra2"])
    d.advertise("c2", [b"k1"], [b"rb1"])
    assert d.locate([b"k1", b"k2", b"k3"]) == [[("b", b"rb1"), ("a", b"ra1")],
                                               [("a", b"ra2")], []]
    assert d.locate([b"k1", b"k2"], exclude="b") == [[("a", b"ra1")], [("a", b"ra2")]]
    assert d.locate([b"k2"], exclude="a") == [[]]
    assert d.withdraw("c2", [b"k1", b"k9"]) == 1
    assert d.locate([b"k1"]) == [[("a", b"ra1")]]
    assert d.leave("c1") == 2
    assert d.locate([b"k1", b"k2"]) == [[], []]
    assert d.peer("a") is None and d.peer("b") == _info("b")
    assert d.stats() == {"peers": 1, "keys": 0, "records": 0, "dropped": 0}


def test_bounds_peers_entries_and_names():
    d = PeerDirectory(max_peers=2, max_entries=3, max_holders=2)
    d.join("c1", _info("a"))
    d.join("c2", _info("b"))
    with pytest.raises(DirectoryFull):
        d.join("c3", _info("c"))
    with pytest.raises(ValueError, match="taken"):
        d.join("c2", _info("a"))
    with pytest.raises(ValueError, match="before join"):
        PeerDirectory().advertise("c9", [b"k"], [b"r"])
    d.advertise("c1", [b"k%d" % i for i in range(5)], [b"r%d" % i for i in range(5)])
    assert d.locate([b"k%d" % i for i in range(5)]) == [[], [], [("a", b"r2")],
                                                         [("a", b"r3")], [("a", b"r4")]]
    assert d.stats()["dropped"] == 2 and d.stats()["records"] == 3
    d.join("c1", _info("a"))  # a re-join forgets the old records (the agent restarted)
    assert d.locate([b"k4"]) == [[]]
    d.leave("c2")
    for c in ("h1", "h2", "h3"):  # at most max_holders owners named per key
        d.join(c, _info(c), owner=c)
        d.advertise(c, [b"same"], [c.encode()])
    assert d.locate([b"same"]) == [[("h3", b"h3"), ("h2", b"h2")]]


def test_tables_and_names_are_per_namespace_and_bounds_per_token():
    """One tenant filling its share of the table, or joining first under another tenant's
    agent name, changes nothing for the other tenant."""
    d = PeerDirectory(max_peers=3)
    for i in range(3):
        d.join(f"b{i}", _info(f"decode-{i}"), "team-b", owner="tok-b")
    with pytest.raises(DirectoryFull, match="per-token"):
        d.join("b9", _info("x"), "team-b", owner="tok-b")
    with pytest.raises(DirectoryFull):  # another namespace of the same token: one share
        d.join("b9", _info("x"), "team-b2", owner="tok-b")
    d.join("a0", _info("decode-0", pool_size=1 << 30), "team-a", owner="tok-a")
    assert d.peer("decode-0", "team-a") == _info("decode-0", pool_size=1 << 30)
    assert d.peer("decode-0", "team-b") == _info("decode-0")
    assert d.peer("decode-0", "team-c") is None
    d.advertise("a0", [b"ka"], [b"ra"])
    assert d.locate([b"ka"], "team-a", exclude="decode-0") == [[]]  # team-a's own agent
    assert d.locate([b"ka"], "team-b", exclude="decode-0") == [[("decode-0", b"ra")]]
    d.leave("b0")
    d.join("b9", _info("x"), "team-b", owner="tok-b")  # a freed place is usable again
    assert d.namespace_of("b9") == "team-b" and d.namespace_of("zz") is None


# ------------------------------------------------------------------ over the daemon
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("dir"), ["--size", "8MiB"])
    d.start()
    yield d
    d.kill()


def _conn(d: DaemonProc, ns: str = "t") -> DirectoryConnection:
    return DirectoryConnection(Address.parse(d.url), ns, None, 5.0, "test")


def test_daemon_directory_round_trip(daemon):
    owner, reader, other_ns = _conn(daemon), _conn(daemon), _conn(daemon, "u")
    owner.join(_info("own-1"))
    recs = [_rec(_key(i), offset=i * 4096, version=i + 1, slot=i) for i in range(5)]
    assert owner.advertise(recs) == 5
    got = reader.locate([r.key for r in recs] + [_key(99)], me="rdr")
    assert got == [[("own-1", r)] for r in recs] + [[]]
    assert owner.locate([recs[0].key], me="own-1") == [[]]  # never yourself
    assert other_ns.locate([recs[0].key], me="x") == [[]]  # namespaces keep tenants apart
    assert reader.peer("own-1") == _info("own-1") and reader.peer("nobody") is None
    assert other_ns.peer("own-1") is None  # nor does another namespace learn its owners
    tiers = reader.conn.stats()["tiers"]
    assert tiers["p2p.peers"] >= 1 and tiers["p2p.records"] >= 5, tiers
    assert owner.withdraw([recs[0].key, _key(98)]) == 1
    assert reader.locate([recs[0].key, recs[1].key], me="r") == [[], [("own-1", recs[1])]]
    owner.close()  # the owner's records go with its connection
    for _ in range(100):
        if reader.locate([recs[1].key], me="r") == [[]]:
            break
        time.sleep(0.02)
    assert reader.locate([recs[1].key], me="r") == [[]]
    assert reader.peer("own-1") is None
    reader.close()
    other_ns.close()


def test_daemon_refuses_bad_directory_requests(daemon):
    c = _conn(daemon)
    with pytest.raises(ServerError, match="before p2p join"):
        c.advertise([_rec(_key(1))])
    with pytest.raises(ServerError, match="p2p join"):
        c.conn.call(0x20, {"agent": "x"})  # no metadata
    c.join(_info("own-2", pool_size=1 << 16, slots=8))
    bad = [(_rec(_key(1), offset=1 << 16), "runs past"), (_rec(_key(1), slot=8), "slot 8")]
    for rec, why in bad:
        with pytest.raises(ServerError, match=why):
            c.advertise([rec])
    with pytest.raises(ServerError, match="differs"):
        c.conn.call(0x21, {"ns": "t", "keys": [_key(2)], "records": [_rec(_key(1)).pack()]})
    with pytest.raises(ServerError, match="joined in 't'"):  # records only where it joined
        c.conn.call(0x21, {"ns": "u", "keys": [_key(2)], "records": [_rec(_key(2)).pack()]})
    with pytest.raises(ServerError, match="joined in 't'"):
        c.conn.call(0x22, {"ns": "u", "keys": [_key(2)]})
    with pytest.raises(ServerError, match="taken"):
        _conn(daemon).join(_info("own-2"))
    assert c.advertise([_rec(_key(3))]) == 1  # the connection survived every refusal
    c.close()


def test_daemon_survives_garbage_directory_requests(daemon):
    """Random field values for every P2P op: each is answered (ok or bad_request), the
    connection stays usable, and the directory still works afterwards."""
    from lmc.storage.backends.server import protocol as P

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    values = [None, 0, -1, 1 << 63, True, "", "x" * 300, b"", b"\0" * 16, b"\1" * RECORD_SIZE,
              _rec(_key(1)).pack(), [], [b"\0" * 16], [None], {}, {"a": 1}, 1.5]
    fields = ["ns", "keys", "records", "agent", "metadata", "pool_base", "pool_size",
              "versions_addr", "slots", "self"]
    c = _conn(daemon)
    for _ in range(300):
        meta = {f: rng.choice(values) for f in rng.sample(fields, rng.randint(0, len(fields)))}
        try:
            c.conn.call(rng.choice(list(P.P2P_OPS)), meta)
        except ServerError as e:
            assert e.status in (P.BAD_REQUEST, P.FORBIDDEN), (seed, meta, e)
    c.close()
    owner, reader = _conn(daemon), _conn(daemon)
    owner.join(_info("own-after-fuzz"))
    owner.advertise([_rec(_key(5))])
    assert reader.locate([_key(5)], me="r") == [[("own-after-fuzz", _rec(_key(5)))]]
    owner.close()
    reader.close()


# ------------------------------------------------------------------ properties
_FIELDS = st.tuples(
    st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1), st.integers(0, 9),
    st.one_of(st.sampled_from([0, 1]), st.integers(0, 255)),
    st.tuples(*[st.integers(0, 70)] * 4), st.integers(0, 70), st.integers(0, 2**64 - 1),
    st.binary(min_size=32, max_size=32), st.booleans(), st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None)
@given(_FIELDS)
def test_any_record_a_peer_sends_is_consistent_or_refused(fields):
    """Whatever field values a peer packs into a record (a length that agrees with its shape
    or not, any dtype code, flag bits, version): refused with BadRecord, or a record whose
    fields agree (length = shape x dtype > 0, tokens = shape[2], version >= 1, the tag only
    when flagged) and that packs back to the same bytes."""
    key, off, ver, slot, code, flags, shape, ntok, csum, tag, consistent, n = fields
    if consistent:  # mostly a length that matches, so the other checks are reached
        n = shape[0] * shape[1] * shape[2] * shape[3] * {3: 2, 2: 2, 1: 4}.get(code, 1)
        ntok = shape[2]
    raw = struct.pack("<16sQQQIBB2x4IIQ32s", key, off, n, ver, slot, code, flags, *shape,
                      ntok, csum, tag)
    try:
        rec = unpack_record(raw)
    except BadRecord:
        return
    s0, s1, s2, s3 = rec.shape
    assert rec.nbytes == s0 * s1 * s2 * s3 * rec.dtype.itemsize > 0
    assert rec.num_tokens == s2 and rec.version >= 1 and flags in (0, 1)
    assert (rec.tag is not None) == (flags == 1)
    assert rec.pack() == (raw if flags else raw[:-32] + bytes(32))
    accepted.append(1)


accepted: list[int] = []


def test_the_record_property_reached_accepted_records():
    """The property above is not vacuous: some generated records were accepted."""
    if not accepted:
        test_any_record_a_peer_sends_is_consistent_or_refused()
    assert accepted


_OPS = st.lists(st.tuples(st.sampled_from(["join", "advertise", "withdraw", "leave"]),
                          st.integers(0, 7), st.integers(0, 2), st.integers(0, 3),
                          st.integers(0, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_namespaces_never_leak_and_bounds_hold(ops):
    """Random joins, advertisements, withdrawals and leaves by 8 connections of 3 tokens
    across 2 namespaces (a token's namespace fixed by the token, as the daemon grants):
    a locate or peer lookup in one namespace names only agents joined in it, every record
    found is one its holder advertised, and no token ever holds more than its bound."""
    d = PeerDirectory(max_peers=2, max_entries=3, max_holders=2)
    model: dict[int, tuple[str, str, dict[bytes, bytes]]] = {}  # conn -> ns, agent, records
    for op, conn, token, name, key in ops:
        ns = f"ns{token % 2}"
        k = b"k%d" % key
        if op == "join":
            agent = f"agent-{name}"
            try:
                d.join(conn, _info(agent), ns, owner=f"tok{token}")
            except (ValueError, DirectoryFull):
                continue
            model[conn] = (ns, agent, {})
        elif op == "advertise" and conn in model:
            rec = b"r-%d-%d" % (conn, key)
            d.advertise(conn, [(model[conn][0] + ":").encode() + k], [rec])
            model[conn][2][k] = rec
        elif op == "withdraw" and conn in model:
            d.withdraw(conn, [(model[conn][0] + ":").encode() + k])
            model[conn][2].pop(k, None)
        elif op == "leave":
            d.leave(conn)
            model.pop(conn, None)
    for ns in ("ns0", "ns1"):
        members = {agent: c for c, (n, agent, _) in model.items() if n == ns}
        for name in range(4):
            got = d.peer(f"agent-{name}", ns)
            assert (got is not None) == (f"agent-{name}" in members)
        for key in range(6):
            for agent, rec in d.locate([f"{ns}:".encode() + b"k%d" % key], ns)[0]:
                assert agent in members, (ns, agent)
                assert model[members[agent]][2].get(b"k%d" % key) == rec
    assert d.stats()["peers"] == len(model)


def test_read_groups_split_big_pulls_by_bytes():
    from lmc.storage.backends.p2p.backend import READ_GROUP_BYTES, read_groups

    assert read_groups([]) == [0]
    assert read_groups([1 << 20] * 8) == [8]  # under the threshold: one READ
    mib8 = [8 << 20] * 32  # bench_p2p's pull: four groups of eight
    assert read_groups(mib8) == [8, 8, 8, 8]
    assert sum(read_groups([READ_GROUP_BYTES, 1, 1, 1])) == 4
    for sizes in ([READ_GROUP_BYTES] * 3, [5 << 20] * 7 + [40 << 20], [64 << 20] * 2):
        g = read_groups(sizes)
        assert sum(g) == len(sizes) and all(k > 0 for k in g) and len(g) <= 4, (sizes, g)
