"""The daemon's handlers for the directory ops (``P2P_*`` in :mod:`lmc.server.protocol`).

Every field is checked before it touches the directory; a bad one is a ``bad_request`` answer
and the connection stays. Keys are turned into the daemon's namespace-keyed internal keys, so
one tenant never sees another's locations; ADVERTISE and LOCATE need the namespace granted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmc.p2p.directory import DirectoryFull
from lmc.p2p.wire import BadRecord, peer_info, unpack_record
from lmc.server import protocol as P

if TYPE_CHECKING:
    from lmc.server.session import Session


def _bad(msg: str) -> P.ProtocolError:
    return P.ProtocolError(P.BAD_REQUEST, msg)


def answer(session: Session, h: P.FrameHeader, meta: dict[str, Any]) -> dict[str, Any]:
    """The answer to one directory request on ``session`` (which sends it), or a
    ``bad_request``/``forbidden`` ``ProtocolError``. Uses only the session's public side."""
    d = session.store.p2p
    if h.op == P.P2P_JOIN:
        try:
            info = peer_info(meta)
            d.join(session, info)
        except (ValueError, DirectoryFull) as e:
            raise _bad(f"p2p join: {e}") from None
        out: dict[str, Any] = {}
    elif h.op == P.P2P_PEER:
        agent = meta.get("agent")
        if not isinstance(agent, str):
            raise _bad("p2p peer: field 'agent' must be a string")
        info = d.peer(agent)
        out = {} if info is None else info.as_meta()
    else:
        ns = session.granted_namespace(meta)
        keys = P.get_keys(meta, session.limits)
        ikeys = session.store.internal_keys(ns, keys)
        if h.op == P.P2P_ADVERTISE:
            out = {"advertised": _advertise(session, keys, ikeys, meta)}
        elif h.op == P.P2P_WITHDRAW:
            out = {"withdrawn": d.withdraw(session, ikeys)}
        else:  # P2P_LOCATE
            me = meta.get("self")
            found = d.locate(ikeys, me if isinstance(me, str) else None)
            out = {"agents": [f[0] if f else None for f in found],
                   "records": [f[1] if f else None for f in found]}
    return out


def _advertise(session: Session, keys: list[bytes], ikeys: list[bytes],
               meta: dict[str, Any]) -> int:
    d = session.store.p2p
    if not d.joined(session):
        raise _bad("p2p advertise before p2p join on this connection")
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
