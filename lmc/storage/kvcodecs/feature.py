"""Codecs as a lossy KV feature of the quality harness (``lmc quality --feature kv-codec``) and
what a codec tier's gate asks (:mod:`lmc.quality.gate`).

A setting names a lossy codec and every parameter that changes what is stored, canonically:
``int4-kivi,group=32``, ``fp8-e4m3``, ``int8,head_size=32`` (a head size only when one is
configured: otherwise the model's own, which the harness and the engine both take). A
lossless stage does not change a single value, so ``int4-kivi+zstd`` is the setting
``int4-kivi,group=32``: one verdict covers both. The harness judges the KV a tier would serve
(:func:`lmc.storage.kvcodecs.serve.served_kv`: each chunk coded on its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from lmc.quality.feature import FeatureSettings, LossyKVFeature, check_setting

if TYPE_CHECKING:
    import torch

    from lmc.quality.feature import ModelUnderTest, PromptKV

FEATURE = "kv-codec"


def canonical_setting(value: Any, head_size: int | None = None) -> str:
    """The setting a codec spec (config's ``codec:``, or a setting string) is judged as;
    ``head_size``: one configured on the tier (else the model's, left out)."""
    from lmc.storage.kvcodecs.stage import parse_stage

    stage = parse_stage(value, "kv-codec setting", head_size)
    if stage.codec is None:
        raise ValueError(f"kv-codec setting {value!r}: a lossless stage alone loses nothing "
                         "(no verdict needed)")
    parts = [stage.codec.name, *(f"{k}={v}" for k, v in sorted(stage.codec.settings().items()))]
    if stage.codec.head_size is not None:  # configured (given here, or in the spec)
        parts.append(f"head_size={stage.codec.head_size}")
    return ",".join(parts)


class CodecSettings(FeatureSettings):
    """What the gate needs: the name and the canonical settings."""

    name: ClassVar[str] = FEATURE

    def parse_setting(self, text: str) -> str:
        check_setting(text)
        return canonical_setting(text)

    def preference(self, setting: str) -> float | None:
        """Bytes stored per byte of bf16 KV (head size 64): the most saving passes first."""
        import torch

        from lmc.storage.kvcodecs.stage import parse_stage

        stage = parse_stage(setting, head_size=64)
        shape = (1, 2, 256, 512)
        return stage.coded_bytes(shape, torch.bfloat16) / (2 * 256 * 512 * 2)


class CodecFeature(CodecSettings, LossyKVFeature):
    """A tier's codec, judged on a model: the KV each chunk's round trip gives back."""

    summary: ClassVar[str] = ("KV stored through a tier's codec (fp8-e4m3, int8, int4-kivi), "
                              "each chunk coded on its own")
    default_settings: ClassVar[tuple[str, ...]] = ("fp8-e4m3", "int8", "int4-kivi",
                                                   "int4-kivi,group=64")

    def __init__(self) -> None:
        self.model: ModelUnderTest | None = None

    def open(self, model: ModelUnderTest) -> None:
        self.model = model

    def served_kv(self, prompt: PromptKV, setting: str) -> torch.Tensor:
        from lmc.storage.kvcodecs.serve import served_kv
        from lmc.storage.kvcodecs.stage import parse_stage

        assert self.model is not None, "open() first"
        stage = parse_stage(setting, head_size=self.model.head_dim)
        return served_kv(prompt.exact_kv, stage, self.model.chunk_size)
