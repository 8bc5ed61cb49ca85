"""A process that made a NIXL agent ends with the status it meant, not a segfault: NIXL
1.5.1's UCX plug-in loads two copies of libnl-route, and the wheel's copy crashed in its C
destructor at every exit (rc 139) unless user code ended with ``os._exit``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.requirements import missing

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = textwrap.dedent("""
    import sys
    from lmc.memory.pool import MemoryPool
    from lmc.storage.backends.p2p.agent import PoolAgent
    pool = MemoryPool(8 << 20, pin_memory=False, prefault="off")
    window = MemoryPool(8 << 20, pin_memory=False, prefault="off")
    agent = PoolAgent("exit-test", pool, window)
    print("agent made", flush=True)
    mode = sys.argv[1]
    if mode == "closed":
        agent.close()
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "raise":
        raise RuntimeError("boom")
    elif mode == "atexit":
        import atexit
        atexit.register(lambda: print("user atexit ran", flush=True))
""")


def _nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        missing("needs nixl (pip install --no-deps nixl nixl-cu12)")


@pytest.mark.parametrize("mode, rc", [("plain", 0), ("closed", 0), ("exit3", 3), ("raise", 1),
                                      ("atexit", 0)])
def test_exit_status_is_the_programs(mode, rc):
    _nixl()
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == rc, (p.returncode, p.stderr[-2000:])
    assert "agent made" in p.stdout
    if mode == "raise":
        assert "RuntimeError: boom" in p.stderr
    if mode == "atexit":
        assert "user atexit ran" in p.stdout  # other exit functions still run
