"""A RAG-shaped workload: a pool of documents, and queries that each retrieve ``k`` of them in
a random order under one system prompt, followed by a question never asked before.

This is the shape prefix caching handles worst (only the system prompt is a shared prefix)
and segment caching best (every document recurs, anywhere). A query is written as its pieces
``[system, doc, ..., doc, question]``; ``prompt_text`` joins them with the separator
convention of :mod:`lmc.blend.keys`. The same generator makes ``lmc workload rag``'s and
``benchmarks/bench_blend.py``'s traces; ``write_jsonl``/``read_jsonl`` are the
prompts-file format (one ``{"pieces": [...]}`` object per line).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lmc.reference.segments import DEFAULT_SEPARATOR, Span, encode_pieces
from lmc.strict_json import InputError, parse_json

MAX_LINE_BYTES = 1 << 20
MAX_PROMPTS = 10_000
MAX_PIECES = 256

_WORD_LINES = (
    "the a of to and in that is was for on with as by at from this which or an be are it",
    "cache memory layer token model block engine server request disk network storage copy",
    "river mountain forest ocean city village garden window door table chair book letter",
    "morning evening winter summer rain snow wind storm cloud light stone road bridge train",
    "teacher student doctor farmer writer painter singer driver builder sailor keeper",
    "report history science market policy energy water health music language number result",
    "first second early late long short high low deep wide new old fast slow bright quiet",
)
_WORDS = [w for line in _WORD_LINES for w in line.split()]


@dataclass(frozen=True)
class RagQuery:
    doc_ids: tuple[int, ...]
    question: str


@dataclass(frozen=True)
class RagWorkload:
    system: str
    documents: tuple[str, ...]
    queries: tuple[RagQuery, ...]

    def pieces(self, query: RagQuery) -> list[str]:
        return [self.system, *(self.documents[d] for d in query.doc_ids), query.question]

    def prompt_text(self, query: RagQuery, separator: str = DEFAULT_SEPARATOR) -> str:
        return separator.join(self.pieces(query))

    def prompt_tokens(self, query: RagQuery, encode: Callable[[str, bool], list[int]]
                      ) -> tuple[list[int], list[Span]]:
        """Token ids and segment spans; the system prompt is a prefix, not a segment."""
        ids, spans = encode_pieces(self.pieces(query), encode)
        return ids, spans[1:]


def _text(rng: random.Random, words: int) -> str:
    out: list[str] = []
    for i in range(words):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
    return " ".join(out) + "."


def make_rag_workload(num_docs: int = 16, doc_words: int = 120, k: int = 4,
                      num_queries: int = 100, question_words: int = 12,
                      system_words: int = 30, seed: int = 0) -> RagWorkload:
    """A deterministic workload (same arguments, same text)."""
    for name, v in (("num_docs", num_docs), ("doc_words", doc_words), ("k", k),
                    ("num_queries", num_queries), ("question_words", question_words),
                    ("system_words", system_words)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    if k > num_docs:
        raise ValueError(f"k ({k}) must not exceed num_docs ({num_docs})")
    rng = random.Random(seed)
    system = "System: " + _text(rng, system_words)
    docs = tuple(f"Document {i}: " + _text(rng, doc_words) for i in range(num_docs))
    queries = tuple(RagQuery(tuple(rng.sample(range(num_docs), k)),
                             f"Question {q}: " + _text(rng, question_words) + " Answer:")
                    for q in range(num_queries))
    return RagWorkload(system, docs, queries)


def write_jsonl(workload: RagWorkload, path: str | os.PathLike) -> Path:
    path = Path(path)
    with open(path, "w") as f:
        for q in workload.queries:
            f.write(json.dumps({"pieces": workload.pieces(q)}) + "\n")
    return path


def read_jsonl(path: str | os.PathLike) -> Iterator[list[str]]:
    """Prompts as pieces, from a prompts file; errors name ``file:line``. A line is
    ``{"pieces": ["system", "doc", ..., "question"]}`` or ``{"prompt": "... # # ..."}``
    (split at the default separator)."""
    path = Path(path)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n > MAX_PROMPTS:
                raise ValueError(f"{path}:{n}: more than {MAX_PROMPTS} prompts")
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{n}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                obj = parse_json(raw.decode("utf-8"), f"{path}:{n}")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") \
                    from None
            except InputError as e:  # names path:line and what is wrong
                raise ValueError(str(e)) from None
            yield _pieces(obj, f"{path}:{n}")


def _pieces(obj: object, where: str) -> list[str]:
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and len(obj) == 1:
        pieces = [p for p in obj["prompt"].split(DEFAULT_SEPARATOR) if p]
    elif isinstance(obj, dict) and isinstance(obj.get("pieces"), list) and len(obj) == 1:
        pieces = obj["pieces"]
    else:
        raise ValueError(f"{where}: expected {{\"pieces\": [str, ...]}} or {{\"prompt\": str}}")
    if not all(isinstance(p, str) and p for p in pieces):
        raise ValueError(f"{where}: every piece must be a non-empty string")
    if not 2 <= len(pieces) <= MAX_PIECES:
        raise ValueError(f"{where}: a prompt needs 2 to {MAX_PIECES} pieces (segments, then "
                         f"the question), got {len(pieces)}")
    return pieces
