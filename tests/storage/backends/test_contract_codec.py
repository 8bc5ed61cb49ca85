"""The tier contract (:mod:`lmc.testing`) through the ``codec`` wrapper, over every kind of
tier that holds coded values: disk, Redis (keyed), the ``lmc://`` daemon (plain and keyed),
Mooncake Store (plain and keyed). The memory tier (L1) stays exact, and a P2P peer serves
what its L1 holds: neither holds coded values.
The codec fixture (``TierSpec.lossy``): float chunks come back as the codec's own round trip
of what was stored, bit for bit; other dtypes exactly. The damage hooks of each tier's own
contract test reach the value under the codec's namespaced key."""

import itertools
import shutil
import uuid

import pytest

from lmc.storage.kvcodecs.stage import parse_stage
from lmc.testing import (
    BasicContract,
    BatchContract,
    ConcurrencyContract,
    FailureContract,
    IntegrityContract,
    ModelContract,
    ReferenceContract,
    SharedStoreContract,
    TierContract,
    TierSpec,
)

from .disk.test_contract_disk import _flip_payload_byte
from .mooncake.test_contract_mooncake import _damage as _damage_mooncake
from .mooncake.test_contract_mooncake import _revive, _unhang
from .mooncake.test_contract_mooncake import cluster as mooncake_cluster  # noqa: F401 (fixture)
from .redis.test_contract_redis import _damage, contract_redis  # noqa: F401 (fixture)
from .server.test_contract_server import _forge, _signal, contract_server  # noqa: F401 (fixture)

SECRET = "contract-suite-secret-0123456789"


def _below(hook):
    """A damage hook of the tier below, given the engine's key: the codec's key."""
    if hook is None:
        return None
    return lambda tier, key: hook(tier, tier.active.namespace(key))


def coded(codec: str, inner: TierSpec, **spec) -> TierSpec:
    """``inner`` wrapped by the codec tier (as a ``tiers:`` entry's ``codec:`` builds it)."""
    return TierSpec("codec", kwargs={"codec": codec, "gate": "off"},
                    inner=TierSpec(inner.spec, kwargs=inner.kwargs),
                    lossy=parse_stage(codec).round_trip, **spec)


@pytest.fixture(params=["int4-kivi+zstd", "fp8-e4m3", "int8+lz4"])
def disk_spec(request, tmp_path):
    dirs = (tmp_path / f"disk{i}" for i in itertools.count())
    return coded(request.param, TierSpec("disk"),
                 config=lambda: {"local_disk": str(next(dirs)), "local_disk_size": "512KiB"},
                 corrupt=_below(_flip_payload_byte),
                 kill=lambda tier: shutil.rmtree(tier.path),
                 reopen=lambda tier: {"local_disk": tier.path})


class TestCodecOverDisk(BasicContract, BatchContract, ModelContract, ReferenceContract,
                        ConcurrencyContract, SharedStoreContract, IntegrityContract,
                        FailureContract):
    """What the disk tier runs, coded (no layered reads: a coded value is read whole)."""

    @pytest.fixture
    def tier_spec(self, disk_spec):
        return disk_spec


@pytest.mark.integration
class TestCodecOverKeyedRedis(TierContract):
    @pytest.fixture
    def tier_spec(self, contract_redis):  # noqa: F811
        r = contract_redis
        return coded(
            "int4-kivi", TierSpec(r.url),
            config=lambda: {"remote_key_prefix": f"z{uuid.uuid4().hex[:10]}",
                            "remote_timeout": 1.0, "integrity_secret": SECRET},
            corrupt=_below(_damage(r, keyed=True)),
            kill=lambda tier: r.kill(), revive=lambda tier: r.start(),
            hang=lambda tier: r.pause(), unhang=lambda tier: r.resume(),
            reopen=lambda tier: {"remote_key_prefix": tier.prefix.decode().rstrip(":")},
            other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}])


@pytest.mark.integration
class TestCodecOverDaemon(TierContract):
    @pytest.fixture(params=["plain", "keyed"])
    def tier_spec(self, request, contract_server):  # noqa: F811
        d = contract_server
        keyed = request.param == "keyed"
        import signal

        return coded(
            "fp8-e4m3+lz4", TierSpec(d.url),
            config=lambda: {"remote_key_prefix": f"z{uuid.uuid4().hex[:10]}",
                            "remote_timeout": 1.0,
                            **({"integrity_secret": SECRET} if keyed else {})},
            corrupt=_below(_forge) if keyed else None,
            kill=lambda tier: d.kill(), revive=lambda tier: d.start(),
            hang=lambda tier: _signal(d, signal.SIGSTOP),
            unhang=lambda tier: _signal(d, signal.SIGCONT),
            reopen=lambda tier: {"remote_key_prefix": tier.namespace},
            other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}],
            skip={"test_dead_backend_answers_misses_within_a_deadline":
                  "killed in the plain run"} if keyed else {})


@pytest.mark.integration
class TestCodecOverMooncake(TierContract):
    """A Mooncake Store cluster on loopback (``test_contract_mooncake``'s), its values coded."""

    @pytest.fixture(params=["plain", "keyed"])
    def tier_spec(self, request, mooncake_cluster):  # noqa: F811
        master, _holder, raw = mooncake_cluster
        keyed = request.param == "keyed"
        return coded(
            "int8" if keyed else "int4-kivi+zstd", TierSpec(master.url, kwargs={"segment": 0}),
            config=lambda: {"remote_key_prefix": f"z{uuid.uuid4().hex[:10]}",
                            "remote_timeout": 1.0,
                            **({"integrity_secret": SECRET} if keyed else {})},
            corrupt=_below(_damage_mooncake(raw, keyed)),
            kill=lambda tier: master.kill(), revive=_revive(master, raw),
            hang=lambda tier: master.pause(), unhang=_unhang(master, raw),
            reopen=lambda tier: {"remote_key_prefix": tier.prefix.rstrip("/")},
            other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}])
