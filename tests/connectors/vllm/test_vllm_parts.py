"""The vLLM connector's vLLM-free parts: settings, the scheduler half on fake vLLM objects,
layout decisions. (Against real vLLM: ``test_vllm_integration.py``.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lmc.connectors.core.lookup_service import LookupClientStats
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.vllm.extra_config import load_settings, per_rank_disks
from lmc.connectors.vllm.layout import (
    UnsupportedLayout,
    check_cache_dtype,
    check_version,
    layer_order,
    resolve_gpu,
)
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.lookup import LookupResult

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------- settings
def test_each_rank_gets_its_own_disk_directory_in_any_chain(tmp_path):
    """Two TP ranks sharing one disk directory: the second cannot take the directory's lock
    and its worker fails to start. Shorthand and ``tiers:`` entries (wrapped too) move."""
    from lmc.config import CacheConfig

    d = str(tmp_path / "d")
    short = per_rank_disks(CacheConfig(local_disk=d), 1, 2)
    assert short.local_disk == str(tmp_path / "d" / "tp1of2")
    chain = CacheConfig(tiers=["memory", {"wrap": "counting", "tier": {"backend": "disk",
                                                                        "path": d}},
                               {"backend": "disk", "path": d + "2"}, "lmc://127.0.0.1:1"])
    paths = [e.inner.options["path"] if e.inner else e.options.get("path")
             for e in per_rank_disks(chain, 0, 4).tiers]
    assert paths == [None, str(tmp_path / "d" / "tp0of4"), str(tmp_path / "d2" / "tp0of4"), None]
    assert per_rank_disks(chain, 0, 1) is chain


def test_shipped_yaml_loads():
    s = load_settings({"lmc.config_file": str(ROOT / "configs" / "vllm.yaml")}, environ={})
    assert s.cache.chunk_size == 256 and s.cache.local_disk
    assert s.vllm.lookup_timeout == 1.0 and s.vllm.layerwise


def test_precedence_yaml_env_extra(tmp_path):
    f = tmp_path / "l.yaml"
    f.write_text("chunk_size: 128\ntenant: a\nlocal_cpu_size: 1GiB\n"
                 "vllm:\n  lookup_timeout: 3\n  save_decode: true\n")
    s = load_settings({"lmc.config_file": str(f), "lmc.tenant": "c",
                       "lmc.vllm.lookup_timeout": "0.5", "other.key": 1},
                      environ={"LMC_TENANT": "b", "LMC_CHUNK_SIZE": "64"})
    assert s.cache.chunk_size == 64          # env beats YAML
    assert s.cache.tenant == "c"             # extra config beats env
    assert s.cache.local_cpu_size == 2**30   # YAML beats default
    assert s.vllm.lookup_timeout == 0.5 and s.vllm.save_decode is True


@pytest.mark.parametrize("extra,needle", [
    ({"lmc.chunk_sise": 1}, "'lmc.chunk_sise'.*did you mean 'lmc.chunk_size'"),
    ({"lmc.vllm.lookup_timout": 1}, "lookup_timout"),
    ({"lmc.vllm.lookup_timeout": 0}, "vllm.lookup_timeout: must be >= 0.001"),
    ({"lmc.vllm.layerwise": "sometimes"}, "vllm.layerwise: expected true/false"),
])
def test_bad_keys_and_values_are_named(extra, needle):
    with pytest.raises(ValueError, match=needle):
        load_settings(extra, environ={})


def test_unknown_yaml_keys_name_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("vllm:\n  lookup_dirr: /x\n")
    with pytest.raises(ValueError, match=r"lookup_dirr.*bad\.yaml"):
        load_settings({"lmc.config_file": str(f)}, environ={})


# ------------------------------------------------------------- scheduler on fake vLLM
@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    prompt_embeds: Any = None
    output: list[int] = field(default_factory=list)
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Output:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


class FakeClient:
    """Answers ``hit`` tokens, the first ``l1`` of them (whole chunks) in L1."""

    def __init__(self, hit: int = 0, l1: int = 0) -> None:
        self.hit, self.l1, self.calls = hit, l1, 0
        self.tags: list[bytes | None] = []  # the key tag of each lookup
        self.stats = LookupClientStats()

    def lookup(self, tokens, tag=None):
        self.calls += 1
        self.tags.append(tag)
        hit = min(self.hit, len(tokens))
        chunks = -(-hit // 256)
        sources = [0 if i * 256 < self.l1 else 1 for i in range(chunks)]
        return LookupResult(hit, 256, ("cpu", "disk"), tuple(sources))

    def close(self) -> None:
        pass


def side(hit: int = 0, l1: int = 0, **cfg: Any) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig(chunk_size=256, **cfg), FakeClient(hit, l1))


BS = 128  # vLLM's block size


def blocks(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BS)))


def test_hit_is_loaded_then_rest_saved():
    s = side(hit=700, l1=256)
    req = FakeRequest("r", list(range(2, 702)))  # 700 tokens, all stored
    n, is_async = s.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (699, False)  # the last token is computed by vLLM
    s.update_state_after_alloc(req, 699)
    assert s.hit_sources(req, 699) == (256, 443)
    so = Output([NewReq("r", (blocks(1, 700),), 699)], num_scheduled_tokens={"r": 1})
    meta = s.build_meta(so)
    (load,) = meta.loads
    assert (load.start, load.end, load.block_ids) == (0, 699, tuple(blocks(1, 700)))
    # the step completes the prompt's partial chunk: planned (statelessly), and skipped by
    # the worker because the load just put it in L1
    assert [(sv.start, sv.end) for sv in meta.saves] == [(512, 700)]


def test_chunked_prefill_saves_each_chunk_once():
    s = side()
    req = FakeRequest("r", list(range(2, 1302)))  # 1300 tokens, nothing stored
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, 0)
    step1 = s.build_meta(Output([NewReq("r", (blocks(1, 512),), 0)],
                                num_scheduled_tokens={"r": 512}))
    assert [(sv.start, sv.end) for sv in step1.saves] == [(0, 512)]
    step2 = s.build_meta(Output(scheduled_cached_reqs=Cached(
        ["r"], set(), [(blocks(5, 512),)], [512]), num_scheduled_tokens={"r": 512}))
    (sv,) = step2.saves
    assert (sv.start, sv.end) == (512, 1024)
    assert sv.block_ids == tuple(blocks(1, 1024))  # appended
    step3 = s.build_meta(Output(scheduled_cached_reqs=Cached(
        ["r"], set(), [(blocks(9, 276),)], [1024]), num_scheduled_tokens={"r": 276}))
    assert [(sv.start, sv.end) for sv in step3.saves] == [(1024, 1300)]  # partial tail
    decode = s.build_meta(Output(scheduled_cached_reqs=Cached(["r"], set(), [None], [1300]),
                                 num_scheduled_tokens={"r": 1}))
    assert not decode.saves


def test_resumed_request_gets_its_new_block_table():
    s = side()
    req = FakeRequest("r", list(range(2, 302)))
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, 0)
    s.build_meta(Output([NewReq("r", ([1, 2, 3],), 0)], num_scheduled_tokens={"r": 100}))
    meta = s.build_meta(Output(scheduled_cached_reqs=Cached(["r"], {"r"}, [([7, 8, 9],)], [0]),
                               num_scheduled_tokens={"r": 300}))
    assert meta.saves[0].block_ids == (7, 8, 9)


def test_uncacheable_requests_are_left_alone():
    s = side(hit=512)
    for req in (FakeRequest("mm", [0] * 600, mm_features=["image"]),
                FakeRequest("embeds", [0] * 600, prompt_embeds=[[0.0]]),
                # a LoRA request lmc cannot name (no adapter name): not keyable
                FakeRequest("lora", [0] * 600, lora_request=object())):
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, 0)
    meta = s.build_meta(Output([NewReq("mm", ([1, 2, 3, 4, 5],), 0)],
                               num_scheduled_tokens={"mm": 600}))
    assert meta.is_empty and s.client.calls == 0


def test_salted_and_lora_requests_carry_their_tag_everywhere():
    """Looked up, loaded and saved in their own chains (tests/connectors/vllm/
    test_vllm_tagged.py runs them against a real engine)."""
    from lmc.token_database import request_tag

    @dataclass
    class LoRA:
        lora_name: str

    s = side(hit=512)
    salted = FakeRequest("s", list(range(2, 702)), cache_salt="tenant-a")
    lora = FakeRequest("l", list(range(2, 702)), lora_request=LoRA("x"), cache_salt="t")
    for req in (salted, lora):
        assert s.get_num_new_matched_tokens(req, 0) == (512, False)
        s.update_state_after_alloc(req, 512)
    assert s.client.tags == [request_tag(None, "tenant-a"), request_tag("x", "t")]
    meta = s.build_meta(Output([NewReq("s", (blocks(1, 700),), 512),
                                NewReq("l", (blocks(9, 700),), 512)],
                               num_scheduled_tokens={"s": 188, "l": 188}))
    tags = {ld.request_id: ld.key_tag for ld in meta.loads}
    assert tags == {"s": request_tag(None, "tenant-a"), "l": request_tag("x", "t")}
    assert {sv.request_id: sv.key_tag for sv in meta.saves} == tags
    for req in (salted, lora):
        s.request_finished(req)
    assert not s._tags  # nothing kept past the request


def test_roles():
    producer = side(hit=512, load=False)
    req = FakeRequest("r", list(range(600)))
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    consumer = side(hit=0, save=False)
    consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, 0)
    meta = consumer.build_meta(Output([NewReq("r", (blocks(1, 600),), 0)],
                                      num_scheduled_tokens={"r": 600}))
    assert not meta.saves


def test_local_prefix_hit_is_the_load_start():
    s = side(hit=768)
    req = FakeRequest("r", list(range(900)))
    n, _ = s.get_num_new_matched_tokens(req, 256)  # vLLM's own cache has 256
    assert n == 512
    s.update_state_after_alloc(req, n)
    meta = s.build_meta(Output([NewReq("r", (blocks(1, 900),), 768)],
                               num_scheduled_tokens={"r": 132}))
    assert (meta.loads[0].start, meta.loads[0].end, meta.loads[0].mask_start) == (256, 768, 256)


def test_finished_and_aborted_requests_are_forgotten():
    s = side(hit=512)
    a, b = FakeRequest("a", list(range(600))), FakeRequest("b", list(range(1, 601)))
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(a, 512)
    s.request_finished(a)  # finished before its step
    s.request_finished(b)  # aborted while waiting
    assert s.core.num_tracked_requests == 0 and len(s.tracker) == 0
    meta = s.build_meta(Output([NewReq("a", ([1, 2, 3, 4, 5],), 512)],
                               num_scheduled_tokens={"a": 88}))
    assert meta.is_empty


# -------------------------------------------------------------------------- layouts
def test_layer_order_is_numeric():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def test_quantized_kv_refused():
    check_cache_dtype("auto")
    with pytest.raises(UnsupportedLayout, match="fp8_e4m3.*scales"):
        check_cache_dtype("fp8_e4m3")


def test_untested_version_refused_unless_allowed():
    check_version("0.32.0", False)
    with pytest.raises(UnsupportedLayout, match="vLLM 0.33.1.*allow_untested"):
        check_version("0.33.1", False)
    check_version("0.33.1", True)


def _vllm_views(order: str, B=8, H=2, N=16, C=128, L=2) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer laid out in vLLM's ``order`` (L B H N C
    letters, outermost first), as vLLM 0.32's create_kv_cache_views makes them."""
    size = dict(L=L, B=B, H=H, N=N, C=C)
    stride, acc = {}, 1
    for ax in reversed(order):
        stride[ax], acc = acc, acc * size[ax]
    view = torch.zeros(acc).as_strided([size[a] for a in "LBHNC"], [stride[a] for a in "LBHNC"])
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(L)}


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_gpu_backends_map_to_vllm_gpu_in_every_layout(backend, order):
    kv = _vllm_views(order)
    choice = resolve_gpu(kv, backend, allow_untested=False, kv_cache_layout=order,
                         head_size=64)
    spec = choice.spec()
    assert (choice.layout, spec.num_kv_heads, spec.block_size, spec.head_size) == \
        ("vllm_gpu", 2, 16, 64)


@pytest.mark.parametrize(("legacy", "name", "other"), [("NHD", "LBNHC", "LBHNC"),
                                                         ("HND", "LBHNC", "LBNHC")])
def test_legacy_layout_names_are_aliases(legacy, name, other):
    """vLLM still accepts NHD/HND: each means exactly one modern name, so the same cache
    resolves to the same spec under either, and a cache laid out the other way is refused."""
    kv = _vllm_views(name)
    old = resolve_gpu(kv, "FLASH_ATTN", False, kv_cache_layout=legacy)
    new = resolve_gpu(kv, "FLASH_ATTN", False, kv_cache_layout=name)
    assert (old.layout, old.spec()) == (new.layout, new.spec())
    with pytest.raises(UnsupportedLayout, match=f"resolved KV cache layout {legacy} "):
        resolve_gpu(_vllm_views(other), "FLASH_ATTN", False, kv_cache_layout=legacy)


def test_layout_name_disagreeing_with_strides_is_refused():
    with pytest.raises(UnsupportedLayout, match="resolved KV cache layout HND.*strides"):
        resolve_gpu(_vllm_views("LBNHC"), "FLASHINFER", False, kv_cache_layout="HND")


def test_padded_or_scaled_content_is_refused():
    with pytest.raises(UnsupportedLayout, match="C = 136, not 2 \\* head_size 64"):
        resolve_gpu(_vllm_views("LBNHC", C=136), "FLASH_ATTN", False, head_size=64)


def test_other_backends_refused_by_name():
    with pytest.raises(UnsupportedLayout, match="attention backend FLEX_ATTENTION with this cache is not one"):
        resolve_gpu(_vllm_views("LBNHC"), "FLEX_ATTENTION", allow_untested=True)


def test_flashmla_maps_to_vllm_mla():
    kv = _vllm_views("BLHNC", H=1, C=576)
    choice = resolve_gpu(kv, "FLASHMLA", allow_untested=False, kv_cache_layout="BLHNC")
    spec = choice.spec()
    assert (choice.layout, spec.block_size, spec.head_size, spec.num_layers) == \
        ("vllm_mla", 16, 576, 2)
    assert choice.tensors[1].data_ptr() == kv["model.layers.1.self_attn.attn"].data_ptr()


def test_earlier_flash_layouts_map_by_shape_only_when_allowed():
    buf = torch.zeros(2, 2, 8, 16, 2, 64)
    kv = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}
    assert resolve_gpu(kv, "FLASH_ATTN", True).layout == "vllm_flash"
    with pytest.raises(UnsupportedLayout, match="allow_untested"):
        resolve_gpu(kv, "FLASH_ATTN", False)
    buf = torch.zeros(2, 8, 2, 16, 2, 64)
    kv = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}
    assert resolve_gpu(kv, "FLASHINFER", True).layout == "vllm_flashinfer"


def test_shared_kv_layers_refused():
    t = torch.zeros(8, 1, 16, 576)
    with pytest.raises(UnsupportedLayout, match="share one KV cache"):
        resolve_gpu({"model.layers.0.attn": t, "model.layers.1.attn": t}, "FLASHMLA", True)
