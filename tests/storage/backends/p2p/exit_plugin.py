"""A pytest plugin for a child pytest run that made NIXL agents: the run ends with
``os._exit`` and pytest's exit status once everything is reported, skipping the library
destructor NIXL 1.5.1 crashes in at interpreter exit (see :mod:`lmc.storage.backends.p2p.agent`).
``python -m pytest -p tests.storage.backends.p2p.exit_plugin ...``; used by ``test_contract_p2p.py``."""

from __future__ import annotations

import os
import sys

_status = [1]


def pytest_sessionfinish(session, exitstatus) -> None:
    _status[0] = int(exitstatus)


def pytest_unconfigure(config) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[0])
