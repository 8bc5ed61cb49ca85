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
from lmc.quality.harness import Case, Harness
from lmc.quality.runner import SequenceRunner
from lmc.quality.verdict import Thresholds, Verdict
from lmc.reference.segments import encode_pieces
from lmc.reference.tokenizer import Tokenizer, load_eos_token_ids

DEFAULT_THRESHOLDS = Thresholds(kl_mean_max=0.05, top1_min=0.95, ppl_change_max=0.02,
                                qa_identical_min=0.9)
DEFAULT_ANSWER_TOKENS = 20
DEFAULT_TEXT = "harbour"
TEXT_CONTEXT_PARAGRAPHS = 4  # of harbour's 7: ~380 tokens of context, ~290 scored
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


def run_quality(model_dir: str | Path, feature: LossyKVFeature, settings: Sequence[str], *,
                dtype: str = "float32", device: str = "cpu",
                thresholds: Thresholds = DEFAULT_THRESHOLDS,
                answer_tokens: int = DEFAULT_ANSWER_TOKENS, questions: int | None = None,
                prompts: str | Path | None = None, text: str | None = DEFAULT_TEXT,
                model_revision: str | None = None,
                say: Say = lambda _line: None,
                measured: Callable[[Verdict], None] = lambda _v: None) -> list[Verdict]:
    """Measure ``feature`` at each of ``settings`` (canonical) on the model in ``model_dir``
    and judge each; ``measured`` is called with each verdict as soon as it is known."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a checkpoint directory: no config.json")
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: lmc quality needs one to "
                         "tokenize its prompts")
    tokenizer = Tokenizer(model_dir / "tokenizer.json")
    work = build_workload(model_dir, tokenizer, questions=questions, prompts=prompts,
                          text=text, answer_tokens=answer_tokens)
    longest = max(len(c.ids) + (len(c.continuation) if c.continuation is not None
                                else answer_tokens) for c in work.cases)
    model_id = model_identity(model_dir, revision=model_revision)
    runner = SequenceRunner(model_dir, dtype, device, capacity=longest)
    cfg = runner.config
    under_test = ModelUnderTest(model_dir, model_id, runner.dtype, runner.device,
                                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                CHUNK_SIZE, longest)
    dtype_name = str(runner.dtype).removeprefix("torch.")
    stop = set(load_eos_token_ids(model_dir, cfg))
    say(f"{model_id} ({dtype_name}): {len(work.cases)} prompts, up to {longest} tokens")
    harness = Harness(runner, under_test, work.cases, answer_tokens, stop,
                      lambda ids: tokenizer.decode(ids), say)
    verdicts = []
    feature.open(under_test)
    try:
        for setting in settings:
            with torch.no_grad():
                m = harness.measure(feature, setting)
            failed = thresholds.failures(m)
            v = Verdict(model_id, dtype_name, feature.name, setting, not failed, failed,
                        thresholds, m, work.description)
            measured(v)
            verdicts.append(v)
    finally:
        feature.close()
    return verdicts
