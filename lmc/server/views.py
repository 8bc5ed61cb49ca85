"""What the daemon shows of its tiers: each tier's declaration (STATS).

STATS says, per tier, what the tier declares (:mod:`lmc.storage.tier`): its
medium and its capabilities, so ``lmc stats`` shows where each tier's hits come from
without guessing from its name.

Nothing here imports torch at load time: ``lmc stats`` reads this module's answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any


def tier_media(tiers: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per tier (by name, in chain order): ``{"medium": "local_storage", "layered_reads":
    True, ...}`` -- the medium's value and every capability flag the tier declares."""
    out: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        medium = getattr(tier, "medium", None)
        caps = getattr(tier, "capabilities", None)
        flags = (dataclasses.asdict(caps) if dataclasses.is_dataclass(caps)
                 and not isinstance(caps, type) else {})
        out[str(tier.name)] = {"medium": str(getattr(medium, "value", medium or "remote")),
                               **{k: bool(v) for k, v in flags.items()}}
    return out
