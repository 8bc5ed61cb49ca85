"""A layer-by-layer read that watches itself: the disk tier's or Redis's ``get_layers``
cut to the chunks worth finishing once the rest would cost more than recomputing.

:mod:`lmc.storage.load_watch` stops a whole-chunk read between pieces. A layered read
(:mod:`lmc.storage.layered_read`) fills every chunk at once, layer 0 of all of them, then
layer 1..., so no chunk is whole until the last layer lands and a stop cannot be "the
chunks read so far". It is a cut instead: the read goes on for the first ``k`` chunks
only (:meth:`LayeredRead.cut`: the tier stops asking for the others' bytes), those alone
verify and load, and the engine recomputes from chunk ``k`` -- nothing partly written is
ever counted, since a chunk counts only once every layer landed and verified.

Which ``k``: finishing the first ``k`` chunks costs the bytes of theirs not yet in place,
at the best rate the read has shown, plus recomputing from chunk ``k`` (nothing when ``k``
is every chunk); the watch keeps the ``k`` with the least cost, and cuts when the chunks
kept now cost more than that (by ``margin`` and ``slack_s``: near-ties go to the load).
What moved counts the bytes of reads in flight (the disk tier's windows, the Redis piece
being received on each connection) as arrived, so the rate is an upper bound of the link's,
taken the lower of two ways: since the read started, and over its latter half (since the
last read that landed before the midpoint), which a link slowing mid-read shows soon. The
cost of finishing is then a lower bound, whatever the link does next (unless it speeds up
again), as the whole-chunk watch's is. And as there, a read waited for with nothing landing
as long as recomputing costs is cut to the chunks already whole (rent-or-buy: at most twice
the better choice), which matters once every byte still missing is in flight. A read that
goes on after a cut (``LayeredRead.stops_on_cut`` False: Redis's connections keep layer
order) would land a kept chunk's last layer after everyone's, so for it the rule weighs
keeping none against keeping all, and a stall cuts to none.

The watch runs on a thread of its own per read, waking at the time its first rule would
cut if nothing more landed, at the stall rule's time, every quarter of the time elapsed
(the latter half's rate moves), or when the read settles: then it ends (every kept chunk
landed, nothing left to cut). A decision costs one pass over the chunks kept.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lmc import units
from lmc.storage.layered_read import LayeredRead
from lmc.storage.load_watch import LoadWatch

log = logging.getLogger(__name__)
MIN_WAKE_S = 1e-3  # the watch re-checks at most this often


@dataclass(frozen=True)
class Progress:
    """What a layered read has shown at time ``now`` (seconds on one clock)."""

    now: float
    t0: float              # the read started
    last: float            # a read last landed (``t0`` if none has)
    moved: float           # bytes moved at most by ``now`` (reads in flight counted)
    ref: tuple[float, float]  # (time, bytes surely moved by then): the latter half's start
    sizes: Sequence[int]   # per kept chunk, its bytes
    landed: Sequence[int]  # per kept chunk, its bytes in place


def rate_bound(p: Progress) -> float:
    """Bytes per second the link has at best shown (module doc); ``inf`` while nothing
    says (no time passed, nothing moved or in flight yet)."""
    best = math.inf
    if p.now > p.t0 and p.moved > 0:
        best = p.moved / (p.now - p.t0)
    t_ref, at_ref = p.ref
    if p.now > t_ref > p.t0 and p.moved > at_ref:
        best = min(best, (p.moved - at_ref) / (p.now - t_ref))
    return best


def costs(p: Progress, rate: float, recompute: Sequence[float]) -> list[float]:
    """Per ``k`` in ``0..len(sizes)``: seconds to finish the first ``k`` chunks at ``rate``
    (bytes moved beyond the whole reads counted as theirs), plus ``recompute[k]``."""
    extra = max(0.0, p.moved - sum(p.landed))
    out, left = [], 0.0
    for k in range(len(p.sizes) + 1):
        out.append(max(0.0, left - extra) / rate + recompute[k])
        if k < len(p.sizes):
            left += p.sizes[k] - p.landed[k]
    return out


@dataclass(frozen=True)
class Decision:
    cut_to: int | None  # keep this many chunks (None: go on)
    wake: float         # when to look again if nothing changes
    why: str = ""


def decide(p: Progress, recompute: Sequence[float], margin: float, slack_s: float,
           partial: bool = True) -> Decision:
    """The watch's rule (module doc) on ``p``: whether to cut, and to how many chunks.
    ``recompute[k]``: seconds to recompute from chunk ``k`` (0 at ``k = len(sizes)`` when
    no cut happened yet). ``partial`` False: the read does not stop for a cut
    (``LayeredRead.stops_on_cut``), so keeping some chunks costs as much waiting as keeping
    all of them; the only cut is to none."""
    n = len(p.sizes)
    rate = rate_bound(p)
    total = costs(p, rate, recompute)
    best = min(range(n + 1) if partial else (0, n), key=lambda k: (total[k], -k))
    if best < n and total[n] > total[best] * (1 + margin) + slack_s:
        return Decision(best, math.inf, f"the {n - best} chunk(s) from chunk {best} would "
                        f"take >= {units.seconds(total[n] - recompute[n])} at the rate shown "
                        f"(<= {units.size(rate)}/s), recomputing them "
                        f"~{units.seconds(recompute[best])}")
    whole = next((k for k in range(n) if p.landed[k] < p.sizes[k]), n)
    if not partial and whole < n:
        whole = 0
    waited = p.now - p.last
    stall = p.last + recompute[whole] * (1 + margin) + slack_s if whole < n else math.inf
    if p.now > stall:
        return Decision(whole, math.inf, f"nothing landed for {units.seconds(waited)}, "
                        f"recomputing from chunk {whole} ~{units.seconds(recompute[whole])}")
    wake = min(_when_cut(p, recompute, margin, slack_s, partial), stall,
               p.now + max(MIN_WAKE_S, (p.now - p.t0) / 4))
    return Decision(None, wake)


def _when_cut(p: Progress, recompute: Sequence[float], margin: float, slack_s: float,
              partial: bool = True) -> float:
    """The earliest time the first rule cuts by the rate since the start if nothing more
    moves (that rate then falls as ``1 / (t - t0)``, so each ``k`` solves linearly)."""
    n = len(p.sizes)
    if p.moved <= 0:
        return math.inf
    extra = max(0.0, p.moved - sum(p.landed))
    left = [0.0]
    for k in range(n):
        left.append(left[-1] + p.sizes[k] - p.landed[k])
    need = [max(0.0, x - extra) for x in left]
    out = math.inf
    for k in range(n) if partial else range(min(n, 1)):
        gain = need[n] - (1 + margin) * need[k]  # bytes: finishing all vs k chunks
        if gain > 0:
            cost = (1 + margin) * recompute[k] + slack_s - recompute[n]  # seconds
            out = min(out, p.t0 + max(0.0, cost) * p.moved / gain)
    return out


def progress(read: LayeredRead, n: int, now: float | None = None) -> Progress:
    """A consistent view of ``read``'s first ``n`` keys."""
    sizes = [o.nbytes if o is not None else 0 for o in read.objs[:n]]
    now = time.monotonic() if now is None else now
    landed, moved, last, ref = read.progress(n, read.t0 + (now - read.t0) / 2)
    return Progress(now, read.t0, last, float(moved), ref, sizes, landed)


def watch_layered(read: LayeredRead, watch: LoadWatch, index: Sequence[int],
                  tier: str) -> None:
    """Watch ``read`` (its key ``j`` is chunk ``index[j]`` of the fetch) until it settles,
    cutting it by the rule (module doc); a cut is told to ``watch`` (``stopped_at``: the
    fetch's first chunk not loaded, ``reason``). Runs on a thread of its own."""
    hits = next((j for j, o in enumerate(read.objs) if o is None), len(read.objs))
    if not hits or math.isinf(watch.limit(index[0])):
        return  # nothing to read, or the compute unknown: nothing to stop for
    while not read.settled and read.kept > 0:
        n = min(hits, read.kept)
        cut = read.kept < hits  # a cut already commits to recomputing from chunk n
        recompute = [watch.recompute_from(index[k]) for k in range(n)]
        recompute.append(watch.recompute_from(index[n]) if cut else 0.0)
        d = decide(progress(read, n), recompute, watch.margin, watch.slack_s,
                   read.stops_on_cut)
        if d.cut_to is not None:
            if read.cut(d.cut_to):
                at = index[d.cut_to] if d.cut_to < len(index) else index[-1]
                watch.stop(at, f"tier {tier}, read layer by layer: {d.why}")
                log.debug("lmc: layered read of tier %s cut to %d chunk(s): %s", tier,
                          d.cut_to, d.why)
            continue
        wait = d.wake - time.monotonic()
        read.wait_change(max(MIN_WAKE_S, min(wait, 3600.0)))
