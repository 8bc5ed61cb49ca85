"""Deterministic token-id prompts for the reference-engine tests."""

from __future__ import annotations

import random


def random_prompt(seed: int, length: int, vocab: int = 2048) -> list[int]:
    """Token-id prompt starting with BOS (0), avoiding the EOS id (1)."""
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, vocab) for _ in range(length - 1)]
