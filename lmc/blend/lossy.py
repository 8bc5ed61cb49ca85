"""Blending as a lossy KV feature for ``lmc quality``: the KV the reference engine holds for
a prompt after a blended prefill (its segments loaded or computed alone, placed, and the
ratio's most deviating tokens recomputed), read from the engine's blocks right after that
step, so what is judged is exactly what decoding would attend to.

One engine (the blend connector, forced on, over an lmc L1 big enough for every segment of
the run) serves every setting: the segments are computed alone and stored at the first
sighting and loaded afterwards, as in production.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from lmc.blend.setting import BlendRatios
from lmc.connectors.reference.blend import BlendConnector, BlendSettings
from lmc.quality.feature import LossyKVFeature, ModelUnderTest, PromptKV
from lmc.reference.engine import LLM
from lmc.reference.request import SamplingParams


class BlendFeature(BlendRatios, LossyKVFeature):
    summary: ClassVar[str] = ("segments reused anywhere in a prompt, the setting's ratio of "
                              "their tokens recomputed")
    default_settings: ClassVar[tuple[str, ...]] = ("0.15", "0.3", "0.5", "0.7", "0.85")

    def __init__(self) -> None:
        self.llm: LLM | None = None
        self.connector: BlendConnector | None = None

    def open(self, model: ModelUnderTest) -> None:
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim \
            * torch.empty((), dtype=model.dtype).element_size()
        quiet = logging.getLogger("lmc.connectors.reference.blend")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # forced on for the measurement: not news to the user
        try:
            self.connector = BlendConnector(
                {"chunk_size": model.chunk_size, "local_cpu_size": max(256 << 20,
                                                                        64 * 1024 * per_token)},
                model_dir=model.model_dir, blend=BlendSettings(override=True))
            engine: dict[str, Any] = dict(
                dtype=model.dtype, device=model.device, max_num_seqs=1,
                max_num_batched_tokens=model.max_len, max_model_len=model.max_len + 2,
                kv_cache_memory=(model.max_len + 64) * per_token * 2)
            self.llm = LLM(model.model_dir, kv_connector=self.connector, **engine)
        finally:
            quiet.setLevel(level)

    def served_kv(self, prompt: PromptKV, setting: str) -> torch.Tensor:
        assert self.llm is not None and self.connector is not None, "open() first"
        assert self.connector.blender is not None
        self.connector.blender.ratio = float(setting)
        llm, n = self.llm, len(prompt.ids)
        params = SamplingParams(max_tokens=2, ignore_eos=True)  # alive after its prefill
        rid = llm.add_request(list(prompt.ids), params, segments=list(prompt.spans) or None)
        try:
            while True:
                llm.step()
                request = llm.scheduler.requests.get(rid)
                error = llm.pop_error(rid)
                if error is not None or request is None:
                    raise RuntimeError(f"the blended prefill failed: {error or 'no request'}")
                if request.num_computed_tokens >= n:
                    return _read_kv(llm, request.block_ids, prompt.context_len)
        finally:
            llm.abort_request(rid)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
        self.llm = self.connector = None


def _read_kv(llm: LLM, block_ids: list[int], n: int) -> torch.Tensor:
    """K/V of positions ``[0, n)`` from a request's blocks, ``[layers, 2, n, heads, dim]``,
    in the cache dtype."""
    bs = llm.block_size
    pos = torch.arange(n)
    slots = (torch.as_tensor(block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs)
    slots = slots.to(llm.device)
    out = []
    for kv in llm.kv_caches:
        heads, dim = kv.shape[-2:]
        out.append(torch.stack([kv[i].view(-1, heads, dim).index_select(0, slots)
                                for i in (0, 1)]))
    return torch.stack(out).cpu()
