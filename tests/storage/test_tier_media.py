"""Each tier declares its medium and capabilities; where a hit came from is read from the
declaration, never guessed from config keys (docs/design.md, "The tier kit")."""

from __future__ import annotations

from typing import Any

import pytest

from lmc.config import CacheConfig
from lmc.connectors.core.lookup_service import LookupClientStats
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.chain import chain_media
from lmc.storage.lookup import LookupResult
from lmc.storage.tier import (
    BUILTIN_BACKENDS,
    Medium,
    StorageBackend,
    TierCapabilities,
    backend_factory,
    register_backend,
    tier_capabilities,
    tier_medium,
)
from tests.connectors.vllm.test_vllm_parts import FakeRequest

CS = 256


@pytest.mark.parametrize("name", ["cpu", "disk", "redis", "server", "p2p"])
def test_every_builtin_backend_declares_its_medium_and_capabilities(name):
    assert name in BUILTIN_BACKENDS
    cls = backend_factory(name)
    assert isinstance(cls, type) and issubclass(cls, StorageBackend)
    assert "medium" in vars(cls), f"{cls.__name__} inherits its medium instead of declaring it"
    assert "capabilities" in vars(cls), f"{cls.__name__} does not declare its capabilities"
    assert isinstance(cls.medium, Medium) and isinstance(cls.capabilities, TierCapabilities)


def test_builtin_declarations_say_what_each_tier_is():
    media = {n: tier_medium(backend_factory(n)) for n in ("cpu", "disk", "redis", "server",
                                                           "p2p")}
    assert media == {"cpu": Medium.MEMORY, "disk": Medium.LOCAL_STORAGE,
                     "redis": Medium.REMOTE, "server": Medium.REMOTE, "p2p": Medium.PEER}
    assert tier_capabilities(backend_factory("disk")).layered_reads
    assert tier_capabilities(backend_factory("disk")).durable
    assert not tier_capabilities(backend_factory("cpu")).durable


def test_an_object_declaring_nothing_is_taken_for_remote_never_a_crash():
    class Duck:
        medium = "tape"  # not a medium: lying declarations claim nothing

    assert tier_medium(object()) is Medium.REMOTE
    assert tier_medium(Duck()) is Medium.REMOTE
    assert tier_capabilities(Duck()) == TierCapabilities()


@register_backend("test-media-local", schemes=("testmedia",))
class _LocalByUrl(StorageBackend):
    """A tier reached by URL that keeps its values on this host: the config's ``remote_url``
    names it, yet its hits are local storage because it says so."""

    medium = Medium.LOCAL_STORAGE

    def __init__(self, spec: str = "", **_: Any) -> None:
        pass

    def contains(self, keys):
        return [False] * len(keys)

    def get(self, keys):
        return [None] * len(keys)

    def put(self, keys, objs):
        return 0

    def delete(self, keys):
        return 0


def test_chain_media_reads_the_declaration_not_the_config_keys(tmp_path):
    cfg = CacheConfig(chunk_size=CS, local_cpu_size="1MiB", local_disk=str(tmp_path),
                      remote_url="testmedia://anywhere")
    assert chain_media(cfg) == {"cpu": Medium.MEMORY, "disk": Medium.LOCAL_STORAGE,
                                "test-media-local": Medium.LOCAL_STORAGE}
    assert chain_media(CacheConfig(chunk_size=CS, remote_url="lmc://127.0.0.1:1")) == {
        "cpu": Medium.MEMORY, "server": Medium.REMOTE}


# ------------------------------------------------------------------- vLLM's hit sources
class _Client:
    """Answers every chunk present, chunk ``i`` in tier ``sources[i]`` (or unattributed)."""

    def __init__(self, tiers: tuple[str, ...], sources: tuple[int, ...]) -> None:
        self.tiers, self.sources = tiers, sources
        self.stats = LookupClientStats()

    def lookup(self, tokens):
        hit = min(len(self.sources) * CS, len(tokens))
        return LookupResult(hit, CS, self.tiers, self.sources)

    def close(self) -> None:
        pass


def _admitted(tiers: tuple[str, ...], sources: tuple[int, ...], n_chunks: int):
    side = SchedulerSide(ConnectorConfig(chunk_size=CS), _Client(tiers, sources))
    req = FakeRequest("r", list(range(3, 3 + n_chunks * CS + 1)))
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, n)
    return side, req, n


def test_hit_media_follow_each_tiers_declaration():
    """A chain with a tier of each medium: every chunk's tokens are counted under the
    medium its tier's class declares."""
    names = ("cpu", "disk", "p2p", "redis")
    media = {n: tier_medium(backend_factory(n)) for n in names}
    side, req, n = _admitted(names, (0, 1, 1, 2, 3, 3, 3), 7)
    assert n == 7 * CS
    assert side.hit_media(req, n, media) == {Medium.MEMORY: CS, Medium.LOCAL_STORAGE: 2 * CS,
                                             Medium.PEER: CS, Medium.REMOTE: 3 * CS}


def test_hit_media_of_a_tier_declared_local_behind_a_url():
    media = {"cpu": Medium.MEMORY, "test-media-local": Medium.LOCAL_STORAGE}
    side, req, n = _admitted(("cpu", "test-media-local"), (0, 1, 1), 3)
    assert side.hit_media(req, n, media) == {Medium.MEMORY: CS, Medium.LOCAL_STORAGE: 2 * CS}


def test_unattributed_hits_go_to_the_one_lower_medium_or_to_unknown():
    side, req, n = _admitted(("cpu", "disk"), (), 0)
    assert side.hit_media(req, 100, {"cpu": Medium.MEMORY, "disk": Medium.LOCAL_STORAGE}) == {
        Medium.LOCAL_STORAGE: 100}
    mixed = {"cpu": Medium.MEMORY, "disk": Medium.LOCAL_STORAGE, "redis": Medium.REMOTE}
    assert side.hit_media(req, 100, mixed) == {None: 100}
    assert side.hit_media(req, 0, mixed) == {}


def test_a_tier_missing_from_the_declarations_is_unknown():
    side, req, n = _admitted(("cpu", "mystery"), (0, 1), 2)
    assert side.hit_media(req, n, {"cpu": Medium.MEMORY}) == {Medium.MEMORY: CS, None: CS}


_VLLM_SCRIPT = """
import json, types
from lmc.config import CacheConfig
from lmc.connectors.vllm import LMCConnector
from lmc.storage.tier import Medium
c = object.__new__(LMCConnector)
c._media = None
c.settings = types.SimpleNamespace(cache=CacheConfig(tiers=[
    "memory", {"backend": "disk", "path": "/nonexistent"}, "p2p+lmc://127.0.0.1:9",
    "redis://127.0.0.1:9"]))
seen = {}
class Side:
    def hit_media(self, request, n, media):
        seen.update({k: v.value for k, v in media.items()})
        return {Medium.MEMORY: 10, Medium.LOCAL_STORAGE: 5, Medium.PEER: 3,
                Medium.REMOTE: 1, None: 2}
c._scheduler = Side()
out = c.get_external_cache_hit_sources(object(), 21)
print(json.dumps({"media": seen, "sources": {k.value: v for k, v in out.items()}}))
"""


@pytest.mark.integration
def test_vllm_connector_maps_each_declared_medium_to_its_hit_source():
    """The connector itself, in the vLLM venv: the chain's declarations (read from the
    config's tiers, nothing built) become vLLM's HOST / DISK / P2P / EXTERNAL sources."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.requirements import missing

    py = os.environ.get("LMC_VLLM_PYTHON") or "/work/venv-vllm/bin/python"
    if not Path(py).exists():
        missing(f"no vLLM environment ({py}): set LMC_VLLM_PYTHON")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([py, "-c", _VLLM_SCRIPT], capture_output=True, text=True,
                         timeout=240, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    if run.returncode and "No module named 'vllm'" in run.stderr:
        missing(f"{py} cannot import vllm")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["media"] == {"cpu": "memory", "disk": "local_storage", "p2p": "peer",
                            "redis": "remote"}
    assert got["sources"] == {"host": 10, "disk": 5, "p2p": 3, "external_unspecified": 3}
