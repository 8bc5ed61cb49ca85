"""Codecs for tests of the codec stage (:mod:`lmc.storage.codec`): the real codec's rules,
with every final check counted or refused."""

from __future__ import annotations

from typing import Any

from lmc.storage.codec import ValueCodec
from lmc.storage.serde import CorruptValue, Header


class CountingCodec(ValueCodec):
    """The real codec (same secret), counting the values it verified."""

    def __init__(self, codec: ValueCodec) -> None:
        super().__init__(codec.integrity)
        self.verified = 0

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any,
               digest: int | None = None) -> None:
        super().verify(key, head, hdr, payload, digest)
        self.verified += 1


class RejectingCodec(CountingCodec):
    """Passes the real checks, then refuses the value: a read path through the codec must
    turn every value into a miss."""

    def verify(self, key: bytes, head: Any, hdr: Header, payload: Any,
               digest: int | None = None) -> None:
        super().verify(key, head, hdr, payload, digest)
        raise CorruptValue("refused by the test's codec")
