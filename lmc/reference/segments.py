"""A prompt's reusable segments: ``(start, end)`` token spans the engine takes with a request.

Callers mark segments as spans of the prompt (the ``segments=`` argument of
``LLM.generate``), or, for text, with a separator string between pieces (LMCache's
``blend_special_str`` convention): every piece but the last is a segment, the last (the
question) is new text. Pieces are tokenized one by one, so a document's tokens do not depend
on its neighbours' (BPE merges across a seam would change them). What the engine does with
segments is its blender's business (``lmc.blend``); these helpers only read and check them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

DEFAULT_SEPARATOR = " # # "
Span = tuple[int, int]


def check_spans(spans: Sequence[Sequence[int]], num_tokens: int) -> list[Span]:
    """Segment spans as sorted, non-overlapping, non-empty ``(start, end)`` pairs inside the
    prompt; anything else is a ``ValueError`` naming the span."""
    out: list[Span] = []
    for i, span in enumerate(spans):
        try:
            start, end = (int(v) for v in span)
        except (TypeError, ValueError):
            raise ValueError(f"segment {i} must be a (start, end) pair of ints, got {span!r}") \
                from None
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"segment {i} ({start}, {end}) must satisfy 0 <= start < end <= "
                             f"{num_tokens} (the prompt's length)")
        if out and start < out[-1][1]:
            raise ValueError(f"segment {i} ({start}, {end}) overlaps or precedes segment "
                             f"{i - 1} {out[-1]}: segments must be in order, disjoint")
        out.append((start, end))
    return out


def split_text(prompt: str, separator: str = DEFAULT_SEPARATOR) -> list[str]:
    """Pieces of a text prompt between separators (empty pieces dropped)."""
    if not separator:
        raise ValueError("the segment separator must be a non-empty string")
    return [p for p in prompt.split(separator) if p]


def encode_pieces(pieces: Sequence[str], encode: Callable[[str, bool], list[int]]
                  ) -> tuple[list[int], list[Span]]:
    """Token ids of the pieces, concatenated, and the spans of every piece but the last.

    ``encode(text, add_special_tokens)`` tokenizes one piece; only the first piece gets the
    tokenizer's special tokens (BOS). A single piece has no segment."""
    ids: list[int] = []
    spans: list[Span] = []
    for i, piece in enumerate(pieces):
        toks = encode(piece, i == 0)
        if i < len(pieces) - 1 and toks:
            spans.append((len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    return ids, spans


def split_tokens(token_ids: Sequence[int], separator: Sequence[int]) -> tuple[list[int], list[Span]]:
    """The separator convention for token-id prompts: every occurrence of the ``separator``
    run is removed, and the runs between them (but the last) are segments."""
    sep = list(separator)
    if not sep:
        raise ValueError("the segment separator must be at least one token")
    ids: list[int] = []
    spans: list[Span] = []
    start = i = 0
    toks = list(token_ids)
    n, k = len(toks), len(sep)
    while i < n:
        if toks[i: i + k] == sep:
            if len(ids) > start:
                spans.append((start, len(ids)))
            start = len(ids)
            i += k
            continue
        ids.append(toks[i])
        i += 1
    return ids, spans
