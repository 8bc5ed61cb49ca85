"""The owner side's bounds: exported chunks (references L1 cannot evict) are capped in bytes,
oldest first, and expire after ``export_ttl`` even with no call on the tier; each one leaves
the version table and the directory, and its reference is given back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server.daemon_proc import ROOT, DaemonProc

from .conftest import require_nixl

pytestmark = pytest.mark.integration


def test_exports_bounded_in_bytes_and_time(tmp_path):
    require_nixl()
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    try:
        out = subprocess.run([sys.executable, "-m", "tests.p2p.owner_bounds",
                              f"p2p+lmc://127.0.0.1:{d.info['port']}?ns=bounds"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
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
    assert r["refs"] == [1, 1, 2, 2, 2, 2] and r["live_slots"] == 4
    assert r["after_ttl"] == [False] * 5 + [True]
    assert r["swept"] == [False] * 6 and 1.0 <= r["swept_after"] < 1.0 + 0.25 + 2.0, r
    assert r["refs_after"] == [1] * 6 and r["live_slots_after"] == 0
    assert r["located_after"] == [False] * 6
    # 6 exports (7 if a loaded machine let the refreshed one expire before its second put),
    # 2 pushed out by the byte bound, the rest expired; every one withdrawn
    st = r["stats"]
    assert st["exported"] in (6, 7) and st["withdrawn"] == st["exported"], st
    assert st["expired"] == st["exported"] - 2, st
    assert r["leaks"] == []
