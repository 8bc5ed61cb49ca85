"""A real server a test starts as a child process and then crashes, freezes or stops on
purpose (redis-server, mooncake_master): the signals are the same for every server, only how
it starts differs (a subclass's ``start``)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from typing_extensions import Self


class ServerProcess:
    """``proc`` is the child once ``start()`` ran; ``stop_timeout`` bounds each wait."""

    stop_timeout = 10.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen[Any] | None = None
        self.paused = False

    def start(self) -> Self:
        raise NotImplementedError

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, sockets reset by the kernel."""
        if self.paused:
            self.resume()
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def restart(self) -> Self:
        """Kill, then start again on the same port (empty: nothing persists)."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, the server never answers."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=self.stop_timeout)
        self.proc = None
