"""The agentic workload (``lmc workload agent``): sessions shaped like coding-agent traces,
and a background of unrelated traffic with a burst.

Published coding-agent traces (SWE-agent's, tool-using assistants') have a shape a chat
benchmark lacks, and it is the one that decides whether a cache pays:

* **a long shared prefix**: the tool definitions and system prompt (thousands of tokens),
  the same for every session;
* **turns that append**: each turn's prompt is the whole context so far -- the task, then
  per step the model's action (a synthetic answer of ``output_len`` tokens) and the tool's
  result (a file listing, a diff, a test log: ``tool_tokens``) -- so 85-97% of a turn is
  the previous turn's prompt;
* **sub-agents that fork** the context: with probability ``fork`` after a turn, a sub-agent
  starts from the parent's whole context plus a sub-task, runs ``sub_turns`` turns of its
  own, and the parent's next turn carries its report;
* **think time** between turns (the tool running, the model's previous answer): seconds,
  exponential with mean ``think_s``;
* **background traffic**: unrelated prompts (``background_tokens`` each, no session) at
  ``background_rate`` per second, and a burst of ``burst_rate`` per second for
  ``burst_s`` seconds starting at ``burst_at`` of the sessions' span: the traffic that
  evicts an agent's context between its turns.

Sessions start ``session_gap_s`` apart on average (Poisson). A request's ``session_id``
names its (sub-)agent, and its ``prefix_group`` is ``agent`` for sessions (they share the
tools prefix) or ``background``; ``lmc replay --session-hints`` turns the first into cache
hints (a session's chain pinned between turns, a priority) and can give the background a
lower priority.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lmc.workloads.generators import (
    Draft,
    SegmentTokenizer,
    Sizer,
    check_bounds,
    check_positive,
    check_range,
)
from lmc.workloads.text import TextGen


@dataclass(frozen=True)
class AgentSpec:
    sessions: int = 12
    turns: tuple[int, int] = (6, 14)
    system_tokens: int = 3000
    task_tokens: tuple[int, int] = (150, 400)
    tool_tokens: tuple[int, int] = (100, 600)
    output_len: int = 48
    fork: float = 0.15
    sub_turns: tuple[int, int] = (2, 4)
    think_s: float = 2.0
    session_gap_s: float = 3.0
    background_rate: float = 0.2
    background_tokens: tuple[int, int] = (800, 2400)
    burst_rate: float = 4.0
    burst_s: float = 8.0
    burst_at: float = 0.5
    seed: int = 0

    def check(self) -> None:
        check_positive(sessions=self.sessions, system_tokens=self.system_tokens,
                  output_len=self.output_len)
        for name in ("turns", "task_tokens", "tool_tokens", "sub_turns", "background_tokens"):
            check_range(name, *getattr(self, name))
        if not 0 <= self.fork <= 1:
            raise ValueError(f"fork must be a probability in [0, 1], got {self.fork}")
        if not 0 <= self.burst_at <= 1:
            raise ValueError(f"burst_at must be a fraction of the span, got {self.burst_at}")
        for name in ("think_s", "session_gap_s", "background_rate", "burst_rate", "burst_s"):
            v = getattr(self, name)
            if not 0 <= v < 1e6:
                raise ValueError(f"{name} must be >= 0 and finite, got {v}")
        per_turn = self.tool_tokens[1] + self.output_len
        turns = self.turns[1] * (1 + self.fork * self.sub_turns[1])
        check_bounds({"sessions": self.sessions, "turns": self.turns[1]},
                 {"system_tokens": self.system_tokens, "task_tokens": self.task_tokens[1],
                  "tool_tokens": self.tool_tokens[1]}, self.output_len,
                 self.sessions * turns * (self.system_tokens + per_turn * turns / 2))


class _Agents:
    """The drafts and arrival times of the sessions (module doc)."""

    def __init__(self, spec: AgentSpec, tokenizer: SegmentTokenizer | None) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.size = Sizer(tokenizer)
        gen = TextGen(spec.seed * 1_000_003 + 11)
        self.system = f"Tools and instructions: {self.size.text(gen, spec.system_tokens)}\n"
        self.out: list[tuple[float, Draft]] = []

    def _text(self, gen: TextGen, span: tuple[int, int]) -> str:
        return self.size.text(gen, self.rng.randint(*span))

    def session(self, name: str, history: list[str], t: float, turns: int, gen: TextGen
                ) -> tuple[list[str], float]:
        """``turns`` turns of agent ``name`` from context ``history`` at time ``t``; its
        context and the time after its last turn (sub-agents fork on the way)."""
        s = self.spec
        for k in range(turns):
            self.out.append((t, Draft(f"{name}-{k}", name, "agent", tuple(history),
                                      s.output_len)))
            history = [*history, f" Action: {self.size.text(gen, s.output_len)}\n"
                                 f"Observation: {self._text(gen, s.tool_tokens)}\n"]
            t += self.rng.expovariate(1 / s.think_s) if s.think_s else 0.0
            if k + 1 < turns and self.rng.random() < s.fork:
                sub = f"{name}.sub{k}"
                task = f"Sub-task: {self._text(gen, s.task_tokens)}\n"
                sub_hist, t = self.session(sub, [*history, task], t,
                                           self.rng.randint(*s.sub_turns), gen)
                history = [*history, f" Sub-agent report: {self.size.text(gen, s.output_len)}"
                                     "\n"]
        return history, t

    def background(self, until: float) -> None:
        s = self.spec
        gen = TextGen(s.seed * 1_000_003 + 99)
        burst0 = s.burst_at * until
        t, i = 0.0, 0
        while True:
            rate = s.burst_rate if burst0 <= t < burst0 + s.burst_s else s.background_rate
            if rate <= 0:
                if t >= burst0 + s.burst_s or s.burst_rate <= 0:
                    return
                t = burst0  # nothing until the burst
                continue
            t += self.rng.expovariate(rate)
            if t > until:
                return
            text = f"Unrelated request: {self._text(gen, s.background_tokens)}\nAnswer:"
            self.out.append((t, Draft(f"bg-{i}", None, "background", (text,), s.output_len)))
            i += 1


def agent_drafts(spec: AgentSpec, tokenizer: SegmentTokenizer | None = None
                 ) -> tuple[list[Draft], list[float]]:
    """The workload's drafts and their arrival times, in arrival order (module doc)."""
    spec.check()
    a = _Agents(spec, tokenizer)
    start, end = 0.0, 0.0
    for i in range(spec.sessions):
        gen = TextGen(spec.seed * 1_000_003 + 200 + i)
        task = f"\nTask: {a._text(gen, spec.task_tokens)}\n"
        _, t = a.session(f"agent-{i}", [a.system, task], start,
                         a.rng.randint(*spec.turns), gen)
        end = max(end, t)
        start += a.rng.expovariate(1 / spec.session_gap_s) if spec.session_gap_s else 0.0
    a.background(end)
    a.out.sort(key=lambda x: x[0])
    return [d for _, d in a.out], [round(t, 6) for t, _ in a.out]
