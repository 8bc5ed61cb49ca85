"""Health checks of the instances behind ``lmc router`` and ``lmc pd-proxy`` (one job: keep
each :class:`~lmc.router.dispatch.Instance`'s ``healthy`` true to what it answers).

Every ``--health-interval`` seconds each instance gets ``GET /health`` (one thread per
instance, so a hung one delays only itself; each probe within :data:`HEALTH_TIMEOUT`): a 200
makes it healthy, any other status unhealthy; a refused connection marks it down at once,
a timeout or a hang-up at the second in a row (one may be a busy moment). The front marks an
instance down at once too when it refuses a request's connection (:meth:`Fleet.mark
<lmc.router.dispatch.Fleet.mark>`); the next probe that it answers brings it back. Each change
is one INFO line naming the instance.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmc.router.relay import UPSTREAM_ERRORS, what

if TYPE_CHECKING:  # dispatch's Front starts these checks
    from lmc.router.dispatch import Fleet, Instance

HEALTH_TIMEOUT = 5.0
DEFAULT_INTERVAL = 2.0


class HealthChecks:
    """The probe threads of some fleets (the module docstring); :meth:`close` stops them."""

    def __init__(self, fleets: Sequence[Fleet], interval: float = DEFAULT_INTERVAL,
                 name: str = "lmc-health") -> None:
        if not 0 < interval <= 86400:
            raise ValueError(f"--health-interval must be in (0, 86400] s, got {interval}")
        self.interval = interval
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(fleet, inst), name=name,
                                          daemon=True)
                         for fleet in fleets for inst in fleet.instances]

    def start(self) -> HealthChecks:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _loop(self, fleet: Fleet, inst: Instance) -> None:
        while not self._stop.is_set():
            probe(fleet, inst)
            self._stop.wait(self.interval)


def probe(fleet: Fleet, inst: Instance) -> None:
    """One ``GET /health`` of ``inst``, its answer marked in ``fleet``."""
    conn = http.client.HTTPConnection(inst.upstream.host, inst.upstream.port,
                                      timeout=HEALTH_TIMEOUT)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read(4096)
        inst.probe_failures = 0
        fleet.mark(inst, resp.status == 200, f"/health answered {resp.status}")
    except UPSTREAM_ERRORS as e:
        inst.probe_failures += 1
        if isinstance(e, ConnectionRefusedError) or inst.probe_failures >= 2:
            fleet.mark(inst, False, what(e)[:120])
    finally:
        conn.close()
