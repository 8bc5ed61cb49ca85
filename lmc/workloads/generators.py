"""Generators for the workloads people use to evaluate KV offloading, deterministic from a seed.

- **chat**: multi-turn conversations (12-18 turns by default) over one shared system
  prompt; each turn's prompt is the whole history so far (system, earlier questions and
  answers, the new question), the way vLLM's multi-turn benchmark drives a server.
  ``active`` conversations are open at once and turns interleave across them, so the cache
  has to hold several histories, not just the last one.
- **prefix**: N groups x M prompts, each group a long system prompt of its own followed by
  a short question, in a seeded random order (llm-d's shared-prefix benchmark).
- **docqa**: D long documents asked a new question each round, R rounds, documents in the
  same (``tile``) or a reshuffled (``random``) order each round: the long-document QA
  pattern, where reuse distance is a whole round of documents.
- **rag**: a pool of documents; each query retrieves ``k`` of them in a random order under
  one system prompt and asks a new question (:mod:`lmc.blend.rag_workload`'s generator).
  Only the system prompt is a shared prefix; every document recurs anywhere, so a request
  marks its documents as reusable segments for engines that blend.
- **sharegpt**: a loader for ShareGPT-style JSON (``[{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", ...}]}]``): each human turn becomes a request whose prompt
  is the history, with the recorded answer's length as ``output_len``.

A request is built from *segments* (system prompt, a turn, an answer), so a trace can be
written as text (portable to any model) or, given a tokenizer, as token ids made by
concatenating each segment's tokens: prefixes are then shared exactly at the token level,
whatever the tokenizer would merge across a boundary.

Arrival times: a Poisson process of ``rate`` requests per second, or all at 0 (``rate``
None: as fast as possible). Turns of one conversation keep their order; a replay also waits
for a turn's answer before sending the next turn of the same session.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmc.workloads.inputs import (
    InputError,
    has_surrogate,
    open_input,
    parse_json,
    printable,
    read_text,
)
from lmc.workloads.text import TextGen
from lmc.workloads.trace import MAX_OUTPUT_LEN, MAX_SEPARATOR_CHARS, TraceError, TraceRequest

WORDS_PER_TOKEN = 0.75  # English BPE rule of thumb, used only when no tokenizer is given

# Bounds of a generated workload (docs/threats/cli.md): a spec past them would run for hours
# or exhaust memory instead of failing at once.
MAX_COUNT = 100_000  # conversations, groups, prompts per group, documents, rounds, turns
MAX_SEGMENT_TOKENS = 1 << 20  # a system prompt, a document, a question
MAX_TRACE_TOKENS = 1 << 30  # prompt tokens of the whole trace, estimated before generating
# lmc.reference.segments.DEFAULT_SEPARATOR, spelled here so `lmc workload` does not import torch
# (lmc.blend does); a test keeps them equal
RAG_SEPARATOR = " # # "


class SegmentTokenizer(Protocol):
    """What token-mode rendering needs (``lmc.reference.tokenizer.Tokenizer`` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Draft:
    """A request before rendering: its prompt as segments, joined in order."""

    request_id: str
    session_id: str | None
    prefix_group: str | None
    segments: tuple[str, ...]
    output_len: int
    # A RAG draft: text is joined with this separator (the engine splits there, every piece
    # but the last a segment); token ids mark the pieces between the first (a shared prefix)
    # and the last (new text) as segments. None: plain concatenation, no segments.
    separator: str | None = None


# --------------------------------------------------------------------------- helpers
def load_tokenizer(path: str | Path) -> SegmentTokenizer:
    """A ``tokenizer.json``, or a model directory holding one."""
    from lmc.reference.tokenizer import Tokenizer

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.exists():
            raise InputError(f"--tokenizer {path}: no tokenizer.json in that directory")
    open_input(p, "--tokenizer").close()  # missing, unreadable, a directory: named here
    try:
        return Tokenizer(p)
    except ImportError:
        raise
    except Exception as e:  # the tokenizers library raises plain Exception on a bad file
        raise InputError(f"--tokenizer {p}: not a tokenizer.json the tokenizers library "
                         f"reads ({printable(str(e))})") from None




class Sizer:
    """Makes text of about ``n`` tokens. With a tokenizer: its tokens per word measured
    once on sample text, a little less than ``n`` generated, then sentences added until
    the text encodes to ``n`` or more. Without: estimated from words."""

    def __init__(self, tokenizer: SegmentTokenizer | None) -> None:
        self.tok = tokenizer
        self.tokens_per_word = 1 / WORDS_PER_TOKEN
        if tokenizer is not None:
            sample = TextGen(12345).words(400)
            self.tokens_per_word = (len(tokenizer.encode(sample, add_special_tokens=False))
                                    / (sample.count(" ") + 1))

    def _count(self, text: str) -> int:
        assert self.tok is not None
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, gen: TextGen, tokens: int, paragraphs: bool = False) -> str:
        if self.tok is None:
            words = max(1, round(tokens / self.tokens_per_word))
            return gen.paragraphs(words) if paragraphs else gen.words(words)
        words = max(1, int(0.9 * tokens / self.tokens_per_word))
        text = gen.paragraphs(words) if paragraphs else gen.words(words)
        have = self._count(text)
        while have < tokens:
            more = gen.words(max(1, int(0.9 * (tokens - have) / self.tokens_per_word)))
            text += " " + more
            have = self._count(text)
        return text


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """``n`` Poisson arrivals at ``rate`` per second from t=0, or all 0 when ``rate`` is None."""
    if rate is None:
        return [0.0] * n
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def interleave(sessions: Sequence[Sequence[Draft]], active: int, rng: random.Random
               ) -> list[Draft]:
    """Turns of ``active`` open sessions at a time, the next turn drawn from a random open
    session; a finished session is replaced by the next unopened one. Order within a
    session is kept."""
    if active < 1:
        raise ValueError(f"active must be >= 1, got {active}")
    pending = list(reversed([list(s) for s in sessions if s]))
    open_: list[list[Draft]] = []
    out: list[Draft] = []
    while pending or open_:
        while pending and len(open_) < active:
            open_.append(pending.pop())
        i = rng.randrange(len(open_))
        out.append(open_[i].pop(0))
        if not open_[i]:
            open_.pop(i)
    return out


def render(drafts: Sequence[Draft], arrivals: Sequence[float],
           tokenizer: SegmentTokenizer | None = None) -> Iterator[TraceRequest]:
    """Drafts as trace requests: text joined, or (with a tokenizer) each segment's tokens
    concatenated after the tokenizer's own leading special tokens (BOS), each distinct
    segment encoded once."""
    cache: dict[str, list[int]] = {}
    lead = list(tokenizer.encode("", add_special_tokens=True)) if tokenizer else []
    for d, t in zip(drafts, arrivals, strict=True):
        if tokenizer is None:
            yield TraceRequest(t, d.request_id, d.session_id, d.prefix_group, None,
                               (d.separator or "").join(d.segments), d.output_len,
                               segment_separator=d.separator)
            continue
        ids = list(lead)
        spans: list[tuple[int, int]] = []
        for i, seg in enumerate(d.segments):
            toks = cache.get(seg)
            if toks is None:
                toks = cache[seg] = list(tokenizer.encode(seg, add_special_tokens=False))
            if d.separator is not None and 0 < i < len(d.segments) - 1 and toks:
                spans.append((len(ids), len(ids) + len(toks)))
            ids.extend(toks)
        yield TraceRequest(t, d.request_id, d.session_id, d.prefix_group, ids, None,
                           d.output_len,
                           segments=tuple(spans) if d.separator is not None else None)


def check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}: expected 1 <= min <= max, got {lo}-{hi}")


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def _at_most(limit: int, **values: int) -> None:
    for name, v in values.items():
        if v > limit:
            raise ValueError(f"{name} must be <= {limit:,}, got {v:,}")


def check_bounds(counts: dict[str, int], tokens: dict[str, int], output_len: int,
             estimate: float) -> None:
    """Refuse a spec whose options or estimated total would not finish (see MAX_*)."""
    _at_most(MAX_COUNT, **counts)
    _at_most(MAX_SEGMENT_TOKENS, **tokens)
    _at_most(MAX_OUTPUT_LEN, output_len=output_len)
    if estimate > MAX_TRACE_TOKENS:
        raise ValueError(f"the trace would hold about {estimate:,.0f} prompt tokens; at most "
                         f"{MAX_TRACE_TOKENS:,} (fewer requests or shorter prompts)")


# -------------------------------------------------------------------------------- chat
@dataclass(frozen=True)
class ChatSpec:
    conversations: int = 16
    turns: tuple[int, int] = (12, 18)
    system_tokens: int = 1000
    user_tokens: tuple[int, int] = (30, 120)
    output_len: int = 64
    active: int = 4
    seed: int = 0


def chat_drafts(spec: ChatSpec, tokenizer: SegmentTokenizer | None = None) -> list[Draft]:
    """Multi-turn conversations over one system prompt; turn k's prompt is the system
    prompt plus turns 1..k-1 (question and a synthetic answer of ``output_len`` tokens)
    plus question k."""
    check_positive(conversations=spec.conversations, output_len=spec.output_len,
              system_tokens=spec.system_tokens)
    check_range("turns", *spec.turns)
    check_range("user_tokens", *spec.user_tokens)
    max_turns, per_turn = spec.turns[1], spec.user_tokens[1] + spec.output_len
    check_bounds({"conversations": spec.conversations, "turns": max_turns, "active": spec.active},
             {"system_tokens": spec.system_tokens, "user_tokens": spec.user_tokens[1]},
             spec.output_len,
             spec.conversations * max_turns
             * (spec.system_tokens + per_turn * (max_turns + 1) / 2))
    rng = random.Random(spec.seed)
    size = Sizer(tokenizer)
    system = f"System: {size.text(TextGen(spec.seed * 1_000_003 + 1), spec.system_tokens)}\n"
    sessions: list[list[Draft]] = []
    for c in range(spec.conversations):
        gen = TextGen(spec.seed * 1_000_003 + 100 + c)
        history: list[str] = [system]
        turns: list[Draft] = []
        for k in range(rng.randint(*spec.turns)):
            question = size.text(gen, rng.randint(*spec.user_tokens))
            history.append(f"\nUser: {question}\nAssistant:")
            turns.append(Draft(f"chat-{c}-{k}", f"chat-{c}", "system", tuple(history),
                               spec.output_len))
            history.append(f" {size.text(gen, spec.output_len)}\n")
        sessions.append(turns)
    return interleave(sessions, spec.active, rng)


# ------------------------------------------------------------------------------ prefix
@dataclass(frozen=True)
class PrefixSpec:
    groups: int = 8
    prompts_per_group: int = 16
    system_tokens: int = 2000
    question_tokens: int = 60
    output_len: int = 32
    seed: int = 0


def prefix_drafts(spec: PrefixSpec, tokenizer: SegmentTokenizer | None = None) -> list[Draft]:
    """``groups`` distinct long system prompts, each followed by ``prompts_per_group``
    different questions; all requests in a seeded random order."""
    check_positive(groups=spec.groups, prompts_per_group=spec.prompts_per_group,
              system_tokens=spec.system_tokens, question_tokens=spec.question_tokens,
              output_len=spec.output_len)
    check_bounds({"groups": spec.groups, "prompts_per_group": spec.prompts_per_group},
             {"system_tokens": spec.system_tokens, "question_tokens": spec.question_tokens},
             spec.output_len,
             spec.groups * spec.prompts_per_group * (spec.system_tokens + spec.question_tokens))
    size = Sizer(tokenizer)
    drafts: list[Draft] = []
    for g in range(spec.groups):
        gen = TextGen(spec.seed * 1_000_003 + 7 + g)
        system = f"System: {size.text(gen, spec.system_tokens)}\n"
        for m in range(spec.prompts_per_group):
            q = size.text(gen, spec.question_tokens)
            drafts.append(Draft(f"prefix-{g}-{m}", None, f"group-{g}",
                                (system, f"\nUser: {q}\nAssistant:"), spec.output_len))
    random.Random(spec.seed).shuffle(drafts)
    return drafts


# ------------------------------------------------------------------------------- docqa
@dataclass(frozen=True)
class DocQASpec:
    documents: int = 8
    doc_tokens: int = 4000
    rounds: int = 3
    question_tokens: int = 30
    output_len: int = 32
    order: str = "tile"  # tile: the same document order every round; random: reshuffled
    seed: int = 0


def docqa_drafts(spec: DocQASpec, tokenizer: SegmentTokenizer | None = None) -> list[Draft]:
    """Each round asks every document a new question (document text first, so the
    document is the shared prefix)."""
    check_positive(documents=spec.documents, doc_tokens=spec.doc_tokens, rounds=spec.rounds,
              question_tokens=spec.question_tokens, output_len=spec.output_len)
    if spec.order not in ("tile", "random"):
        raise ValueError(f"order must be 'tile' or 'random', got {spec.order!r}")
    check_bounds({"documents": spec.documents, "rounds": spec.rounds},
             {"doc_tokens": spec.doc_tokens, "question_tokens": spec.question_tokens},
             spec.output_len,
             spec.documents * spec.rounds * (spec.doc_tokens + spec.question_tokens))
    rng = random.Random(spec.seed)
    size = Sizer(tokenizer)
    gens = [TextGen(spec.seed * 1_000_003 + 500 + d) for d in range(spec.documents)]
    docs = [f"Document {d + 1}.\n\n{size.text(g, spec.doc_tokens, paragraphs=True)}\n"
            for d, g in enumerate(gens)]
    order = list(range(spec.documents))
    drafts: list[Draft] = []
    for r in range(spec.rounds):
        if spec.order == "random":
            rng.shuffle(order)
        for d in order:
            q = size.text(gens[d], spec.question_tokens)
            drafts.append(Draft(f"doc-{d}-{r}", None, f"doc-{d}",
                                (docs[d], f"\nQuestion: {q}\nAnswer:"), spec.output_len))
    return drafts


# --------------------------------------------------------------------------------- rag
@dataclass(frozen=True)
class RagSpec:
    documents: int = 16
    doc_words: int = 120
    k: int = 4
    queries: int = 100
    question_words: int = 12
    system_words: int = 30
    output_len: int = 16
    separator: str = RAG_SEPARATOR
    seed: int = 0


def rag_drafts(spec: RagSpec, tokenizer: SegmentTokenizer | None = None) -> list[Draft]:
    """Each query: the system prompt, ``k`` of the documents in a random order, a new
    question (``lmc.blend.rag_workload.make_rag_workload``: same seed, same text). Text
    prompts join the pieces with ``separator`` (LMCache's ``blend_special_str``
    convention); with a tokenizer each document's span is marked in ``segments``."""
    check_positive(documents=spec.documents, doc_words=spec.doc_words, k=spec.k,
              queries=spec.queries, question_words=spec.question_words,
              system_words=spec.system_words, output_len=spec.output_len)
    if spec.k > spec.documents:
        raise ValueError(f"k ({spec.k}) must not exceed documents ({spec.documents})")
    check_bounds({"documents": spec.documents, "queries": spec.queries, "k": spec.k},
             {"doc_words": spec.doc_words, "question_words": spec.question_words,
              "system_words": spec.system_words}, spec.output_len,
             spec.queries * (spec.system_words + spec.k * spec.doc_words + spec.question_words)
             / WORDS_PER_TOKEN)
    pool = spec.documents * spec.doc_words / WORDS_PER_TOKEN  # generated whole, used or not
    if pool > MAX_TRACE_TOKENS:
        raise ValueError(f"the document pool would hold about {pool:,.0f} tokens; at most "
                         f"{MAX_TRACE_TOKENS:,} (fewer or shorter documents)")
    if not spec.separator or len(spec.separator) > MAX_SEPARATOR_CHARS \
            or has_surrogate(spec.separator):
        raise ValueError(f"separator: expected 1 to {MAX_SEPARATOR_CHARS} characters of text, "
                         f"got {spec.separator[:80]!r}")
    from lmc.blend.rag_workload import make_rag_workload

    wl = make_rag_workload(num_docs=spec.documents, doc_words=spec.doc_words, k=spec.k,
                           num_queries=spec.queries, question_words=spec.question_words,
                           system_words=spec.system_words, seed=spec.seed)
    if any(spec.separator in text for text in (wl.system, *wl.documents)):
        raise ValueError(f"separator {spec.separator!r} occurs in the generated text; choose "
                         "one that does not (the default never does)")
    return [Draft(f"rag-{q}", None, "system", tuple(wl.pieces(query)), spec.output_len,
                  spec.separator)
            for q, query in enumerate(wl.queries)]


# ---------------------------------------------------------------------------- sharegpt
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bing", "bard", "model"})


@dataclass(frozen=True)
class ShareGPTSpec:
    path: str
    max_conversations: int | None = None
    max_output_len: int = 1024
    active: int = 4
    seed: int = 0


def sharegpt_drafts(spec: ShareGPTSpec, tokenizer: SegmentTokenizer | None = None
                    ) -> tuple[list[Draft], int]:
    """Requests from a ShareGPT-style file, and how many conversations were skipped (no
    human turn followed by an answer). ``output_len`` is the recorded answer's length in
    tokens (estimated from words without a tokenizer), capped at ``max_output_len``."""
    path = Path(spec.path)
    try:
        data = parse_json(read_text(path, "ShareGPT file"), str(path), document=True)
    except TraceError:
        raise
    except InputError as e:
        raise TraceError(str(e)) from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a JSON list of conversations, got "
                         f"{type(data).__name__}")
    sessions: list[list[Draft]] = []
    skipped = 0
    for i, entry in enumerate(data):
        if spec.max_conversations is not None and len(sessions) >= spec.max_conversations:
            break
        turns = _conversation(path, i, entry)
        cid = _conversation_id(path, i, entry)
        history: list[str] = []
        drafts: list[Draft] = []
        for k, (role, text) in enumerate(turns):
            if role == "system":
                history.append(f"System: {text}\n")
            elif role == "user":
                history.append(f"\nUser: {text}\nAssistant:")
                answer = turns[k + 1][1] if k + 1 < len(turns) and turns[k + 1][0] == "assistant" \
                    else None
                if answer is not None:
                    n = (len(tokenizer.encode(answer, add_special_tokens=False)) if tokenizer
                         else math.ceil(len(answer.split()) / WORDS_PER_TOKEN))
                    drafts.append(Draft(f"sharegpt-{cid}-{len(drafts)}", f"sharegpt-{cid}", None,
                                        tuple(history), max(1, min(n, spec.max_output_len))))
            else:
                history.append(f" {text}\n")
        if drafts:
            sessions.append(drafts)
        else:
            skipped += 1
    return interleave(sessions, spec.active, random.Random(spec.seed)), skipped


def _conversation_id(path: Path, i: int, entry: dict[str, Any]) -> str:
    """The entry's ``id`` (a short string or a number) or its index."""
    cid = entry.get("id", i)
    if isinstance(cid, bool) or not isinstance(cid, (str, int)) or len(str(cid)) > 256 \
            or (isinstance(cid, str) and (has_surrogate(cid) or not cid.isprintable())):
        raise TraceError(f"{path}: conversation {i}: id: expected a printable string or a "
                         f"number of at most 256 characters")
    return str(cid)


def _conversation(path: Path, i: int, entry: Any) -> list[tuple[str, str]]:
    """One entry's turns as (system|user|assistant, text); errors name the entry."""
    where = f"{path}: conversation {i}"
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise TraceError(f"{where}: expected an object with a 'conversations' list")
    out: list[tuple[str, str]] = []
    for j, turn in enumerate(entry["conversations"]):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise TraceError(f"{where}, turn {j}: expected {{'from': ..., 'value': text}}")
        if has_surrogate(turn["value"]):
            raise TraceError(f"{where}, turn {j}: value: holds a lone UTF-16 surrogate "
                             f"(not Unicode text)")
        who = turn.get("from", "")
        who = who.lower() if isinstance(who, str) else ""
        if who in USER_ROLES:
            out.append(("user", turn["value"]))
        elif who in ASSISTANT_ROLES:
            out.append(("assistant", turn["value"]))
        elif who == "system":
            out.append(("system", turn["value"]))
        else:
            raise TraceError(f"{where}, turn {j}: unknown role {str(turn.get('from'))[:40]!r} "
                             f"(expected human/user, gpt/assistant or system)")
    return [(r, t) for r, t in out if t.strip()]
