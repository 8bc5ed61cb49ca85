"""A checkpoint's chat template: the one place a list of messages becomes prompt text.

The template is the checkpoint's own Jinja source (``chat_template.jinja``, else the
``chat_template`` field of ``tokenizer_config.json``), rendered in Jinja's immutable sandbox
(a template is data that came with the weights: it may not reach Python objects or change
state) with the variables Hugging Face templates expect: ``messages``,
``add_generation_prompt``, the special tokens by name and ``raise_exception``.

The rendered text carries the special tokens as text (``<|im_start|>``); encoding it with the
checkpoint's tokenizer and no added special tokens gives the ids (the tokenizer matches its
special tokens in text, so text a user sends that spells one becomes that token, as in every
engine that applies templates to text).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 4096
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """A template that does not render, or messages a template cannot take."""


def check_messages(messages: Any, what: str = "messages") -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts of strings, roles among
    system/user/assistant; a ``ChatTemplateError`` naming the first bad entry otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"{what} must be a list of {{role, content}} objects")
    if not messages:
        raise ChatTemplateError(f"{what} is empty")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"{what} has {len(messages)} entries (at most {MAX_MESSAGES})")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{what}[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"{what}[{i}].role must be one of {', '.join(ROLES)}, "
                                    f"got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"{what}[{i}].content must be a string")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise ChatTemplateError(f"{what}[{i}] has unsupported field(s): "
                                    f"{', '.join(sorted(map(str, extra)))}")
        out.append({"role": role, "content": content})
    return out


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    source: str
    special_tokens: Mapping[str, str]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: v for k in SPECIAL_KEYS if (v := _token_text(config.get(k))) is not None}
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the "default" one
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"{model_dir / 'tokenizer_config.json'}: chat_template "
                                    "must be a string")
        return cls(source, special)

    def render(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (checked first); with ``add_generation_prompt``
        it ends where the assistant's answer starts."""
        checked = check_messages(messages)
        try:
            return _compile(self.source).render(
                messages=checked, add_generation_prompt=add_generation_prompt,
                raise_exception=_raise, **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template error or a sandbox refusal, named
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=8)  # one per checkpoint in use: compiling costs milliseconds
def _compile(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def _token_text(value: Any) -> str | None:
    """A special token as HF configs write it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: not readable JSON: {e}") from None
    return data if isinstance(data, dict) else {}
