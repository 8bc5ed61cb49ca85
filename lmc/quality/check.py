"""One ``lmc quality`` run: build the cases, measure each setting of a feature, judge it
against the thresholds, and return one verdict per setting (written by the caller).

The default thresholds were chosen from measurement on SmolLM2-135M-Instruct (fp32): see
docs/quality.md, "Thresholds", for the figures behind each number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmc.blend.rag_workload import read_jsonl
from lmc.connectors.core.model_id import model_identity
from lmc.models.chat import ChatTemplate
from lmc.models.texts import bundled_text
from lmc.quality.docqa import bundled_docqa, qa_prompt, text_prompt
from lmc.quality.feature import LossyKVFeature, ModelUnderTest
from lmc.quality.harness import Answer, Case, Harness
from lmc.quality.runner import SequenceRunner
from lmc.quality.verdict import Thresholds, Verdict
from lmc.reference.segments import encode_pieces
from lmc.reference.tokenizer import Tokenizer, load_eos_token_ids

# docs/quality.md, "Thresholds": a lossy KV feature may move the model's outputs a little more
# than running its fp32 weights in bf16 does (measured: KL 0.0006, top-1 0.988, perplexity
# +0.19%, every answer kept), never as much as blending with too few tokens recomputed
DEFAULT_THRESHOLDS = Thresholds(kl_mean_max=0.01, top1_min=0.97, ppl_change_max=0.01,
                                qa_agreement_min=0.9)
DEFAULT_ANSWER_TOKENS = 20
DEFAULT_TEXT = "harbour"
TEXT_CONTEXT_PARAGRAPHS = 4  # of harbour's 7: 410 tokens of context (SmolLM2), 253 scored
CHUNK_SIZE = 256

Say = Callable[[str], None]


@dataclass(frozen=True)
class Workload:
    """What a run measures on: the cases and their description (kept in each verdict)."""

    cases: list[Case]
    description: dict[str, Any]


def build_workload(model_dir: Path, tokenizer: Tokenizer, *, questions: int | None = None,
                   prompts: str | Path | None = None, text: str | None = DEFAULT_TEXT,
                   answer_tokens: int = DEFAULT_ANSWER_TOKENS) -> Workload:
    """The bundled QA prompts (the first ``questions``), or the user's JSONL prompts
    (``{"pieces": [segment, ..., question]}`` per line), and the bundled text."""
    cases: list[Case] = []
    desc: dict[str, Any] = {"answer_tokens": answer_tokens}
    if prompts is not None:
        for i, pieces in enumerate(read_jsonl(prompts)):
            ids, spans = encode_pieces(pieces, tokenizer.encode)
            cases.append(Case(f"prompt {i + 1}", ids, spans))
        if not cases:
            raise ValueError(f"{prompts}: no prompts")
        desc.update(prompts=str(prompts), questions=len(cases))
    else:
        qa = bundled_docqa()
        template = ChatTemplate.from_model_dir(model_dir)
        chosen = qa.questions[:questions] if questions else qa.questions
        for i, q in enumerate(chosen):
            ids, spans = qa_prompt(qa, q, template, tokenizer.encode)
            cases.append(Case(f"{qa.name} question {i + 1}", ids, spans, correct=q.correct))
        desc.update(qa=qa.name, qa_digest=qa.digest, questions=len(chosen),
                    chat_template=template is not None)
    if text is not None:
        paragraphs = [p for p in bundled_text(text).split("\n\n") if p.strip()]
        ids, spans, rest = text_prompt(paragraphs, TEXT_CONTEXT_PARAGRAPHS, tokenizer.encode)
        cases.append(Case(f"text {text}", ids, spans, continuation=rest))
        desc.update(text=text, text_context_tokens=len(ids))
    return Workload(cases, desc)


class QualityRun:
    """The exact side of one model's cases, computed once; :meth:`judge` then measures a
    feature's settings against it."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 answer_tokens: int = DEFAULT_ANSWER_TOKENS, questions: int | None = None,
                 prompts: str | Path | None = None, text: str | None = DEFAULT_TEXT,
                 model_revision: str | None = None, say: Say = lambda _line: None) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a checkpoint directory: no config.json")
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: lmc quality needs one to "
                             "tokenize its prompts")
        self.tokenizer = Tokenizer(model_dir / "tokenizer.json")
        self.workload = build_workload(model_dir, self.tokenizer, questions=questions,
                                       prompts=prompts, text=text, answer_tokens=answer_tokens)
        longest = max(len(c.ids) + (len(c.continuation) if c.continuation is not None
                                    else answer_tokens) for c in self.workload.cases)
        self.model_id = model_identity(model_dir, revision=model_revision)
        runner = SequenceRunner(model_dir, dtype, device, capacity=longest)
        cfg = runner.config
        self.model = ModelUnderTest(model_dir, self.model_id, runner.dtype, runner.device,
                                    cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, CHUNK_SIZE, longest)
        self.dtype = str(runner.dtype).removeprefix("torch.")
        self.stop = set(load_eos_token_ids(model_dir, cfg))
        say(f"{self.model_id} ({self.dtype}): {len(self.workload.cases)} prompts, up to "
            f"{longest} tokens")
        self.harness = Harness(runner, self.model, self.workload.cases, answer_tokens,
                               self.stop, lambda ids: self.tokenizer.decode(ids), say)

    def judge(self, feature: LossyKVFeature, settings: Sequence[str],
              thresholds: Thresholds = DEFAULT_THRESHOLDS,
              measured: Callable[[Verdict], None] = lambda _v: None,
              answers: Callable[[list[Answer]], None] = lambda _a: None) -> list[Verdict]:
        """Measure ``feature`` at each of ``settings`` (canonical) and judge each;
        ``measured`` is called with each verdict as soon as it is known, then ``answers``
        with its questions' answers."""
        verdicts = []
        feature.open(self.model)
        try:
            for setting in settings:
                with torch.no_grad():
                    m = self.harness.measure(feature, setting)
                failed = thresholds.failures(m)
                v = Verdict(self.model_id, self.dtype, feature.name, setting, not failed,
                            failed, thresholds, m, self.workload.description)
                measured(v)
                answers(self.harness.answers)
                verdicts.append(v)
        finally:
            feature.close()
        return verdicts


def run_quality(model_dir: str | Path, feature: LossyKVFeature, settings: Sequence[str], *,
                thresholds: Thresholds = DEFAULT_THRESHOLDS,
                measured: Callable[[Verdict], None] = lambda _v: None,
                answers: Callable[[list[Answer]], None] = lambda _a: None,
                **run: Any) -> list[Verdict]:
    """:class:`QualityRun` on ``model_dir`` (keywords ``run``), then :meth:`QualityRun.judge`."""
    return QualityRun(model_dir, **run).judge(feature, settings, thresholds, measured, answers)
