"""The owner side's bounds: exported chunks (copies in the export window, the only memory
peers can READ) are capped by the window's bytes, oldest first, and expire after
``export_ttl`` even with no call on the tier; each one leaves the version table and the
directory, and its window memory is given back. The caller's objects are never held.
Threat model: ``docs/threats/p2p.md``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.deadlines import HANG_S, SLACK_S
from tests.server.daemon_proc import ROOT, DaemonProc

from .conftest import require_nixl

pytestmark = pytest.mark.integration


TTL = 2 * SLACK_S  # its fractions (0.1 TTL at the least) hold a loaded machine's delays


def test_exports_bounded_in_bytes_and_time(tmp_path):
    require_nixl()
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    try:
        out = subprocess.run([sys.executable, "-m", "tests.storage.backends.p2p.owner_bounds",
                              f"p2p+lmc://127.0.0.1:{d.info['port']}?ns=bounds", str(TTL)],
                             cwd=ROOT, capture_output=True, text=True, timeout=4 * HANG_S,
                             env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "NIXL_LOG_LEVEL": "WARN"})
    finally:
        d.kill()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@lmc ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1][5:])
    newest4 = [False, False, True, True, True, True]
    assert r["slots_were_clear"]
    assert r["exported"] == newest4 and r["located"] == newest4
    assert r["refs"] == [1] * 6 and r["live_slots"] == 4 and r["window_used"] == 4 * 8192
    assert r["after_ttl"] == [False] * 5 + [True]
    assert r["swept"] == [False] * 6 and TTL <= r["swept_after"] < TTL * 1.25 + SLACK_S, r
    assert r["refs_after"] == [1] * 6 and r["live_slots_after"] == 0
    assert r["window_used_after"] == 0
    assert r["located_after"] == [False] * 6
    # 7 exports (the stored-again one twice), 2 pushed out of the window, one replaced by
    # its second export (unless a loaded machine let it expire first), the rest expired;
    # every one withdrawn
    st = r["stats"]
    assert st["exported"] == 7 and st["withdrawn"] == 7, st
    assert st["expired"] in (4, 5), st
    assert r["leaks"] == []
