"""The OpenAI-style request bodies the reference server takes, checked field by field before
anything reaches the engine, and the text of a token stream as it grows.

``/v1/completions`` carries a ``prompt`` (text or token ids); ``/v1/chat/completions``
carries ``messages``, which the server renders with the checkpoint's chat template
(:meth:`lmc.reference.engine.LLM.encode_chat`). Both share the sampling fields. Every refusal
is a :class:`BadRequest` naming the field (the server answers it with a 400).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmc.models.chat import ChatTemplateError, check_messages
from lmc.reference.request import SEED_MAX, SEED_MIN
from lmc.reference.tokenizer import check_unicode
from lmc.storage.control import body_hints

INT64_MAX = 2**63 - 1


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""


def _finite(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{key} must be a finite number, got {_show(v)}")
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)  # 16.0 is 16
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def _flag(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {_show(v)}")
    return bool(v)


def _show(v: Any) -> str:
    """A client's value in an error message, cut short (it may be megabytes)."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                 for t in prompt):
            raise BadRequest("prompt must be a string or a non-empty list of token ids "
                             "(one prompt per request)")
        return prompt
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a string or a non-empty list of token ids")
    try:
        check_unicode(prompt, "prompt")
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return prompt


def _messages(body: dict) -> list[dict[str, str]]:
    try:
        messages = check_messages(body.get("messages"))
        for i, m in enumerate(messages):
            check_unicode(m["content"], f"messages[{i}].content")
    except (ChatTemplateError, ValueError) as e:
        raise BadRequest(str(e)) from None
    return messages


@dataclass
class Completion:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body: ``prompt`` is set
    for the first, ``messages`` for the second (the server turns them into prompt ids)."""

    prompt: str | list[int] | None
    sampling: dict[str, Any]  # SamplingParams keywords
    kv_transfer_params: dict | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    model: str | None = None
    messages: list[dict[str, str]] | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _common(body: Any, max_tokens: int | None, prompt: str | list[int] | None,
            messages: list[dict[str, str]] | None) -> Completion:
    temperature = _finite(body, "temperature", 0.0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature!r}")
    top_p = _finite(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p!r}")
    kw = {"max_tokens": 16 if max_tokens is None else max_tokens,
          "temperature": temperature, "top_p": top_p,
          "seed": _integer(body, "seed", SEED_MIN, SEED_MAX),
          "ignore_eos": _flag(body, "ignore_eos")}
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest(f"kv_transfer_params must be an object, got {_show(kv)}")
    if body.get("cache_hints") is not None:  # session, priority, TTL for the KV connector
        try:
            kv = {**(kv or {}), **body_hints(body["cache_hints"])}
        except ValueError as e:
            raise BadRequest(str(e)) from None
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest(f"stream_options must be an object, got {_show(opts)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {_show(model)}")
    return Completion(prompt, kw, kv, _flag(body, "stream"),
                      _flag(opts or {}, "include_usage"), _flag(body, "return_token_ids"),
                      model, messages)


def parse_completion(body: Any) -> Completion:
    """A ``/v1/completions`` body, every field the server reads checked, so a request is
    refused (400, naming the field) before it reaches the engine or a stream starts."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    max_tokens = _integer(body, "max_tokens", 1, INT64_MAX)
    return _common(body, max_tokens, _prompt(body), None)


def parse_chat(body: Any) -> Completion:
    """A ``/v1/chat/completions`` body: ``messages`` (system/user/assistant turns of text)
    and the sampling fields; ``max_completion_tokens`` is the newer name of ``max_tokens``."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n must be 1 (one answer per request), got {_show(body.get('n'))}")
    max_tokens = _integer(body, "max_completion_tokens", 1, INT64_MAX)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, INT64_MAX)
    return _common(body, max_tokens, None, _messages(body))


class TextStream:
    """The text of a growing list of token ids, a piece per token, so that the pieces join
    to exactly the decoded whole. A byte-level tokenizer splits one character over several
    tokens (CJK, emoji); decoding tokens one by one would send a replacement character for
    each part, so a piece that ends inside a character is held back until it is complete.
    Each call decodes only the tokens since the last complete piece and the one before."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0   # where the text already sent starts being decoded from
        self._read = 0     # ids up to here are sent

    def push(self, token: int) -> str:
        """The new text once ``token`` is added ("" while a character is incomplete)."""
        self._ids.append(token)
        return self._take(final=False)

    def flush(self) -> str:
        """Whatever is held back (at the end of the stream)."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]
