"""Prompts of the vLLM scenarios, shared by the driver scripts and the test (plain token
lists, deterministic): every prompt starts with BOS (0) and never contains EOS (1)."""

from __future__ import annotations

import random

VOCAB = 2048
MAX_TOKENS = 8  # generated per request, greedy, EOS ignored


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, VOCAB) for _ in range(n - 1)]


def prompt_set(tag: str, base: int) -> dict[str, list[int]]:
    """One scenario set; ``base`` separates the sets' seeds so that no set hits another's
    KV by accident."""
    a = tokens(base + 1, 700)
    long = tokens(base + 2, 1500)
    x = tokens(base + 3, 520)
    def tail(seed: int, n: int) -> list[int]:
        return tokens(base + seed, n + 1)[1:]
    return {
        f"{tag}_A": a,                                   # stored first
        f"{tag}_B": a[:600] + tail(10, 60),              # shares 600 tokens with A
        f"{tag}_L": long,                                # > max_num_batched_tokens: chunked
        f"{tag}_L2": long[:1400] + tail(11, 100),        # loads 1280, then chunked prefill
        f"{tag}_C1": a[:650] + tail(12, 40),             # concurrent, partial overlaps
        f"{tag}_C2": a[:300] + tail(13, 80),
        f"{tag}_C3": tokens(base + 14, 500),
        f"{tag}_C4": x + tail(15, 50),                   # C4/C5 share a prefix, neither stored
        f"{tag}_C5": x + tail(16, 70),
        f"{tag}_E": tokens(base + 4, 1500),              # aborted mid-prefill, then rerun
        f"{tag}_F": tokens(base + 5, 800),               # its stored chunks get corrupted
    }


MP0 = prompt_set("m0", 0)
MP1 = prompt_set("m1", 1000)
SERVER = {"srv_B2": MP0["m0_A"][:610] + tokens(2001, 31)[1:]}  # disk hit through the server
ALL = {**MP0, **MP1, **SERVER}

# Run with a KV cache of 10 blocks of 128: two 640-token prompts fill it, and their decodes
# need an 11th block, so vLLM preempts (and later resumes) one of them.
PREEMPT = {"pre_1": tokens(50, 640), "pre_2": tokens(51, 300) + tokens(50, 640)[1:341],
           "pre_3": tokens(52, 640)}
PREEMPT_MAX_TOKENS = 40
