"""The daemon's handlers for the directory ops (``P2P_*`` in
:mod:`lmc.storage.backends.server.protocol`).

Every field is checked before it touches the directory; a bad one is a ``bad_request`` answer
and the connection stays. Every op names a namespace (``ns``) the connection's token must
grant (``forbidden`` otherwise), and acts in that namespace only: JOIN binds the agent name
there, PEER answers only agents of that namespace, ADVERTISE and WITHDRAW must use the
namespace the connection joined in, LOCATE turns keys into that namespace's internal keys. So
a tenant never learns another tenant's owners, their metadata or their records. Threat
model: ``docs/threats/p2p.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmc.server.p2p.directory import DirectoryFull
from lmc.storage.backends.p2p.wire import BadRecord, peer_info, unpack_record
from lmc.storage.backends.server import protocol as P

if TYPE_CHECKING:
    from lmc.server.session import Session


def _bad(msg: str) -> P.ProtocolError:
    return P.ProtocolError(P.BAD_REQUEST, msg)


def _owner(session: Session) -> str:
    """Whose share of the directory a join counts against: the token's grant name."""
    grant = session.grant
    return "open" if grant is None else grant.name


def answer(session: Session, h: P.FrameHeader, meta: dict[str, Any]) -> dict[str, Any]:
    """The answer to one directory request on ``session`` (which sends it), or a
    ``bad_request``/``forbidden`` ``ProtocolError``. Uses only the session's public side."""
    d = session.store.p2p
    ns = session.granted_namespace(meta)
    if h.op == P.P2P_JOIN:
        try:
            d.join(session, peer_info(meta), ns, _owner(session))
        except (ValueError, DirectoryFull) as e:
            raise _bad(f"p2p join: {e}") from None
        return {}
    if h.op == P.P2P_PEER:
        agent = meta.get("agent")
        if not isinstance(agent, str):
            raise _bad("p2p peer: field 'agent' must be a string")
        info = d.peer(agent, ns)
        return {} if info is None else info.as_meta()
    keys = P.get_keys(meta, session.limits)
    ikeys = session.store.internal_keys(ns, keys)
    if h.op == P.P2P_ADVERTISE:
        _check_joined_in(session, ns, "advertise")
        return {"advertised": _advertise(session, keys, ikeys, meta)}
    if h.op == P.P2P_WITHDRAW:
        _check_joined_in(session, ns, "withdraw")
        return {"withdrawn": d.withdraw(session, ikeys)}
    me = meta.get("self")  # P2P_LOCATE
    found = d.locate(ikeys, ns, me if isinstance(me, str) else None)
    return {"agents": [[a for a, _ in f] for f in found],
            "records": [[r for _, r in f] for f in found]}


def _check_joined_in(session: Session, ns: str, what: str) -> None:
    joined = session.store.p2p.namespace_of(session)
    if joined is None:
        raise _bad(f"p2p {what} before p2p join on this connection")
    if joined != ns:
        raise _bad(f"p2p {what} in namespace {ns!r}: this connection joined in {joined!r}")


def _advertise(session: Session, keys: list[bytes], ikeys: list[bytes],
               meta: dict[str, Any]) -> int:
    d = session.store.p2p
    records = meta.get("records")
    if not isinstance(records, list) or len(records) != len(keys):
        raise _bad("p2p advertise: 'records' must be a list, one per key")
    info = d.peer_info_of(session)
    for k, raw in zip(keys, records):
        try:
            rec = unpack_record(raw)
            info.check(rec)
        except BadRecord as e:
            raise _bad(f"p2p advertise: {e}") from None
        if rec.key != k:
            raise _bad("p2p advertise: a record's key differs from its key")
    return d.advertise(session, ikeys, records)
