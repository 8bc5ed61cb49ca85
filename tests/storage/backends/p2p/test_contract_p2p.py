"""The tier contract (:mod:`lmc.testing`, every class) against the P2P tier, with and without
``integrity_secret``, its integrity and isolation cases included: it serves only verified
bytes of the reader's namespace. Threat model: ``docs/threats/p2p.md``.

The tier under test is a pair, because a P2P tier never reads its own exports: reads
(``get``, ``contains``, ``prefix_hits``) are a real P2P tier in this process over the suite's
pool; stores and deletes go to a real P2P tier owning the chunks in another process
(``tests/storage/backends/p2p/contract_owner.py``, one owner tier per pair), which exports them into its
window and advertises them. The directory is a real daemon with two tokens: an admin token
for the suite's tiers, and a tenant token granting only ``team-b`` (the other tenant).

NIXL runs only in child processes (an agent can crash its process at interpreter exit), so
pytest runs this module's suite in a child pytest that ends with ``os._exit``
(``tests/storage/backends/p2p/exit_plugin.py``); the one test here checks that run.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from tests.server.daemon_proc import ROOT

# the child run is the one with the exit plugin loaded (-p loads it before collection)
CHILD = "tests.storage.backends.p2p.exit_plugin" in sys.modules
pytestmark = pytest.mark.integration

if not CHILD:
    def test_p2p_tier_keeps_the_contract(tmp_path):
        from tests.storage.backends.p2p.conftest import require_nixl
        require_nixl()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "tests.storage.backends.p2p.exit_plugin", "-p",
             "no:cacheprovider", "--basetemp", str(tmp_path / "t"), __file__],
            cwd=ROOT, capture_output=True, text=True, timeout=840,
            env={**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "ERROR"})
        print(proc.stdout[-6000:])
        assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and "failed" not in proc.stdout

else:
    from lmc.config import CacheConfig
    from lmc.memory.pool import MemoryObj, MemoryPool
    from lmc.storage.backends.p2p.backend import P2PBackend
    from lmc.storage.tier import Key, StorageBackend, register_backend
    from lmc.testing import TierContract, TierSpec
    from lmc.testing.harness import TierHarness, get_checked, key_of
    from tests.server.daemon_proc import DaemonProc
    from tests.storage.backends.framings import CountingFraming, RejectingFraming

    SECRET = "contract-suite-secret-0123456789"
    ADMIN, TENANT = "p2p-contract-admin-token", "p2p-contract-tenant-token"

    class OwnerProc:
        """``tests.storage.backends.p2p.contract_owner`` in a child process, one request at a time."""

        def __init__(self) -> None:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "ERROR"}
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.storage.backends.p2p.contract_owner"],
                                         cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            self.lock = threading.Lock()
            self._read()

        def _read(self) -> dict:
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"owner process ended (rc={self.proc.poll()})")
                if line.startswith("@lmc "):
                    return json.loads(line[5:])

        def __call__(self, op: str, **kw: Any) -> dict:
            with self.lock:
                self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
                self.proc.stdin.flush()
                out = self._read()
            assert "error" not in out, out
            return out

        def stop(self) -> None:
            if self.proc.poll() is None:
                self("exit")
            self.proc.wait(30)

    @register_backend("p2p-contract-pair")
    class PairTier(StorageBackend):
        """Reads from this process's P2P tier; stores and deletes through its owner."""

        name = "p2p"
        medium, capabilities = P2PBackend.medium, P2PBackend.capabilities  # what it is

        def __init__(self, spec: str = "p2p-contract-pair", *, config: CacheConfig,
                     pool: MemoryPool, owners: OwnerProc, **_: Any) -> None:
            self.id = uuid.uuid4().hex[:10]
            self.pool = pool
            self.owners = owners
            self.reader = P2PBackend(config.remote_url, config=config, pool=pool)
            self.namespace = self.reader.namespace
            self._lock = threading.Lock()
            self._closed = False
            owners("open", id=self.id, url=f"{config.remote_url}?ns={self.namespace}",
                   token=config.remote_token, secret=config.integrity_secret)

        def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
            if len(keys) != len(objs):
                raise ValueError(f"put of {len(keys)} keys with {len(objs)} objects")
            items = [[k.hex(), list(o.shape), str(o.dtype).removeprefix("torch."),
                      base64.b64encode(bytes(o.byte_view())).decode()]
                     for k, o in zip(keys, objs)]
            with self._lock:
                if self._closed:
                    return 0
                return self.owners("put", id=self.id, items=items)["stored"]

        def delete(self, keys: Sequence[Key]) -> int:
            with self._lock:
                if self._closed or not keys:
                    return 0
                return self.owners("delete", id=self.id, keys=[k.hex() for k in keys])[
                    "deleted"]

        def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
            return self.reader.get(keys)

        def contains(self, keys: Sequence[Key]) -> list[bool]:
            return self.reader.contains(keys)

        def damage(self, key: Key) -> None:
            self.owners("damage", id=self.id, key=key.hex())

        def close(self) -> None:
            self.reader.close()
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                self.owners("close", id=self.id)

        def stats(self) -> dict[str, Any]:
            return self.reader.stats()

    @pytest.fixture(scope="module")
    def contract_directory(tmp_path_factory):
        """The directory daemon, with an admin token and a tenant token granting team-b."""
        wd = tmp_path_factory.mktemp("contract-p2p")
        (wd / "admin").write_text(ADMIN)
        (wd / "tenant").write_text(TENANT)
        d = DaemonProc(wd / "d", ["--size", "8MiB", "--tokens", f"{wd / 'admin'}:admin",
                                  "--tokens", f"{wd / 'tenant'}:team-b"]).start()
        yield d
        d.kill()

    @pytest.fixture(scope="module")
    def p2p_owners(contract_directory):
        """The owner process (``tests/storage/backends/p2p/contract_owner.py``): one P2P tier per contract
        tier, exporting what the suite stores; stopped (and checked to exit) after the
        module, before the directory goes."""
        owners = OwnerProc()
        yield owners
        owners.stop()
        assert owners.proc.returncode == 0, f"the owner process exited {owners.proc.returncode}"

    @pytest.fixture(params=["plain", "keyed"])
    def tier_spec(request, contract_directory, p2p_owners):
        d, owners = contract_directory, p2p_owners
        keyed = request.param == "keyed"
        url = f"p2p+lmc://127.0.0.1:{d.info['port']}"
        return TierSpec(
            "p2p-contract-pair",
            config=lambda: {"remote_url": url, "remote_token": ADMIN,
                            "remote_key_prefix": f"c{uuid.uuid4().hex[:10]}",
                            "remote_timeout": 1.0,
                            **({"integrity_secret": SECRET} if keyed else {})},
            kwargs={"owners": owners},
            corrupt=lambda tier, key: tier.damage(key),
            kill=lambda tier: d.kill(), revive=lambda tier: d.start(),
            hang=lambda tier: os.kill(d.pid, signal.SIGSTOP),
            unhang=lambda tier: os.kill(d.pid, signal.SIGCONT),
            unkeyed_writer=lambda tier: {"remote_key_prefix": tier.namespace},
            other_tenants=lambda tier: [
                {"remote_key_prefix": tier.namespace, "remote_token": TENANT},
                {"remote_key_prefix": "team-b", "remote_token": TENANT}],
            skip={"test_dead_backend_answers_misses_within_a_deadline":
                  "killed in the plain run (one daemon restart per run)"} if keyed else {})

    class TestP2PContract(TierContract):
        """Every contract test, plain and keyed."""

    class TestP2PCodec(TierHarness):
        """The P2P read goes through the reader's framing (:mod:`lmc.storage.framing`), as every
        shared tier's does (``test_framing_stage.py``): each pulled chunk is verified by it,
        and a framing that refuses makes every pull a miss, counted."""

        def test_every_pull_is_verified_by_the_codec(self, make_tier, tier_spec):
            tier = make_tier()
            keys = [key_of(f"p2p-codec-{i}") for i in range(3)]
            self.store(tier, tier_spec, keys)
            reader = tier.reader
            reader.framing = counting = CountingFraming(reader.framing)
            assert get_checked(tier, keys) == 3
            assert counting.verified == 3, "a pull was not verified by the framing"
            reader.framing = refusing = RejectingFraming(reader.framing)
            assert get_checked(tier, keys, misses=True) == 0, "a refused pull was served"
            assert refusing.verified == 3
            assert reader.stats()["verify_failures"] == 3
