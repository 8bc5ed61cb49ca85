"""The tier contract (:mod:`lmc.testing`) against wrapper tiers (``lmc.storage.wrappers``):
a wrapper keeps the contract of the tier it wraps, so each runs the classes its wrapped tier
runs, with that tier's hooks reaching through it (``tier.path``, ``tier.remote_key``...).

* ``counting`` around disk, handed its tier as ``inner=`` (as a ``tiers:`` chain builds it);
* ``rate_limit`` around ``counting`` around disk (wrappers nest; the rate is high enough to
  cost nothing, and the rate limiter reads whole chunks: no layered reads declared);
* ``counting`` around a keyed Redis tier it builds itself (``tier=``, as built by hand), with
  the dead and hung server cases: a wrapper must not turn a miss into an error or a hang.
"""

import itertools
import shutil
import uuid

import pytest

from lmc.testing import (
    BasicContract,
    BatchContract,
    ConcurrencyContract,
    FailureContract,
    IntegrityContract,
    LayeredReadContract,
    ModelContract,
    ReferenceContract,
    SharedStoreContract,
    TierContract,
    TierSpec,
    key_of,
    release,
)

from .conftest import RedisServer, require_redis
from .disk.test_contract_disk import _flip_payload_byte
from .redis.test_contract_redis import _damage

SECRET = "contract-suite-secret-0123456789"


def _around_disk(tmp_path, spec: str, inner: TierSpec, **options) -> TierSpec:
    dirs = (tmp_path / f"disk{i}" for i in itertools.count())
    return TierSpec(spec, config=lambda: {"local_disk": str(next(dirs)),
                                          "local_disk_size": "512KiB"},
                    kwargs=options, inner=inner, corrupt=_flip_payload_byte,
                    kill=lambda tier: shutil.rmtree(tier.path),
                    reopen=lambda tier: {"local_disk": tier.path})


class _AroundDisk(BasicContract, BatchContract, ModelContract, ReferenceContract,
                  ConcurrencyContract, SharedStoreContract, IntegrityContract,
                  LayeredReadContract, FailureContract):
    """What the disk tier runs (test_contract_disk.py), through a wrapper; layered reads run
    where the wrapper declares them (counting passes disk's on; rate_limit declares none, and
    BasicContract checks it then answers none)."""


class TestCountingAroundDisk(_AroundDisk):
    @pytest.fixture
    def tier_spec(self, tmp_path):
        return _around_disk(tmp_path, "counting", TierSpec("disk"))

    def test_the_counts_see_every_call(self, tier, tier_spec):
        """The wrapper is in the path (a contract run through a wrapper that delegated
        nothing would prove nothing about wrappers)."""
        stored, absent = key_of("counted"), key_of("not-counted")
        self.store(tier, tier_spec, [stored])
        release(tier.get([stored, absent]))
        stats = tier.stats()
        assert stats["wrapped_put_calls"] == 1 and stats["wrapped_get_calls"] == 1
        assert stats["wrapped_get_keys"] == 2 and stats["wrapped_get_hits"] == 1


class TestRateLimitAroundCountingAroundDisk(_AroundDisk):
    @pytest.fixture
    def tier_spec(self, tmp_path):
        return _around_disk(tmp_path, "rate_limit", TierSpec("counting", inner=TierSpec("disk")),
                            bytes_per_second="8GiB")


@pytest.fixture(scope="module")
def wrapped_redis(tmp_path_factory):
    """A server of this module's own: the fault tests kill and pause it."""
    require_redis()
    s = RedisServer(tmp_path_factory.mktemp("contract-wrapped-redis")).start()
    yield s
    s.stop()


@pytest.mark.integration
class TestCountingAroundKeyedRedis(TierContract):
    @pytest.fixture
    def tier_spec(self, wrapped_redis):
        return TierSpec(
            "counting", kwargs={"tier": wrapped_redis.url},
            config=lambda: {"remote_key_prefix": f"w{uuid.uuid4().hex[:10]}",
                            "remote_timeout": 1.0, "integrity_secret": SECRET},
            corrupt=_damage(wrapped_redis, keyed=True),
            kill=lambda tier: wrapped_redis.kill(), revive=lambda tier: wrapped_redis.start(),
            hang=lambda tier: wrapped_redis.pause(), unhang=lambda tier: wrapped_redis.resume(),
            reopen=lambda tier: {"remote_key_prefix": tier.prefix.decode().rstrip(":")},
            other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}])
