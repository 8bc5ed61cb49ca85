"""Where a publisher's sockets listen: vLLM's endpoint rules, lmc's loopback defaults, and
the claim that keeps a second process off an ``ipc://`` path in use.

vLLM's rules, kept so an operator can copy a deployment's ``--kv-events-config`` over: an
endpoint holding ``*``/``::`` or naming ``ipc://``/``inproc://`` is bound, any other is
*connected to* (a subscriber that binds, as llm-d's); a tcp port goes up by the
data-parallel rank. vLLM's own default PUB endpoint is ``tcp://*:5557`` (every interface)
and it serves no replay socket. lmc's defaults differ on purpose: an endpoint left unset
(``""``) is bound on loopback (:data:`DEFAULT_PUB`, :data:`DEFAULT_REPLAY`), so events reach
another host only once the operator names an address -- a wildcard is a choice, never a
default (the sockets have no authentication and carry prompts' tokens).

ZMQ binds an ``ipc://`` path by unlinking whatever socket file is there: a second process
given the same path would silently take it over (new subscribers and dumps see only the
newcomer). A ``tcp://`` port in use fails to bind; :class:`IpcClaim` makes an ``ipc://``
path in use fail too: an exclusive ``flock`` on ``<path>.lock`` for the socket's life (the
kernel drops it when the process dies, so a dead process's leftovers are reused), and a
connect to the path itself (a live listener that is not lmc's, e.g. a vLLM engine, is a
clear error as well).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket

DEFAULT_PUB = "tcp://127.0.0.1:5557"
"""The PUB endpoint when ``endpoint`` is unset: loopback, bound."""
DEFAULT_REPLAY = "tcp://127.0.0.1:5558"
"""The replay endpoint when ``replay_endpoint`` is unset: loopback, bound."""


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's rule: a tcp port goes up by the data-parallel rank (port 0 stays 0); an
    inproc name gets ``_dp<rank>``."""
    if not dp_rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port):
            return f"{base}:{int(port) + dp_rank}"
    return endpoint


def binds(endpoint: str) -> bool:
    """vLLM binds an endpoint with a wildcard host or a local transport, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connectable(endpoint: str) -> str:
    """A bound endpoint as a peer on this host connects to it."""
    return endpoint.replace("//0.0.0.0:", "//127.0.0.1:")


class EndpointInUse(ValueError):
    """Another live process listens at an ``ipc://`` path this one was told to bind."""


class IpcClaim:
    """This process's claim on an ``ipc://`` path (see the module docstring); a no-op for
    other transports and for Linux's abstract names (``ipc://@name``: the kernel refuses a
    second bind there already). :meth:`release` after the socket is closed."""

    def __init__(self, endpoint: str) -> None:
        self.path: str | None = None
        self._fd: int | None = None
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
            return
        path = endpoint[len("ipc://"):]
        self._fd = _lock(path + ".lock", endpoint)
        self.path = path
        try:
            _refuse_live_listener(path, endpoint)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlink the lock file while still holding it (a process that opened it meanwhile
        sees it gone and makes a new one: :func:`_lock`), then drop the lock."""
        if self._fd is None:
            return
        assert self.path is not None
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".lock")
        os.close(self._fd)
        self._fd = None


def _lock(lock_path: str, endpoint: str) -> int:
    """An exclusive lock on ``lock_path``, created if missing; :class:`EndpointInUse` if a
    live process holds it. Retried when the file was unlinked between open and lock."""
    for _ in range(8):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointInUse(f"{endpoint} is in use by another running process (it "
                                f"holds {lock_path}); give each engine its own "
                                "path") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # released and unlinked by its holder meanwhile: lock the new one
    raise EndpointInUse(f"{endpoint}: could not lock {lock_path} (it keeps being replaced)")


def _refuse_live_listener(path: str, endpoint: str) -> None:
    """:class:`EndpointInUse` if something accepts connections at ``path`` (a socket file
    left by a dead process refuses them: ZMQ replaces it)."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            raise EndpointInUse(f"{endpoint}: cannot tell whether {path} is in use "
                                f"({e.strerror}); give this engine another path") from None
        return
    finally:
        probe.close()
    raise EndpointInUse(f"{endpoint} is in use: another process listens at {path}; give "
                        "each engine its own path")
