"""Codecs for tests of the framing stage (:mod:`lmc.storage.framing`): the real framing's rules,
with every final check counted or refused."""

from __future__ import annotations

from typing import Any

from lmc.storage.framing import ValueFraming
from lmc.storage.serde import CorruptValue, Header


class CountingFraming(ValueFraming):
    """The real framing (same secret), counting the values it verified."""

    def __init__(self, framing: ValueFraming) -> None:
        super().__init__(framing.integrity)
        self.verified = 0

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any,
               digest: int | None = None) -> None:
        super().verify(key, head, hdr, payload, digest)
        self.verified += 1


class RejectingFraming(CountingFraming):
    """Passes the real checks, then refuses the value: a read path through the framing must
    turn every value into a miss."""

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any,
               digest: int | None = None) -> None:
        super().verify(key, head, hdr, payload, digest)
        raise CorruptValue("refused by the test's framing")
