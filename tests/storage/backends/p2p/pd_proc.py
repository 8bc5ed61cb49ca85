"""A reference-engine instance for the prefill/decode test over the P2P tier:
``python -m tests.storage.backends.p2p.pd_proc ROLE DIRECTORY_URL CHECKPOINT PROMPT_LEN``.

* ``prefill``: generates one token for the prompt (its KV saved through lmc, exported from
  its pool), answers ``ready``, and keeps serving its exports until stdin closes.
* ``decode``: runs the prompt twice: without lmc (the single-instance reference) and with
  the P2P tier, whose lookup finds the prefill instance's chunks and READs them over NIXL.

Answers are JSON lines marked ``@lmc``; ends with ``os._exit`` (NIXL's exit-time crash).
"""

from __future__ import annotations

import json
import os
import sys

from lmc.reference import LLM
from tests.deadlines import HANG_S
from tests.reference.prompts import random_prompt

MAX_TOKENS = 8


def _answer(obj: dict) -> None:
    print("@lmc " + json.dumps(obj), flush=True)


def main(role: str, url: str, ckpt: str, n: int) -> None:
    prompt = random_prompt(7, n)
    # the pull is the subject, not whether pulling beats recomputing: the tiny model
    # recomputes 300 tokens faster than a loaded host's first NIXL read lands, so the auto
    # policy's load watch may stop the read (tests/connectors/reference/
    # test_load_policy_e2e.py tests that choice); and the P2P tier's lookup (a directory
    # round trip) must count however late a loaded host schedules it
    cfg = {"chunk_size": 64, "local_cpu_size": "64MiB", "pin_memory": "false",
           "remote_url": url, "remote_timeout": 5.0, "load_policy": "load_all",
           "lookup_min_wait": HANG_S}
    if role == "decode":
        with LLM(ckpt, num_blocks=64) as ref:
            want = ref.generate([prompt], max_tokens=MAX_TOKENS, ignore_eos=True)[0]
    llm = LLM(ckpt, num_blocks=64, lmc_config=cfg)
    engine = llm.kv_connector.engine
    if role == "prefill":
        out = llm.generate([prompt], max_tokens=1, ignore_eos=True)[0]
        engine.flush(30)
        _answer({"ready": True, "cached": out.num_cached_tokens,
                 "exports": engine.storage.tiers[-1].stats()["exports"]})
        sys.stdin.read()
    else:
        out = llm.generate([prompt], max_tokens=MAX_TOKENS, ignore_eos=True)[0]
        p2p = engine.storage.tiers[-1].stats()
        _answer({"tokens": out.token_ids, "want": want.token_ids,
                 "cached": out.num_cached_tokens, "p2p_hits": p2p["hits"],
                 "p2p_bytes": p2p["bytes_in"]})
    llm.close()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
