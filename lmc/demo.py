"""``lmc demo``: the main job, end to end on this machine in about a minute.

The built-in reference engine serves a realistic workload — multi-round chats that share a
long system prompt, then questions about one long document — four times:

1. **no lmc**: the engine alone, every prompt prefilled in full (the cold TTFT);
2. **lmc, cold cache**: lmc on, starting empty (later requests already reuse earlier ones;
   named "first (tiers warm)" when a disk directory kept from an earlier run is not empty);
3. **lmc, warm (L1)**: the same workload again, served from the CPU tier;
4. **lmc, restarted**: a new engine and a new, empty L1 over the same disk directory, so the
   KV comes back from the disk tier (skipped when no disk tier is configured).

It prints TTFT p50/p95 per pass, the share of prompt tokens each tier supplied, the bytes
moved, and whether every pass generated the same tokens (it must: lmc never changes output).

The headline speed-up is TTFT p50 without lmc over TTFT p50 with a warm lmc, measured in
interleaved rounds (each prompt asked of one engine, then the other, so a busy machine slows
both alike) and reported as the median with its range over the rounds. Both engines use the
same pinned thread count (``--threads``) and are warmed up before anything is timed.

Model: by default a random-weight Llama made on first run under the user's cache directory
(hidden 256, 4 layers, 8k positions: big enough that a few-thousand-token prefill costs about
a second on two cores, small enough to make in seconds); ``--sliding-window W`` makes it a
hybrid model (every other layer attends to the last W tokens: lmc stores its KV per group,
:mod:`lmc.hybrid`); ``--model DIR`` runs a real local checkpoint instead. Cache: the values of ``configs/demo.yaml`` with a fresh temporary disk
directory, or ``--config FILE``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmc.cli import int_in, positive_int

DEMO_MODEL: dict[str, Any] = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
                              "vocab": 2048, "max_position_embeddings": 8192, "seed": 0}
DEMO_MODEL_VERSION = 1
DEMO_CONFIG: dict[str, Any] = {"chunk_size": 256, "local_cpu_size": "512MiB",
                               "save_unfull_chunk": True, "local_disk_size": "2GiB",
                               "write_policy": "write_through"}
ENGINE_ARGS: dict[str, Any] = {"block_size": 16, "max_num_batched_tokens": 2048,
                               "max_num_seqs": 8}

_WORDS = ["cache", "key", "value", "token", "prompt", "model", "layer", "block", "engine", "memory", "disk", "server", "request", "reply", "query", "answer", "system", "user", "agent", "document", "chunk", "prefix", "store", "load", "save", "copy", "river", "mountain", "forest", "ocean", "city", "village", "garden", "window", "door", "table", "chair", "book", "letter", "morning", "evening", "night", "winter", "summer", "spring", "rain", "snow", "wind", "storm", "cloud", "light", "red", "green", "blue", "quiet", "small", "large", "old", "new", "fast", "slow", "bright", "dark", "warm", "cold", "teacher", "student", "doctor", "writer", "run", "walk", "read", "write", "build", "open", "close", "carry", "find", "keep", "send", "take", "give", "make", "see", "know", "think", "want", "need", "help", "watch", "call", "ask", "tell", "show", "is", "was", "are", "has", "will", "can", "should", "and", "or", "but", "so", "because", "while", "when", "where", "after", "before", "in", "on", "at", "by", "for", "with", "from", "over", "under", "always", "never", "often", "again", "already", "still", "just", "only", "first", "last", "next", "early", "late"]


# ------------------------------------------------------------------------------ model
def demo_model_dir(progress: Callable[[str], None] | None = None,
                   sliding_window: int | None = None) -> Path:
    """The demo checkpoint (``DEMO_MODEL``), made once under the cache directory;
    ``progress`` hears each step of making it. ``sliding_window``: its hybrid twin (every
    other layer a sliding window of that many tokens)."""
    from lmc.reference.tiny import cached_checkpoint

    name = f"demo-llama-h{DEMO_MODEL['hidden']}-l{DEMO_MODEL['layers']}-v{DEMO_MODEL_VERSION}"
    if sliding_window is None:
        return cached_checkpoint(name, progress=progress, **DEMO_MODEL)
    return cached_checkpoint(f"{name}-swa{sliding_window}", progress=progress,
                             sliding_window=sliding_window, **DEMO_MODEL)


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """Sizes in tokens (approximate: text is generated until it encodes to at least this)."""

    system_tokens: int = 2000
    sessions: int = 3
    rounds: int = 3
    turn_tokens: int = 60
    doc_tokens: int = 3500
    questions: int = 3
    max_tokens: int = 16
    seed: int = 0

    @classmethod
    def quick(cls) -> Workload:
        return cls(system_tokens=600, sessions=2, rounds=2, turn_tokens=30, doc_tokens=900,
                   questions=2, max_tokens=4)

    @property
    def num_requests(self) -> int:
        return self.sessions * self.rounds + self.questions


def _text(rng: random.Random, encode: Callable[[str], list[int]], tokens: int) -> str:
    """Pseudo-English sentences until the text encodes to ``tokens`` tokens or more."""
    parts: list[str] = []
    while True:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        parts.append(" ".join(words).capitalize() + rng.choice(".?!."))
        if len(parts) % 8 == 0 and len(encode(" ".join(parts))) >= tokens:
            return " ".join(parts)


@dataclass
class Texts:
    system: str
    turns: list[list[str]]  # [session][round]
    document: str
    questions: list[str]


def make_texts(w: Workload, encode: Callable[[str], list[int]]) -> Texts:
    rng = random.Random(w.seed)
    return Texts(
        system=_text(rng, encode, w.system_tokens),
        turns=[[_text(rng, encode, w.turn_tokens) for _ in range(w.rounds)]
               for _ in range(w.sessions)],
        document=_text(rng, encode, w.doc_tokens),
        questions=[_text(rng, encode, w.turn_tokens // 2) for _ in range(w.questions)],
    )


# ------------------------------------------------------------------------------ passes
@dataclass
class PassResult:
    name: str
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class Progress:
    """One stderr line per pass, redrawn in place on a terminal (no dependency)."""

    def __init__(self, name: str, total: int, stream: Any = None) -> None:
        self.name, self.total, self.done = name, total, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, ttft: float) -> None:
        self.done += 1
        if self.tty or self.done == self.total:
            width = 24
            fill = width * self.done // self.total
            line = (f"  {self.name:<28} [{'#' * fill}{'.' * (width - fill)}] "
                    f"{self.done:>3}/{self.total}  last TTFT {ttft * 1000:7.1f} ms")
            end = "\n" if self.done == self.total else ""
            self.stream.write(("\r" if self.tty else "") + line + end)
            self.stream.flush()


def run_pass(llm: Any, texts: Texts, w: Workload, name: str) -> PassResult:
    """Chats round by round (each round's prompt carries the history, answers included),
    then the document questions; one request at a time, so TTFT is the request's own."""
    res = PassResult(name)
    sys.stdout.flush()
    progress = Progress(name, w.num_requests)
    t0 = time.perf_counter()
    history = [texts.system for _ in range(w.sessions)]

    def ask(prompt: str) -> str:
        out = llm.generate([prompt], max_tokens=w.max_tokens, ignore_eos=True)[0]
        res.ttfts.append(out.ttft_s)
        res.prompt_tokens += len(out.prompt_token_ids)
        res.outputs.append(out.token_ids)
        progress.advance(out.ttft_s)
        return out.text

    for r in range(w.rounds):
        for s in range(w.sessions):
            history[s] += f"\nUser: {texts.turns[s][r]}\nAssistant:"
            history[s] += " " + ask(history[s]).strip()
    for q in texts.questions:
        ask(f"{texts.document}\n\nQuestion: {q}\nAnswer:")
    res.seconds = time.perf_counter() - t0
    return res


FIRST_PASS_COLD = "lmc, cold cache"
FIRST_PASS_WARM = "lmc, first (tiers warm)"  # a disk directory or remote store used before


def held_before(lower: Any) -> str:
    """What the tiers below L1 hold already, as ``"disk 120 chunks"``, or ``""``: a disk
    directory kept between runs (``--config`` with ``local_disk``) makes the "cold" pass warm.
    Tiers that cannot count what they hold (a remote store) are left out."""
    parts = []
    for t in lower:
        try:
            n = len(t)
        except TypeError:
            continue
        if n:
            parts.append(f"{t.name} {n:,} chunks")
    return ", ".join(parts)


def all_counted(lower: Any) -> bool:
    """Whether every tier below L1 can say how many chunks it holds."""
    return all(hasattr(t, "__len__") for t in lower)


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


# ------------------------------------------------------------------------------- table
def _pct(q: float, xs: list[float]) -> float:
    """Percentile with linear interpolation between the two nearest samples."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def format_table(results: list[PassResult], tiers: list[str]) -> str:
    mib = 1 << 20
    head = (f"{'pass':<28}{'TTFT p50':>10}{'TTFT p95':>10}{'prompt tok':>12}"
            + "".join(f"{'from ' + t:>11}" for t in tiers)
            + f"{'computed':>10}{'KV loaded':>11}{'KV saved':>10}{'disk I/O':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        s, n = r.stats, max(1, r.prompt_tokens)
        from_tier = [s.get(f"worker.tokens_from_{t}", 0) for t in tiers]
        computed = n - sum(from_tier)
        disk = s.get("cache.disk.read_bytes", 0) + s.get("cache.disk.write_bytes", 0)
        lines.append(
            f"{r.name:<28}{_pct(.5, r.ttfts) * 1e3:>8.1f}ms{_pct(.95, r.ttfts) * 1e3:>8.1f}ms"
            f"{r.prompt_tokens:>12,}" + "".join(f"{x / n:>11.1%}" for x in from_tier)
            + f"{computed / n:>10.1%}"
            + f"{s.get('cache.retrieve_bytes', 0) / mib:>8.1f}MiB"
            + f"{s.get('cache.store_bytes', 0) / mib:>7.1f}MiB{disk / mib:>7.1f}MiB")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- headline
@dataclass
class Headline:
    """The demo's one number: TTFT p50 with no lmc over TTFT p50 served from lmc's CPU tier,
    per interleaved round (each request run on both engines back to back, so both see the
    same machine load), summarised as the median and range over rounds."""

    ratios: list[float]
    base_p50s: list[float]
    warm_p50s: list[float]

    @property
    def median(self) -> float:
        return _pct(.5, self.ratios)

    def line(self) -> str:
        lo, hi = min(self.ratios), max(self.ratios)
        return (f"speed-up: {self.median:.1f}x median TTFT p50 over {len(self.ratios)} "
                f"interleaved round(s) (range {lo:.1f}x-{hi:.1f}x; no lmc "
                f"{_pct(.5, self.base_p50s) * 1e3:.0f} ms, warm L1 "
                f"{_pct(.5, self.warm_p50s) * 1e3:.1f} ms)")

    MEANING = ("meaning: how many times sooner the first token arrives when lmc supplies a "
               "prompt's KV from CPU memory instead of the engine prefilling it; same prompts, "
               "same outputs.")


def interleaved_rounds(base: Any, cached: Any, texts: Texts, w: Workload, rounds: int
                       ) -> Headline:
    """``rounds`` repeats of the workload, each request asked of ``base`` (no lmc) and then
    of ``cached`` (lmc, warm) before the next request, so noise hits both alike."""
    head = Headline([], [], [])
    for r in range(rounds):
        a, b = _paired_round(base, cached, texts, w, f"interleaved round {r + 1}/{rounds}")
        head.base_p50s.append(_pct(.5, a))
        head.warm_p50s.append(_pct(.5, b))
        head.ratios.append(head.base_p50s[-1] / head.warm_p50s[-1])
    return head


def _paired_round(base: Any, cached: Any, texts: Texts, w: Workload, label: str
                  ) -> tuple[list[float], list[float]]:
    """One pass of the workload on both engines, request by request; the TTFTs of each."""
    ttfts: tuple[list[float], list[float]] = ([], [])
    progress = Progress(label, w.num_requests)
    history = [texts.system for _ in range(w.sessions)]

    def ask(prompt: str) -> str:
        outs = [llm.generate([prompt], max_tokens=w.max_tokens, ignore_eos=True)[0]
                for llm in (base, cached)]
        if outs[0].token_ids != outs[1].token_ids:
            raise RuntimeError("lmc changed the generated tokens: this is a bug")
        for t, o in zip(ttfts, outs):
            t.append(o.ttft_s)
        progress.advance(outs[1].ttft_s)
        return outs[0].text

    for rd in range(w.rounds):
        for s in range(w.sessions):
            history[s] += f"\nUser: {texts.turns[s][rd]}\nAssistant:"
            history[s] += " " + ask(history[s]).strip()
    for q in texts.questions:
        ask(f"{texts.document}\n\nQuestion: {q}\nAnswer:")
    return ttfts


def warm_up(llm: Any, w: Workload) -> None:
    """One untimed request on text the workload never uses: the first call's one-time costs
    (allocator growth, kernel selection, lazy imports) stay out of every timed pass."""
    rng = random.Random(w.seed + 1_000_003)
    llm.generate([_text(rng, llm.encode, min(512, w.system_tokens))], max_tokens=2,
                 ignore_eos=True)


def default_threads() -> int:
    """Half the cores (at least one): the engine's GEMMs keep the same thread count from pass
    to pass, and lmc's I/O thread and the rest of the machine keep a core."""
    return max(1, (os.cpu_count() or 2) // 2)


def resolve_model_dir(path: str, given_as: str = "--model ") -> Path:
    """``--model``: the checkpoint directory, or any file in it (``DIR/config.json``).
    ``given_as`` is how the user wrote it (``--target reference:``), for the messages."""
    p = Path(path).expanduser()
    if p.is_file():
        p = p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"{given_as}{path}: no such directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{given_as}{path}: {p} has no config.json (expected a local "
                                "Hugging Face checkpoint directory)")
    return p


# -------------------------------------------------------------------------------- main
def run_demo(model_dir: Path | None = None, config_path: str | None = None,
             workload: Workload | None = None, baseline: bool = True,
             out: Any = None, rounds: int = 3, sliding_window: int | None = None
             ) -> list[PassResult]:
    """Run the passes and print the table and the headline; returns the per-pass results.
    ``sliding_window``: the demo model's hybrid twin (no ``model_dir``)."""
    from lmc.config import CacheConfig
    from lmc.connectors.reference import LMCReferenceConnector
    from lmc.reference import LLM

    out = out or sys.stdout
    w = workload or Workload()
    t_start = time.perf_counter()
    engine_args = dict(ENGINE_ARGS)
    if model_dir is None:
        engine_args["max_model_len"] = DEMO_MODEL["max_position_embeddings"]
        print("model: demo checkpoint " + ", ".join(f"{k}={v}" for k, v in DEMO_MODEL.items())
              + (f", sliding_window={sliding_window} on every other layer"
                 if sliding_window else "")
              + " (random weights; made once, then reused)", file=out, flush=True)
        t0 = time.perf_counter()
        model_dir = demo_model_dir(
            progress=lambda line: print(f"  making the checkpoint: {line}", file=out,
                                        flush=True), sliding_window=sliding_window)
        if time.perf_counter() - t0 > 1:
            print(f"made the demo checkpoint in {time.perf_counter() - t0:.1f} s", file=out)
    print(f"model dir: {model_dir}", file=out)
    cfg = CacheConfig.load(config_path) if config_path else CacheConfig.load(
        overrides=DEMO_CONFIG)
    tmp_disk = None
    if cfg.local_disk is None and config_path is None:
        tmp_disk = tempfile.mkdtemp(prefix="lmc-demo-disk-")
        cfg = cfg.replace(local_disk=tmp_disk)
    print(f"cache: chunk_size={cfg.chunk_size} L1 cpu {cfg.local_cpu_size / (1 << 20):.0f} MiB"
          + (f", disk {cfg.local_disk}" if cfg.local_disk else ", no disk tier")
          + (f", remote {cfg.remote_url}" if cfg.remote_url else ""), file=out)
    import torch

    print(f"engine threads: {torch.get_num_threads()} (torch; --threads)", file=out)
    results: list[PassResult] = []
    tiers: list[str] = []
    head: Headline | None = None
    closing: list[Any] = []
    try:
        first = LLM(model_dir, **engine_args)
        texts = make_texts(w, first.encode)
        longest = len(first.encode(texts.document)) + 2 * w.turn_tokens
        if longest > first.max_model_len:
            raise ValueError(f"the workload needs prompts of ~{longest} tokens, the model takes "
                             f"{first.max_model_len}: try --quick")
        print(f"workload: {w.sessions} chats x {w.rounds} rounds over a "
              f"{len(first.encode(texts.system))}-token system prompt, "
              f"{w.questions} questions on a {len(first.encode(texts.document))}-token "
              f"document; {w.max_tokens} tokens per answer", file=out, flush=True)
        if baseline:
            warm_up(first, w)
            results.append(run_pass(first, texts, w, "no lmc (engine alone)"))

        def lmc_pass(llm: Any, name: str) -> None:
            before = llm.kv_connector.stats()
            res = run_pass(llm, texts, w, name)
            llm.kv_connector.engine.storage.flush(timeout=60)
            res.stats = _delta(llm.kv_connector.stats(), before)
            results.append(res)

        conn = LMCReferenceConnector(cfg, model_dir=model_dir)
        llm = LLM(model_dir, kv_connector=conn, **engine_args)
        closing.append(llm)
        held = held_before(conn.cache.storage.tiers[1:])  # before the warm-up stores anything
        warm_up(llm, w)
        tiers = [t.name for t in conn.cache.storage.tiers]
        if held:
            print(f"lower tiers are not empty ({held}, from an earlier run): the first lmc "
                  "pass starts warm", file=out)
        lmc_pass(llm, FIRST_PASS_WARM if held else FIRST_PASS_COLD)
        first_lower = {t: results[-1].stats.get(f"worker.tokens_from_{t}", 0)
                       for t in tiers[1:]}
        if not held and any(first_lower.values()) and not all_counted(
                conn.cache.storage.tiers[1:]):
            results[-1].name = FIRST_PASS_WARM  # a tier that cannot count held chunks
        lmc_pass(llm, "lmc, warm (L1)")
        if baseline and rounds > 0:
            head = interleaved_rounds(first, llm, texts, w, rounds)
        del first
        llm.close()
        closing.remove(llm)
        if cfg.local_disk:
            conn = LMCReferenceConnector(cfg, model_dir=model_dir)
            llm = LLM(model_dir, kv_connector=conn, **engine_args)
            closing.append(llm)
            warm_up(llm, w)  # the new process's first-call costs are not the disk's
            lmc_pass(llm, "lmc, restarted (disk -> L1)")
            llm.close()
            closing.remove(llm)
        else:
            print("(no disk tier configured: the restart pass is skipped)", file=out)
    finally:
        for llm in closing:  # interrupted or failed: the engine's threads still stop
            llm.close()
        if tmp_disk:
            shutil.rmtree(tmp_disk, ignore_errors=True)
    print(file=out)
    print(format_table(results, tiers), file=out)
    same = all(r.outputs == results[0].outputs for r in results)
    print(f"\ngenerated tokens identical in every pass: {'yes' if same else 'NO'}", file=out)
    if head is not None:
        print(head.line(), file=out)
        print(Headline.MEANING, file=out)
    elif baseline:
        print("speed-up: not measured (--rounds 0)", file=out)
    else:
        print("speed-up: not measured (--no-baseline: no engine-alone pass to compare with)",
              file=out)
    print(f"demo took {time.perf_counter() - t_start:.0f} s", file=out, flush=True)
    if not same:
        raise RuntimeError("lmc changed the generated tokens: this is a bug")
    return results


def _count(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def _cli(args: argparse.Namespace) -> int:
    w = Workload.quick() if args.quick else Workload()
    import torch

    torch.set_num_threads(args.threads or default_threads())
    try:
        model = resolve_model_dir(args.model) if args.model else None
        if model is not None and args.sliding_window:
            raise ValueError("--sliding-window makes the demo model hybrid; a --model "
                             "checkpoint says its own layer kinds (layer_types)")
        run_demo(model, args.config, w, baseline=not args.no_baseline, rounds=args.rounds,
                 sliding_window=args.sliding_window)
    except BrokenPipeError:
        raise  # the reader went away (lmc demo | head): lmc.cli ends quietly
    except (ValueError, OSError) as e:
        print(f"lmc demo: {e}", file=sys.stderr)
        return 2
    return 0


def register_cli(sub: Any) -> None:
    from lmc.cli import add_command

    p = add_command(sub, "demo", "cold vs warm TTFT on the built-in reference engine", __doc__)
    p.add_argument("--model", metavar="DIR",
                   help="local HF checkpoint directory, or its config.json (default: the demo "
                        "model)")
    p.add_argument("--config", metavar="FILE",
                   help="lmc YAML config (default: configs/demo.yaml's values with a "
                        "temporary disk directory)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (seconds)")
    p.add_argument("--sliding-window", type=int_in(16, 1 << 20), default=None, metavar="W",
                   help="a hybrid demo model: every other layer attends to the last W tokens "
                        "(lmc stores its KV per group)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the engine-alone pass (and so the speed-up)")
    p.add_argument("--threads", type=int_in(1, 4096), default=None, metavar="N",
                   help=f"torch threads for both engines (default: half the cores, here "
                        f"{default_threads()}), the same in every pass")
    p.add_argument("--rounds", type=_count, default=3, metavar="N",
                   help="interleaved no-lmc / warm-lmc rounds behind the speed-up "
                        "(default %(default)s; 0 = none)")
    p.set_defaults(func=_cli)
