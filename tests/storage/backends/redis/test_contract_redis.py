"""The tier contract (:mod:`lmc.testing`, every class) against a real redis-server, with and without
``integrity_secret`` (keyed tags: a damaged value passing every checksum is still refused)."""

import uuid

import pytest

from lmc.storage.serde import HEADER_SIZE, TAG_SIZE, decode_header, encode_header
from lmc.testing import TierContract, TierSpec

from ..conftest import RedisServer, require_redis

pytestmark = pytest.mark.integration
SECRET = "contract-suite-secret-0123456789"


@pytest.fixture(scope="module")
def contract_redis(tmp_path_factory):
    """A server of this module's own: the fault tests kill and pause it."""
    require_redis()
    s = RedisServer(tmp_path_factory.mktemp("contract-redis")).start()
    yield s
    s.stop()


def _damage(server: RedisServer, keyed: bool):
    """One payload bit flipped; keyed, the header's checksums are recomputed for the new
    payload and the old tag kept, so only the tag can tell."""
    def corrupt(tier, key) -> None:
        with server.client() as c:
            rk = tier.remote_key(key)
            value = bytearray(c.get(rk))
            head = HEADER_SIZE + (TAG_SIZE if keyed else 0)
            value[head + 100] ^= 0x10
            if keyed:
                h = decode_header(value, tagged=True)
                payload = bytes(value[head:])
                value[:HEADER_SIZE] = encode_header(key, h.shape, h.dtype, h.num_tokens,
                                                    payload, tagged=True)
            c.set(rk, bytes(value))
    return corrupt


@pytest.fixture(params=["plain", "keyed"])
def tier_spec(request, contract_redis):
    keyed = request.param == "keyed"
    return TierSpec(
        contract_redis.url,
        config=lambda: {"remote_key_prefix": f"c{uuid.uuid4().hex[:10]}", "remote_timeout": 1.0,
                        **({"integrity_secret": SECRET} if keyed else {})},
        corrupt=_damage(contract_redis, keyed),
        kill=lambda tier: contract_redis.kill(), revive=lambda tier: contract_redis.start(),
        hang=lambda tier: contract_redis.pause(), unhang=lambda tier: contract_redis.resume(),
        reopen=lambda tier: {"remote_key_prefix": tier.prefix.decode().rstrip(":")},
        # another engine's key prefix on the same server (Redis has no tokens)
        other_tenants=lambda tier: [{"remote_key_prefix": f"o{uuid.uuid4().hex[:10]}"}])


class TestRedisContract(TierContract):
    """Every contract test, plain and keyed."""
