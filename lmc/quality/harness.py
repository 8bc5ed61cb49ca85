"""Measure a lossy KV feature against exact KV on one model (what ``lmc quality`` runs).

Cases: the bundled document-QA prompts (or the user's) and a bundled text. For each case
the exact side is computed once: the prompt's exact KV, the model's greedy answer (the
*teacher*, at most ``answer_tokens``), and the next-token distributions at every answer
position, teacher-forced over exact KV. For each setting of a feature, per case: the feature
serves its KV for the prompt's context, the last prompt token and the teacher's tokens are
computed on top of it, and the distributions are compared (KL, top-1); where the served
greedy choice leaves the teacher, decoding goes on from there over the served KV, so the
served answer is the answer an engine serving that KV would give. The text's continuation is
scored the same way (perplexity). The exact side goes through the same code with the exact
KV, so a feature serving exact KV measures KL 0 and identical answers, bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmc.quality.feature import LossyKVFeature, ModelUnderTest, PromptKV, Span
from lmc.quality.metrics import first_difference, kl_divergence, perplexity, top1_matches
from lmc.quality.runner import SequenceRunner
from lmc.quality.verdict import Measurement

Say = Callable[[str], None]


@dataclass(frozen=True)
class Case:
    """A prompt, its segments, and either a fixed continuation to score (a text) or None
    (a question: the exact-KV greedy answer is the teacher)."""

    name: str
    ids: list[int]
    spans: list[Span]
    continuation: list[int] | None = None
    correct: Callable[[str], bool] | None = None  # a question's answer check


@dataclass
class Reference:
    """A case's exact side."""

    case: Case
    kv: torch.Tensor  # exact KV of the context, [layers, 2, n-1, heads, dim], cache dtype
    teacher: list[int]  # the tokens forced after the prompt
    logits: torch.Tensor  # [len(teacher), vocab] over exact KV
    answer: list[int] = field(default_factory=list)  # a question's exact greedy answer


@dataclass(frozen=True)
class Answer:
    """One question's greedy answers, exact and served (``lmc quality --answers``)."""

    case: str
    exact: str
    served: str
    exact_correct: bool | None
    served_correct: bool | None


@dataclass
class _Totals:
    kl: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    err: torch.Tensor | None = None  # per layer: sum of squared error
    ref: torch.Tensor | None = None  # per layer: sum of squares of exact
    ppl: list[tuple[float, float, int]] = field(default_factory=list)
    same = agree = correct_exact = correct_served = questions = 0


class Harness:
    """Exact references of ``cases`` on one model, then :meth:`measure` per setting."""

    def __init__(self, runner: SequenceRunner, model: ModelUnderTest, cases: Sequence[Case],
                 answer_tokens: int, stop: set[int], decode: Callable[[list[int]], str],
                 say: Say = lambda _line: None) -> None:
        self.runner, self.model, self.stop, self.decode = runner, model, stop, decode
        self.answer_tokens = answer_tokens
        t0 = time.perf_counter()
        self.refs = [self._reference(c) for c in cases]
        self.reference_seconds = time.perf_counter() - t0
        say(f"exact KV: {len(cases)} prompts, "
            f"{sum(len(r.teacher) for r in self.refs)} answer/text tokens, "
            f"{self.reference_seconds:.0f} s")

    def _reference(self, case: Case) -> Reference:
        n = len(case.ids)
        if n < 2:
            raise ValueError(f"{case.name}: a prompt needs at least 2 tokens")
        logits = self.runner.forward(case.ids, 0, logits_from=n - 1)
        assert logits is not None
        kv = self.runner.read_kv(n - 1)
        if case.continuation is not None:
            teacher = list(case.continuation)
        else:
            teacher = self.runner.greedy(int(logits[-1].argmax()), n, self.answer_tokens,
                                         self.stop)
        ref = Reference(case, kv, teacher, torch.empty(0))
        ref.logits, ref.answer = self._on_top(ref, kv)
        return ref

    def _on_top(self, ref: Reference, kv: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Teacher-forced logits over context KV ``kv``, and (a question) the greedy answer
        an engine serving ``kv`` gives."""
        n, teacher = len(ref.case.ids), ref.teacher
        self.runner.write_kv(kv)
        logits = self.runner.forward([ref.case.ids[-1], *teacher[:-1]], n - 1)
        assert logits is not None
        return logits, self._answer(self.runner, ref, logits)

    def _answer(self, runner: SequenceRunner, ref: Reference, logits: torch.Tensor
                ) -> list[int]:
        """A question's greedy answer given the teacher-forced ``logits`` (``runner``'s
        cache holding what they were computed over): the teacher's tokens while its choice
        agrees, its own choices after. Empty for a text."""
        if ref.case.continuation is not None:
            return []
        teacher = ref.teacher
        chosen = logits.argmax(dim=-1).tolist()
        j = first_difference(chosen, teacher)
        if j is None:
            return list(teacher)
        return teacher[:j] + runner.greedy(chosen[j], len(ref.case.ids) + j,
                                           self.answer_tokens - j, self.stop)

    def measure(self, feature: LossyKVFeature, setting: str) -> Measurement:
        """One setting's figures over every case (the feature must be open)."""
        t0 = time.perf_counter()
        tot = _Totals()
        self.answers: list[Answer] = []  # this setting's, for who wants to read them
        for ref in self.refs:
            # a copy: a feature that wrote into it would change every later setting's exact side
            served = feature.served_kv(PromptKV(ref.case.ids, ref.case.spans, ref.kv.clone()),
                                       setting)
            if served.shape != ref.kv.shape or served.dtype != ref.kv.dtype:
                raise ValueError(f"{feature.name} at {setting} served KV "
                                 f"{tuple(served.shape)} {served.dtype} for "
                                 f"{tuple(ref.kv.shape)} {ref.kv.dtype}")
            self._add_error(tot, served, ref.kv)
            self._compare(tot, ref, *self._on_top(ref, served))
        return _measurement(tot, time.perf_counter() - t0)

    def measure_model(self, other: SequenceRunner) -> Measurement:
        """The same figures for a whole other model run (e.g. these weights in bfloat16)
        computing every case itself, KV included: what a deployment change costs, the yardstick
        lossy KV features are held to (docs/quality.md, "Thresholds")."""
        t0 = time.perf_counter()
        tot = _Totals()
        self.answers = []
        for ref in self.refs:
            n = len(ref.case.ids)
            logits = other.forward([*ref.case.ids, *ref.teacher[:-1]], 0, logits_from=n - 1)
            assert logits is not None
            self._compare(tot, ref, logits, self._answer(other, ref, logits))
        return _measurement(tot, time.perf_counter() - t0)

    def _compare(self, tot: _Totals, ref: Reference, logits: torch.Tensor,
                 answer: list[int]) -> None:
        if ref.case.continuation is not None:
            tot.ppl.append((perplexity(ref.logits, ref.teacher),
                            perplexity(logits, ref.teacher), len(ref.teacher)))
            return
        tot.kl.append(kl_divergence(ref.logits, logits))
        tot.top1.append(top1_matches(ref.logits, logits))
        tot.questions += 1
        tot.same += answer == ref.answer
        exact_text, served_text = self.decode(ref.answer), self.decode(answer)
        check = ref.case.correct
        right = (check(exact_text), check(served_text)) if check else (None, None)
        # the same answer, or one that still names the fact the exact one named
        tot.agree += answer == ref.answer or (right[0] is True and right[1] is True)
        tot.correct_exact += bool(right[0])
        tot.correct_served += bool(right[1])
        self.answers.append(Answer(ref.case.name, exact_text, served_text, *right))

    @staticmethod
    def _add_error(tot: _Totals, served: torch.Tensor, exact: torch.Tensor) -> None:
        dims = tuple(range(1, exact.dim()))
        err = (served.double() - exact.double()).pow(2).sum(dim=dims)
        ref = exact.double().pow(2).sum(dim=dims)
        tot.err = err if tot.err is None else tot.err + err
        tot.ref = ref if tot.ref is None else tot.ref + ref


def _measurement(tot: _Totals, seconds: float) -> Measurement:
    kl = torch.cat(tot.kl) if tot.kl else torch.zeros(1, dtype=torch.float64)
    top1 = torch.cat(tot.top1) if tot.top1 else torch.ones(1, dtype=torch.bool)
    ppl_n = sum(n for _, _, n in tot.ppl)
    # perplexity over every scored text token: the texts' perplexities' mean weighted by tokens
    # in the log domain
    ppl_exact = math.exp(sum(math.log(e) * n for e, _, n in tot.ppl) / ppl_n) if ppl_n else 1.0
    ppl_served = math.exp(sum(math.log(s) * n for _, s, n in tot.ppl) / ppl_n) if ppl_n \
        else 1.0
    kv_error = ((tot.err / tot.ref.clamp_min(1e-300)).sqrt().tolist()
                if tot.err is not None and tot.ref is not None else [])
    return Measurement(
        kl_mean=float(kl.mean()), kl_max=float(kl.max()),
        top1=float(top1.double().mean()), answer_tokens=int(kl.numel()) if tot.kl else 0,
        ppl_exact=ppl_exact, ppl_served=ppl_served, ppl_change=ppl_served / ppl_exact - 1,
        text_tokens=ppl_n,
        qa_identical=tot.same / tot.questions if tot.questions else 1.0,
        qa_agreement=tot.agree / tot.questions if tot.questions else 1.0,
        qa_correct_exact=tot.correct_exact, qa_correct_served=tot.correct_served,
        questions=tot.questions, kv_error=kv_error, seconds=round(seconds, 3))
