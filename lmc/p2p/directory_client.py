"""The engine's side of the directory ops: one blocking connection per role.

An owner keeps one *membership* connection open for as long as it exports chunks: its records
live exactly as long as that connection (see :mod:`lmc.p2p.directory`). Readers ask on a
separate connection so a lookup never waits behind an owner's advertisement. Failures raise;
the tier turns them into misses.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmc.p2p.wire import PeerInfo, Record, peer_info, unpack_record
from lmc.server import protocol as P
from lmc.server.client import Address, ClientConnection


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
        self.conn.call(P.P2P_JOIN, info.as_meta())

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

    def locate(self, keys: Sequence[bytes], me: str) -> list[tuple[str, Record] | None]:
        """Each key's holder (never ``me``) and its record; a malformed answer raises."""
        out: list[tuple[str, Record] | None] = []
        for i in range(0, len(keys), self.batch):
            part = list(keys[i: i + self.batch])
            _, m = self.conn.call(P.P2P_LOCATE, {"ns": self.ns, "keys": part, "self": me})
            agents, records = m.get("agents"), m.get("records")
            if (not isinstance(agents, list) or not isinstance(records, list)
                    or len(agents) != len(part) or len(records) != len(part)):
                raise P.ProtocolError(P.BAD_FRAME, "p2p locate answer malformed", fatal=True)
            for k, a, r in zip(part, agents, records):
                if a is None or r is None:
                    out.append(None)
                    continue
                rec = unpack_record(r)
                if not isinstance(a, str) or rec.key != k:
                    raise P.ProtocolError(P.BAD_FRAME, "p2p locate answer for another key",
                                          fatal=True)
                out.append((a, rec))
        return out

    def peer(self, agent: str) -> PeerInfo | None:
        _, m = self.conn.call(P.P2P_PEER, {"agent": agent})
        return peer_info(m) if m else None
