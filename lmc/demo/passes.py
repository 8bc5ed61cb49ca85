"""Running a script: one request at a time (so a TTFT is the request's own), on one engine
or interleaved over two (each request asked of one engine, then of the other, before the
next, so a busy machine slows both alike)."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmc.demo.script import Script, prompts_for, pseudo_text


@dataclass
class PassResult:
    """One engine's pass over the script, repeated ``len(rounds)`` times (interleaved
    rounds), with the lmc counters' change over it (``stats``; empty without lmc)."""

    name: str
    rounds: list[list[float]] = field(default_factory=list)  # per round, each request's TTFT
    prompt_tokens: int = 0  # over every round
    outputs: list[list[list[int]]] = field(default_factory=list)  # [round][request] token ids
    answers: list[str] = field(default_factory=list)  # the first round's, as text
    cut: list[bool] = field(default_factory=list)  # an answer stopped by max_tokens
    stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ttfts(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    @property
    def requests(self) -> int:
        return sum(len(r) for r in self.rounds)


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


@dataclass(frozen=True)
class Turn:
    """One request of a script: chat ``chat``'s round ``round``, or document question
    ``question`` (``chat`` is then -1)."""

    text: str
    chat: int = -1
    round: int = -1
    question: int = -1


def turns(script: Script) -> Iterator[Turn]:
    """The script's requests in the order they are asked: round 1 of every chat, round 2...,
    then the document questions."""
    for r in range(script.rounds):
        for c, chat in enumerate(script.chats):
            if r < len(chat):
                yield Turn(chat[r], chat=c, round=r)
    for q, text in enumerate(script.questions):
        yield Turn(text, question=q)


def run_script(engines: list[Any], script: Script, results: list[PassResult],
               label: str) -> None:
    """One round of ``script`` on every engine of ``engines`` (each request asked of each in
    turn), appended to ``results`` (one per engine). Each chat's history carries the first
    engine's answers: the engines answer alike or the demo reports that they did not."""
    sys.stdout.flush()
    progress = Progress(label, script.num_requests * len(engines))
    prompts = prompts_for(engines[0])
    t0 = time.perf_counter()
    answers: list[list[str]] = [[] for _ in script.chats]
    for res in results:
        res.rounds.append([])
        res.outputs.append([])
    first_round = len(results[0].rounds) == 1
    for turn in turns(script):
        if turn.chat >= 0:
            chat = script.chats[turn.chat]
            ids = prompts.chat(script.system, chat[:turn.round + 1], answers[turn.chat])
        else:
            ids = prompts.question(script.document, turn.text)
        said: list[str] = []  # each engine's answer, as text
        for llm, res in zip(engines, results):
            out = llm.generate([ids], max_tokens=script.max_tokens,
                               ignore_eos=not script.stop_at_eos)[0]
            said.append(out.text.strip())
            res.rounds[-1].append(out.ttft_s)
            res.prompt_tokens += len(out.prompt_token_ids)
            res.outputs[-1].append(list(out.token_ids))
            if first_round:
                res.answers.append(said[-1])
                res.cut.append(out.finish_reason == "length")
            progress.advance(out.ttft_s)
        if turn.chat >= 0:
            answers[turn.chat].append(said[0])
    for res in results:
        res.seconds += time.perf_counter() - t0


def warm_up(llm: Any, tokens: int, seed: int = 0) -> None:
    """One untimed request on text the script never uses: the first call's one-time costs
    (allocator growth, kernel selection, lazy imports) stay out of every timed pass."""
    rng = random.Random(seed + 1_000_003)
    llm.generate([pseudo_text(rng, llm.encode, tokens)], max_tokens=2, ignore_eos=True)
