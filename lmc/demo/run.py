"""``run_demo``: the passes in order, then the report.

Order: the lmc config is checked first (keys, tiers, the disk directory, the pool against the
host's memory), then the model is found or converted, then both engines are built and warmed
up; then the cold pass, the interleaved rounds (no lmc and warm L1, request by request), the
restart. A mistake in ``--config`` therefore costs seconds, never a pass. Whatever was
started is stopped and the temporary disk directory removed on every way out: an error,
Ctrl-C, or a reader that went away (``lmc demo | head``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmc.demo import passes, report
from lmc.demo.model import DemoModel, pick_model
from lmc.demo.passes import PassResult
from lmc.demo.script import Script, Workload, random_script, real_script

DEMO_CONFIG: dict[str, Any] = {"chunk_size": 256, "local_cpu_size": "512MiB",
                               "save_unfull_chunk": True, "local_disk_size": "2GiB",
                               "write_policy": "write_through"}
ENGINE_ARGS: dict[str, Any] = {"block_size": 16, "max_num_batched_tokens": 2048,
                               "max_num_seqs": 8}
FIRST_PASS_COLD = "lmc, cold cache"
FIRST_PASS_WARM = "lmc, first (tiers warm)"  # a disk directory or remote store used before
BASELINE_PASS = "no lmc (engine alone)"
WARM_PASS = "lmc, warm (L1)"
TMP_DISK_PREFIX = "lmc-demo-disk-"


def default_threads() -> int:
    """Half the cores (at least one): the engine's GEMMs keep the same thread count from pass
    to pass, and lmc's I/O thread and the rest of the machine keep a core."""
    return max(1, (os.cpu_count() or 2) // 2)


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


class Opened:
    """Engines and connectors the demo started, closed newest first on the way out, each
    even when closing an earlier one raised."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, Callable[[], Any]]] = []

    def add(self, obj: Any, close: Callable[[], Any]) -> Any:
        self.items.append((obj, close))
        return obj

    def drop(self, obj: Any) -> None:
        """Forget ``obj`` (something that now owns it closes it)."""
        self.items = [(o, c) for o, c in self.items if o is not obj]

    def close(self, obj: Any) -> None:
        close = next(c for o, c in self.items if o is obj)
        self.drop(obj)
        close()

    def close_all(self) -> None:
        while self.items:
            _, close = self.items.pop()
            try:
                close()
            except Exception as e:  # the rest still close; the first error is what matters
                print(f"lmc demo: closing: {type(e).__name__}: {e}", file=sys.stderr)


def _script(llm: Any, workload: Workload | None, short: bool) -> Script:
    """The real-text script on a checkpoint with a chat template, random text otherwise."""
    if llm.chat_template is not None and llm.tokenizer is not None:
        return real_script(short)
    return random_script(workload or (Workload.quick() if short else Workload()), llm.encode)


def _describe(script: Script, system: int, doc: int) -> str:
    chats, questions = len(script.chats), len(script.questions)
    what = (f"{chats} chat{'s' if chats > 1 else ''} x {script.rounds} rounds over a "
            f"{system:,}-token system prompt, {questions} question"
            f"{'s' if questions > 1 else ''} on a {doc:,}-token document")
    if script.real_text:
        return (f"script: {what} ({script.document_name}); answers end at the model's "
                f"end of turn or after {script.max_tokens} tokens, greedy")
    return f"workload: {what}; {script.max_tokens} tokens per answer"


def _check_fits(script: Script, llm: Any, system: int, doc: int) -> None:
    turn = max(len(llm.encode(t)) for t in [*(t for c in script.chats for t in c),
                                            *script.questions])
    longest = max(system + script.rounds * (turn + script.max_tokens + 16),
                  doc + turn + 16) + script.max_tokens
    if longest > llm.max_model_len:
        raise ValueError(f"the workload needs prompts of ~{longest} tokens, the model takes "
                         f"{llm.max_model_len}: try --quick")


def _counted(llm: Any, res: PassResult, run: Callable[[], None]) -> None:
    """Run ``run`` and keep the change of ``llm``'s lmc counters over it (its writes to the
    lower tiers drained first) in ``res.stats``."""
    before = llm.kv_connector.stats()
    run()
    llm.kv_connector.engine.flush(timeout=60)
    res.stats = _delta(llm.kv_connector.stats(), before)


def _restart_name(lower: list[str]) -> str:
    return f"lmc, restarted ({' + '.join(lower)} -> L1)"


class Passes:
    """The demo's passes over one model and cache config, in order (:meth:`run`); every
    engine it starts is in ``opened``, for the caller to close on any way out."""

    def __init__(self, model: DemoModel, cfg: Any, say: Callable[[str], None],
                 opened: Opened) -> None:
        self.model, self.cfg, self.say, self.opened = model, cfg, say, opened
        self.args = {**ENGINE_ARGS, **model.engine_args}
        self.results: list[PassResult] = []
        self.tiers: list[str] = []
        self.head: report.Headline | None = None
        self.script: Script | None = None

    def lmc_engine(self) -> Any:
        from lmc.connectors.reference import LMCReferenceConnector
        from lmc.reference import LLM

        conn = LMCReferenceConnector(self.cfg, model_dir=self.model.path)
        self.opened.add(conn, conn.shutdown)
        llm = LLM(self.model.path, kv_connector=conn, **self.args)
        self.opened.drop(conn)  # the engine shuts its connector down
        return self.opened.add(llm, llm.close)

    def run(self, workload: Workload | None, baseline: bool, rounds: int | None,
            short: bool) -> None:
        import torch

        from lmc.reference import LLM

        cfg = self.cfg
        self.say(f"cache: chunk_size={cfg.chunk_size} L1 cpu "
                 f"{cfg.local_cpu_size / (1 << 20):.0f} MiB"
                 + (f", disk {cfg.local_disk}" if cfg.local_disk else "")
                 + (f", remote {cfg.remote_url}" if cfg.remote_url else ""))
        self.say(f"engine threads: {torch.get_num_threads()} (torch; --threads)")
        llm = self.lmc_engine()
        script = self.script = _script(llm, workload, short)
        system, doc = len(llm.encode(script.system)), len(llm.encode(script.document))
        _check_fits(script, llm, system, doc)
        self.say(_describe(script, system, doc))
        storage = llm.kv_connector.cache.storage
        held = held_before(storage.tiers[1:])  # before the warm-up stores anything
        self.tiers = [t.name for t in storage.tiers]
        base = LLM(self.model.path, **self.args) if baseline else None
        warm_tokens = min(128 if script.real_text else 512, system)
        for engine in (base, llm):
            if engine is not None:
                passes.warm_up(engine, warm_tokens)
        cold = self.cold(llm, held, all_counted(storage.tiers[1:]))
        warm = PassResult(WARM_PASS)
        if base is not None:
            base_res = PassResult(BASELINE_PASS)
            self.interleaved(base, llm, base_res, warm,
                             rounds or (1 if script.real_text else 3))
            self.results.append(base_res)
            self.head = report.Headline(base_res, warm)
            del base
        else:
            _counted(llm, warm, lambda: passes.run_script([llm], script, [warm], WARM_PASS))
        self.results += [cold, warm]
        self.opened.close(llm)
        if self.tiers[1:]:
            self.restart(warm_tokens)
        else:
            self.say("(no tier below L1 configured: the restart pass is skipped)")

    def cold(self, llm: Any, held: str, counted: bool) -> PassResult:
        """The first lmc pass: cold, unless the lower tiers held chunks already."""
        assert self.script is not None
        script = self.script
        if held:
            self.say(f"lower tiers are not empty ({held}, from an earlier run): the first "
                     "lmc pass starts warm")
        cold = PassResult(FIRST_PASS_WARM if held else FIRST_PASS_COLD)
        _counted(llm, cold, lambda: passes.run_script([llm], script, [cold], cold.name))
        if not held and not counted and any(
                cold.stats.get(f"worker.tokens_from_{t}", 0) for t in self.tiers[1:]):
            cold.name = FIRST_PASS_WARM  # a tier that cannot count held chunks served it
        return cold

    def interleaved(self, base: Any, llm: Any, base_res: PassResult, warm: PassResult,
                    n: int) -> None:
        """``n`` rounds, each request asked of the engine alone, then of the engine with a
        warm lmc: the table's no-lmc and warm rows, and so the headline."""
        assert self.script is not None
        script = self.script

        def rounds() -> None:
            for k in range(n):
                passes.run_script([base, llm], script, [base_res, warm],
                                  f"no lmc + warm L1, round {k + 1}/{n}")

        _counted(llm, warm, rounds)

    def restart(self, warm_tokens: int) -> None:
        """A new engine and an empty L1 over the same lower tiers."""
        assert self.script is not None
        script = self.script
        llm = self.lmc_engine()
        passes.warm_up(llm, warm_tokens)  # the new engine's first-call costs are not the disk's
        restart = PassResult(_restart_name(self.tiers[1:]))
        _counted(llm, restart, lambda: passes.run_script([llm], script, [restart],
                                                           restart.name))
        self.results.append(restart)
        self.opened.close(llm)


def run_demo(model: DemoModel | Path | None = None, config_path: str | None = None,
             workload: Workload | None = None, baseline: bool = True, out: Any = None,
             rounds: int | None = None, *, quick: bool = False, short: bool = False,
             sliding_window: int | None = None) -> list[PassResult]:
    """Run the passes and print the report; returns the per-pass results. ``model``: a
    checkpoint directory, or None to pick one (:func:`lmc.demo.model.pick_model`, with
    ``quick``: the random demo model); ``workload``: the random-text sizes (a model without
    a chat template); ``short``: the shorter script; ``rounds``: interleaved no-lmc / warm
    rounds (default 1 on the real-text script, 3 on random text); ``sliding_window``: the
    demo model's hybrid twin (no ``model``)."""
    from lmc.connectors.reference import check_config

    out = out or sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    t_start, cpu_start = time.perf_counter(), time.process_time()
    cfg = check_config(config_path if config_path else dict(DEMO_CONFIG))
    if not isinstance(model, DemoModel):
        model = pick_model(model, quick, say, sliding_window)
    say(f"model dir: {model.path}")
    opened, tmp_disk = Opened(), None
    try:
        if cfg.local_disk is None and config_path is None:
            tmp_disk = tempfile.mkdtemp(prefix=TMP_DISK_PREFIX)
            cfg = cfg.replace(local_disk=tmp_disk)
        done = Passes(model, cfg, say, opened)
        done.run(workload, baseline, rounds, short)
    finally:
        try:
            opened.close_all()  # interrupted or failed: the engines' threads still stop
        finally:
            if tmp_disk:
                shutil.rmtree(tmp_disk, ignore_errors=True)
    differ = _report(done, baseline, say)
    say(f"demo took {time.perf_counter() - t_start:.0f} s ({time.process_time() - cpu_start:.0f} "
        "s of CPU time in this process)")
    if differ:
        raise RuntimeError("lmc changed the generated tokens: this is a bug")
    return done.results


def _report(done: Passes, baseline: bool, say: Callable[[str], None]) -> list[str]:
    """Print the table, the computed tokens' causes, the answers and the headline; returns
    where outputs differed (empty: identical everywhere)."""
    results, script = done.results, done.script
    assert script is not None
    say("")
    say(report.format_table(results, done.tiers))
    say("")
    say(report.format_computed(results, done.tiers))
    if script.real_text:
        say("\nanswers (the model's own, greedy; as printed, the same token ids in every "
            "pass):")
        say(report.format_answers(list(passes.turns(script)), results[0], script.max_tokens))
    differ = report.same_outputs(results)
    say(f"\ngenerated tokens identical in every pass: {'yes' if not differ else 'NO'} "
        f"({len(results)} passes, {sum(r.requests for r in results)} requests)")
    for where in differ:
        say(f"  differs: {where}")
    if done.head is not None:
        say(done.head.line())
        say(report.Headline.MEANING)
    elif baseline:
        say("speed-up: not measured")
    else:
        say("speed-up: not measured (--no-baseline: no engine-alone pass to compare with)")
    return differ
