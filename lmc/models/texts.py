"""Fixed texts shipped with lmc, written for it, for measurements that must mean the same on
every machine. ``harbour`` (a harbour town's history, 574 words, 667 SmolLM2 tokens): a
perplexity on it tells a correct port of a model from a broken one (SmolLM2-135M: 15.7 with
the q/k rows restored, 209 without), and a lossy KV feature's perplexity change is measured
on it. ``workshop`` (a village bicycle workshop, 530 words, 640 tokens, dates and numbers to
ask about): with ``harbour``, the document of the document-QA prompts."""

from __future__ import annotations

from importlib import resources

BUNDLED_TEXTS = ("harbour", "workshop")


def bundled_text(name: str = "harbour") -> str:
    """The text called ``name`` (one of ``BUNDLED_TEXTS``)."""
    if name not in BUNDLED_TEXTS:
        raise ValueError(f"no bundled text {name!r}; known: {', '.join(BUNDLED_TEXTS)}")
    return (resources.files("lmc.models") / "data" / f"{name}.txt").read_text(encoding="utf-8")
