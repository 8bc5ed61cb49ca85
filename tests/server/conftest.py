"""Real daemons for the server tests: ``lmc server`` started as a subprocess on loopback (an
ephemeral port or a Unix socket under tmp_path), found through its ready file, stopped by
its pid."""

from __future__ import annotations

import pytest

from tests.server.daemon_proc import DaemonProc


@pytest.fixture
def start_daemon(tmp_path):
    """``start_daemon(*flags)`` -> a running :class:`DaemonProc`; all are killed at the end."""
    procs: list[DaemonProc] = []

    def start(*flags: str, name: str = "d", **kw) -> DaemonProc:
        d = DaemonProc(tmp_path / f"{name}{len(procs)}", list(flags), **kw)
        procs.append(d)
        d.start()
        return d

    yield start
    try:
        for d in procs:
            d.audit()
    finally:
        for d in procs:
            d.kill()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One plain daemon (TCP + Unix socket, 256 MiB pool, 4 MiB frames) shared by a module's tests."""
    d = DaemonProc(tmp_path_factory.mktemp("shared"), ["--size", "256MiB", "--max-payload", "4MiB"],
                   unix=True)
    d.start()
    yield d
    try:
        d.audit()
    finally:
        d.kill()
