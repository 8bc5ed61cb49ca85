"""The engine's side of the directory ops: one blocking connection per role.

An owner keeps one *membership* connection open for as long as it exports chunks: its records
live exactly as long as that connection (see :mod:`lmc.server.p2p.directory`). Readers ask on a
separate connection so a lookup never waits behind an owner's advertisement. Failures raise;
the tier turns them into misses.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmc.storage.backends.p2p.wire import PeerInfo, Record, peer_info, unpack_record
from lmc.storage.backends.server import protocol as P
from lmc.storage.backends.server.client import Address, ClientConnection


class DirectoryConnection:
    """A :class:`ClientConnection` speaking the ``P2P_*`` ops in one namespace."""

    def __init__(self, address: Address, namespace: str, token: str | None, timeout: float,
                 client_name: str) -> None:
        self.ns = namespace
        self.conn = ClientConnection(address, token, timeout, client_name)
        self.batch = self.conn.limits.max_batch

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def close(self) -> None:
        self.conn.close()

    def join(self, info: PeerInfo) -> None:
        self.conn.call(P.P2P_JOIN, {"ns": self.ns, **info.as_meta()})

    def advertise(self, records: Sequence[Record]) -> int:
        n = 0
        for i in range(0, len(records), self.batch):
            part = records[i: i + self.batch]
            _, m = self.conn.call(P.P2P_ADVERTISE, {
                "ns": self.ns, "keys": [r.key for r in part],
                "records": [r.pack() for r in part]})
            n += int(m.get("advertised", 0))
        return n

    def withdraw(self, keys: Sequence[bytes]) -> int:
        n = 0
        for i in range(0, len(keys), self.batch):
            _, m = self.conn.call(P.P2P_WITHDRAW, {"ns": self.ns,
                                                   "keys": list(keys[i: i + self.batch])})
            n += int(m.get("withdrawn", 0))
        return n

    def locate(self, keys: Sequence[bytes], me: str) -> list[list[tuple[str, Record]]]:
        """Each key's holders (never ``me``), most recent first, with their records; a
        malformed answer raises."""
        out: list[list[tuple[str, Record]]] = []
        for i in range(0, len(keys), self.batch):
            part = list(keys[i: i + self.batch])
            _, m = self.conn.call(P.P2P_LOCATE, {"ns": self.ns, "keys": part, "self": me})
            agents, records = m.get("agents"), m.get("records")
            if (not isinstance(agents, list) or not isinstance(records, list)
                    or len(agents) != len(part) or len(records) != len(part)):
                raise P.ProtocolError(P.BAD_FRAME, "p2p locate answer malformed", fatal=True)
            out += [_holders(k, a, r) for k, a, r in zip(part, agents, records)]
        return out

    def peer(self, agent: str) -> PeerInfo | None:
        """The agent's metadata, if it joined in this connection's namespace."""
        _, m = self.conn.call(P.P2P_PEER, {"ns": self.ns, "agent": agent})
        return peer_info(m) if m else None


def _holders(key: bytes, agents: object, records: object) -> list[tuple[str, Record]]:
    """One key's answer: equal-length lists of agent names and records for this key."""
    if (not isinstance(agents, list) or not isinstance(records, list)
            or len(agents) != len(records)
            or not all(isinstance(a, str) for a in agents)):
        raise P.ProtocolError(P.BAD_FRAME, "p2p locate answer malformed", fatal=True)
    out = [(a, unpack_record(r)) for a, r in zip(agents, records)]
    if any(rec.key != key for _, rec in out):
        raise P.ProtocolError(P.BAD_FRAME, "p2p locate answer for another key", fatal=True)
    return out
