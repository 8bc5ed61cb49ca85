"""``lmc demo``: the main job, end to end on this machine in about two minutes.

The built-in reference engine runs a real model -- SmolLM2-135M-Instruct, converted once from
its package (``lmc model get``) -- through chats that share a long system prompt (a bicycle
workshop's notes; two chats of two rounds, each round's prompt carrying the chat so far) and
then questions about one document (a harbour town's history), and prints the model's
answers. It runs them:

1. **lmc, cold cache**: lmc on, starting empty (later requests already reuse earlier ones;
   named "first (tiers warm)" when a disk directory kept from an earlier run is not empty);
2. **no lmc** and **lmc, warm (L1)**: each request asked of the engine alone, then of the
   engine with lmc serving it from the CPU tier, before the next request (interleaved, so a
   busy machine slows both alike);
3. **lmc, restarted**: a new engine and a new, empty L1 over the same disk directory, so the
   KV comes back from the disk tier (skipped when no tier below L1 is configured).

It prints TTFT p50/p95 per pass, the share of prompt tokens each tier supplied and why the
rest was computed, the bytes moved, the answers, and whether every pass generated the same
tokens (it must: lmc never changes output). The headline speed-up is the table's TTFT p50
without lmc over its TTFT p50 with a warm lmc: the same two rows. Every engine uses the same
pinned thread count (``--threads``) and is warmed up before anything is timed.

The real model computes in fp32 (bf16 matmuls are ~8x slower on CPUs without AVX-512 BF16);
its first run converts it (~15 s). Without its package the demo says how to install it, in
one line, and runs the random-weight demo model instead. ``--quick``: that random model
(hidden 256, 4 layers, made in seconds) on a small workload of pseudo-English (its answers
mean nothing; their token ids are still compared); ``--sliding-window W`` makes it a hybrid
model (every other layer attends to the last W tokens: lmc stores its KV per group,
:mod:`lmc.hybrid`). ``--model DIR`` runs a local checkpoint
(chats through its chat template when it has one). Cache: the values of ``configs/demo.yaml``
with a fresh temporary disk directory (removed on every way out), or ``--config FILE``
(checked before any model is loaded).
"""

from lmc.demo.cli import register_cli
from lmc.demo.model import DEMO_MODEL, demo_model_dir, pick_model, resolve_model_dir
from lmc.demo.passes import PassResult
from lmc.demo.report import Headline, format_table
from lmc.demo.run import DEMO_CONFIG, ENGINE_ARGS, default_threads, run_demo
from lmc.demo.script import Workload, real_script

__all__ = [
    "DEMO_CONFIG",
    "DEMO_MODEL",
    "ENGINE_ARGS",
    "Headline",
    "PassResult",
    "Workload",
    "default_threads",
    "demo_model_dir",
    "format_table",
    "pick_model",
    "real_script",
    "register_cli",
    "resolve_model_dir",
    "run_demo",
]
