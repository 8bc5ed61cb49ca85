"""What a test needs from the machine, in one place: a missing piece skips the test naming it,
except under ``CI=true``, where it fails the test. ``.ci/run`` installs everything the suite
uses (redis-server and the redis package, the vLLM and SGLang venvs, the C helper, a C++
compiler), so there a missing piece is a broken build, not a reason to pass unseen.

Only for things CI provides; a capability no CI machine has (a CUDA device, nvcc, root for a
PID namespace) stays a plain skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    """``CI=true`` (any case), as ``.ci/run`` exports it."""
    return os.environ.get("CI", "").lower() == "true"


def missing(what: str) -> NoReturn:
    """Skip the running test saying ``what`` is missing (and how to get it); fail it under CI."""
    if under_ci():
        pytest.fail(f"{what} (CI=true: .ci/run provides this, so its absence fails the test)",
                    pytrace=False)
    pytest.skip(what)
