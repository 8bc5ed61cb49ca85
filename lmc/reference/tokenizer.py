"""Text <-> token ids through a local ``tokenizer.json`` (the ``tokenizers`` library),
plus the checkpoint's end-of-sequence ids.

EOS ids are the union of ``generation_config.json``'s and ``config.json``'s
``eos_token_id`` (each an int or a list): instruct checkpoints often list several
stop tokens in one file and a single one in the other, and stopping on any of them is
what users expect.
"""

from __future__ import annotations

from pathlib import Path

from lmc.reference.model_config import ModelConfig
from lmc.strict_json import load_json_file


def check_unicode(text: str, what: str = "text") -> None:
    """Raise ``ValueError`` if ``text`` has a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: lone surrogate "
                         f"U+{ord(text[e.start]):04X} at character {e.start}") from None


class Tokenizer:
    """Thin wrapper so the engine depends on two methods, not on a library."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer  # optional dependency

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = HFTokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` applies the tokenizer's template (e.g. BOS).
        Text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON
        can carry) is a ``ValueError`` naming where, not the library's ``TypeError``."""
        check_unicode(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_eos_token_ids(model_dir: str | Path, config: ModelConfig) -> frozenset[int]:
    """EOS ids from ``generation_config.json`` (if present) and ``config.json``."""
    ids = set(config.eos_token_ids)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        doc = load_json_file(gen_path, 1 << 20)
        value = doc.get("eos_token_id") if isinstance(doc, dict) else None
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(ids)
