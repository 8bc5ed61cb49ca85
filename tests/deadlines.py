"""Time in tests, on a machine that may be loaded: a test never asserts that something was
fast, only that it was bounded, and only where the unbounded alternative is a hang.

Two kinds of clock figures appear in tests, each with its own rule:

* a **timeout on a path that must succeed** (a lookup answered, a server started, a reply
  read) is a hang guard: ``HANG_S``, far beyond anything a loaded 2-core machine takes, so
  that only a hang reaches it;
* a **bound that is the point of the test** ("a dead rank is a miss within the timeout",
  "a malformed answer is refused at once, not after the timeout") compares against an
  alternative that waits ``HANG_S`` or forever (a peer that never answers, a timeout of
  ``HANG_S``), never against a quiet machine's speed; ``SLACK_S`` is what scheduling may add
  on top of the bound (a process descheduled behind two CPU-bound neighbours for seconds).

Under two CPU-bound processes beside the suite on 2 cores, steps that take milliseconds
alone took up to ~10x longer, and single calls stalled for a second or more.
"""

from __future__ import annotations

HANG_S = 60.0
"""A success path's timeout: only a hang reaches it."""

SLACK_S = 5.0
"""Scheduling delay a bound check allows on top of the bound it checks (a loaded machine);
well under ``HANG_S``, the alternative it tells the bound from."""

AT_ONCE_S = HANG_S / 4
""""At once, not after the timeout": under a timeout of ``HANG_S``, a call that took less
than this did not wait for it."""
