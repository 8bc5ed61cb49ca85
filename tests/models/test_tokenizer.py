"""The tokenizer built from the GGUF: exact round-trips and the ids of the original.

The expected ids were produced once by transformers' own GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, transformers 5.19 in the vLLM venv) on
the same strings; they are written here so the test needs no transformers.
"""

from __future__ import annotations

import json

import pytest

from lmc.reference.tokenizer import Tokenizer
from tests.real_model import real_model_dir

KNOWN_IDS = {
    "Hello world! 12345 café": [19556, 905, 17, 216, 33, 34, 35, 36, 37, 37366],
    "日本語のテキスト": [23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391,
                  134, 11100, 226],
    "emoji 😀👍🏽": [391, 33777, 40303, 218, 10813, 235, 231, 10813, 233, 138],
    "def f(x):\n    return x**2  # sq": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216,
                                          907, 15375],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}

ROUND_TRIPS = [
    "",
    " leading and trailing spaces  ",
    "Ünïcödé: naïve façade, Größe, Ελληνικά, русский, עברית, العربية",
    "中文：缓存键值对的重用。한국어 텍스트도 있습니다.",
    "emoji: 🧪🚀 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👋🏿",
    "numbers 3.14159 -42 1,000,000 0x1F 2024-06-01",
    "def cache(key: bytes) -> int:\n\treturn hash(key) & 0xFFFF  # tab\r\n",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>assistant\n",
    "a\u200bzero\u200dwidth \ufeffbom \x00nul \x7f",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(real_model_dir("fp32") / "tokenizer.json")


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_ids_equal_the_original_tokenizer(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == KNOWN_IDS[text]


@pytest.mark.parametrize("text", ROUND_TRIPS + list(KNOWN_IDS))
def test_round_trip_is_exact(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_no_bos(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_end|>") == [2]  # one token, and no BOS is added
    assert tokenizer.encode("Hi")[0] != 1
    # digits are split one by one (the "smollm" pre-tokenizer)
    assert len(tokenizer.encode("1234567890")) == 10
    # special tokens are dropped from decoded answers, text around them kept
    assert tokenizer.decode([1, 4093, 198, 26843, 2]) == "user\nHi"


def test_tokenizer_config_names_the_turn_end(tokenizer: Tokenizer) -> None:
    config = json.loads((real_model_dir("fp32") / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False
    specials = {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}
    assert sorted(specials) == list(range(17)) and specials[2] == "<|im_end|>"
