"""The bundled document-QA set and the prompts the harness builds from it.

``data/docqa.json``: five short documents written for lmc (fictional places, people, dates
and numbers) and single-fact questions, each asked over two documents (the one that holds
the answer and another, in either order). A question stays in the set only if SmolLM2-135M-
Instruct answers it correctly from exact KV (fp32; a 135M model confuses two-part questions,
so there are none). An answer is *correct* when it contains one of the question's expected
phrases (case-insensitive).

A prompt is RAG-shaped, so that blending has segments to reuse and a codec has a document to
compress: the chat template's system turn and the start of the user turn (a shared prefix),
each document a segment (tokenized alone), then the question and the template's tail.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

from lmc.models.chat import ChatTemplate
from lmc.reference.segments import Span, encode_pieces
from lmc.strict_json import parse_json

Encode = Callable[[str, bool], list[int]]
MARK = "\u0000DOCUMENTS\u0000"  # where the user turn's text goes in the rendered template


@dataclass(frozen=True)
class Question:
    docs: tuple[str, ...]
    question: str
    answers: tuple[str, ...]  # any of these in the answer makes it correct

    def correct(self, answer: str) -> bool:
        text = answer.lower()
        return any(a.lower() in text for a in self.answers)


@dataclass(frozen=True)
class DocQA:
    name: str
    system: str
    documents: dict[str, str]
    questions: tuple[Question, ...]
    digest: str  # of the file's bytes: a verdict names what it was measured on


def bundled_docqa() -> DocQA:
    raw = (resources.files("lmc.quality") / "data" / "docqa.json").read_bytes()
    doc = parse_json(raw.decode("utf-8"), "lmc/quality/data/docqa.json")
    docs = dict(doc["documents"])
    questions = tuple(Question(tuple(q["docs"]), q["question"], tuple(q["answers"]))
                      for q in doc["questions"])
    for q in questions:
        missing = [d for d in q.docs if d not in docs]
        if missing or not q.answers:
            raise ValueError(f"docqa.json: question {q.question!r} names unknown documents "
                             f"{missing} or no answers")
    return DocQA(doc["name"], doc["system"], docs, questions,
                 hashlib.sha256(raw).hexdigest()[:16])


def qa_prompt(qa: DocQA, q: Question, template: ChatTemplate | None, encode: Encode
              ) -> tuple[list[int], list[Span]]:
    """Token ids and segment spans (the documents) of one question's prompt. Without a chat
    template (a random-weight test model), plain text: system line, documents, question."""
    docs = [qa.documents[d] + "\n\n" for d in q.docs]
    if template is not None:
        rendered = template.render([{"role": "system", "content": qa.system},
                                    {"role": "user", "content": MARK}], True)
        head, _, tail = rendered.partition(MARK)
        pieces = [head, *docs, f"Question: {q.question}{tail}"]
        ids, spans = encode_pieces(pieces, lambda text, _special: encode(text, False))
    else:
        pieces = [qa.system + "\n\n", *docs, f"Question: {q.question}\nAnswer:"]
        ids, spans = encode_pieces(pieces, encode)
    return ids, spans[1:]  # the system turn is a prefix, not a segment


def text_prompt(paragraphs: Sequence[str], context_paragraphs: int, encode: Encode
                ) -> tuple[list[int], list[Span], list[int]]:
    """A bundled text as (prompt ids, segment spans, continuation ids): the first
    ``context_paragraphs`` paragraphs are the prompt (all but its last paragraph are
    segments), the rest is the continuation whose perplexity is measured."""
    if not 2 <= context_paragraphs < len(paragraphs):
        raise ValueError(f"need 2 to {len(paragraphs) - 1} context paragraphs, got "
                         f"{context_paragraphs}")
    pieces = [p + "\n\n" for p in paragraphs[:context_paragraphs]]
    ids, spans = encode_pieces(pieces, encode)
    rest = encode("\n\n".join(paragraphs[context_paragraphs:]), False)
    return ids, spans, rest
