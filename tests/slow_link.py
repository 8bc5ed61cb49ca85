"""A real TCP relay in front of a real server whose new connections take ``delay`` seconds to
open: a slow connection set-up (a loaded host, a far-away server), with every byte after it
relayed at once. Tests of the remote tiers' first calls put it between an engine and Redis
or a Mooncake master."""

from __future__ import annotations

import contextlib
import socket
import threading


class SlowConnects:
    """Listens on 127.0.0.1:``port``; each accepted connection is held ``delay`` seconds,
    then joined to ``upstream`` and relayed both ways until either side closes."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="slow-connects").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._join, args=(client,), daemon=True).start()

    def _join(self, client: socket.socket) -> None:
        if self._stop.wait(self.delay):
            client.close()
            return
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            self._open += [client, server]
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.close()
