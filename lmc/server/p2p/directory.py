"""The daemon's directory of who holds which chunk, for the peer-to-peer tier.

Why the daemon: a node's engines already share it (one address in their config, one token
scheme, namespaces that keep tenants apart), and chunk keys are content addresses, so engines
agree on names without coordinating; the directory only has to map a key to an owner. Why
entries belong to a connection: an owner that dies closes its socket (the kernel does it,
SIGKILL included), and its entries go with it, so a dead owner is forgotten without timers or
heartbeats. An owner that is alive but slow is the reader's deadline's business; an entry
whose chunk the owner let go is caught by the version check (:mod:`lmc.storage.backends.p2p.wire`).

Tenants. A peer joins *in one namespace* its token grants (the daemon checks the grant), and
everything about it lives in that namespace only: its agent name (``decode-0`` of one
namespace is not ``decode-0`` of another, so no tenant can take another's name), its records
(keys are the daemon's namespace-keyed internal keys) and its metadata (``peer`` answers
within the asker's namespace). So a reader only ever learns owners of a namespace it may use.

Bounded: at most ``max_peers`` joined connections *per token* (the daemon's grant name; one
tenant filling its share leaves every other's free), each with at most ``max_entries``
records (the oldest go first; the owner still holds the chunk, it is just no longer found),
and ``locate`` names at most ``max_holders`` owners per key: ~6 MiB of daemon memory per
full peer, ~200 MiB per token at worst with the defaults. Not thread-safe by design: the
daemon calls it from its event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from lmc.storage.backends.p2p.wire import PeerInfo


class DirectoryFull(Exception):
    """This token has ``max_peers`` connections joined already."""


class _Peer:
    __slots__ = ("info", "ns", "owner", "entries")

    def __init__(self, info: PeerInfo, ns: str, owner: str) -> None:
        self.info = info
        self.ns = ns
        self.owner = owner  # the token (grant name) it joined with: what the bound counts
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()  # internal key -> record


class PeerDirectory:
    """Keys are the daemon's internal (namespace-keyed) keys; records are opaque bytes here
    (their layout is checked when they arrive, by the session)."""

    def __init__(self, max_peers: int = 32, max_entries: int = 1 << 14,
                 max_holders: int = 4) -> None:
        if max_peers < 1 or max_entries < 1 or max_holders < 1:
            raise ValueError("max_peers, max_entries and max_holders must be >= 1")
        self.max_peers = max_peers
        self.max_entries = max_entries
        self.max_holders = max_holders
        self._peers: dict[Hashable, _Peer] = {}  # by owning connection
        self._by_agent: dict[tuple[str, str], Hashable] = {}  # (namespace, agent) -> conn
        self._per_owner: dict[str, int] = {}  # joined connections per token
        self._holders: dict[bytes, list[Hashable]] = {}  # most recent last; usually one
        self.dropped = 0  # records pushed out by max_entries

    def join(self, conn: Hashable, info: PeerInfo, ns: str = "", owner: str = "open") -> None:
        """Bind ``info.agent`` to this connection in namespace ``ns`` for token ``owner`` (a
        second JOIN on it replaces the first and forgets its records: the agent restarted)."""
        other = self._by_agent.get((ns, info.agent))
        if other is not None and other is not conn:
            raise ValueError(f"agent name {info.agent!r} is taken in this namespace by "
                             "another connection")
        if conn in self._peers:
            self.leave(conn)
        elif self._per_owner.get(owner, 0) >= self.max_peers:
            raise DirectoryFull(f"this token has {self.max_peers} peers joined already "
                                "(the directory's per-token bound)")
        self._peers[conn] = _Peer(info, ns, owner)
        self._by_agent[(ns, info.agent)] = conn
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1

    def leave(self, conn: Hashable) -> int:
        """Forget a connection's agent and every record it advertised; how many."""
        peer = self._peers.pop(conn, None)
        if peer is None:
            return 0
        self._by_agent.pop((peer.ns, peer.info.agent), None)
        left = self._per_owner[peer.owner] - 1
        if left:
            self._per_owner[peer.owner] = left
        else:
            del self._per_owner[peer.owner]
        for k in peer.entries:
            self._unhold(k, conn)
        return len(peer.entries)

    def joined(self, conn: Hashable) -> bool:
        return conn in self._peers

    def namespace_of(self, conn: Hashable) -> str | None:
        """The namespace this connection joined in (None: it has not joined)."""
        peer = self._peers.get(conn)
        return None if peer is None else peer.ns

    def peer_info_of(self, conn: Hashable) -> PeerInfo:
        return self._peers[conn].info

    def advertise(self, conn: Hashable, ikeys: Sequence[bytes], records: Sequence[bytes]
                  ) -> int:
        peer = self._peers.get(conn)
        if peer is None:
            raise ValueError("advertise before join")
        for k, rec in zip(ikeys, records, strict=True):
            if k in peer.entries:
                peer.entries.move_to_end(k)
            peer.entries[k] = rec
            holders = self._holders.get(k)
            if holders is None:
                self._holders[k] = [conn]
            elif holders[-1] is not conn:
                if conn in holders:
                    holders.remove(conn)
                holders.append(conn)
            while len(peer.entries) > self.max_entries:
                old, _ = peer.entries.popitem(last=False)
                self._unhold(old, conn)
                self.dropped += 1
        return len(ikeys)

    def withdraw(self, conn: Hashable, ikeys: Sequence[bytes]) -> int:
        peer = self._peers.get(conn)
        if peer is None:
            return 0
        n = 0
        for k in ikeys:
            if peer.entries.pop(k, None) is not None:
                self._unhold(k, conn)
                n += 1
        return n

    def locate(self, ikeys: Sequence[bytes], ns: str = "", exclude: str | None = None
               ) -> list[list[tuple[str, bytes]]]:
        """For each key (internal keys of namespace ``ns``), ``(agent, record)`` of its
        holders other than ``exclude`` (the asker's own agent in ``ns``), most recent first,
        at most ``max_holders``: a reader whose newest holder fails its checks tries the
        next one instead of missing for as long as that holder lies."""
        mine = self._by_agent.get((ns, exclude)) if exclude else None
        out: list[list[tuple[str, bytes]]] = []
        for k in ikeys:
            found: list[tuple[str, bytes]] = []
            for conn in reversed(self._holders.get(k, ())):
                if conn is not mine:
                    peer = self._peers[conn]
                    found.append((peer.info.agent, peer.entries[k]))
                    if len(found) == self.max_holders:
                        break
            out.append(found)
        return out

    def peer(self, agent: str, ns: str = "") -> PeerInfo | None:
        """The agent named ``agent`` *in namespace* ``ns``; another namespace's is None."""
        conn = self._by_agent.get((ns, agent))
        return None if conn is None else self._peers[conn].info

    def _unhold(self, k: bytes, conn: Hashable) -> None:
        holders = self._holders.get(k)
        if holders is not None and conn in holders:
            holders.remove(conn)
            if not holders:
                del self._holders[k]

    def stats(self) -> dict[str, int]:
        """Safe from another thread (the daemon's STATS runs off the event loop): the peers
        are copied in one step before their records are counted."""
        peers = list(self._peers.values())
        return {"peers": len(peers), "keys": len(self._holders),
                "records": sum(len(p.entries) for p in peers), "dropped": self.dropped}
