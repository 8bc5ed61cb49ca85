"""Chat templating: the checkpoint's own template, rendered as Hugging Face renders it (the
expected strings were checked once against ``transformers``' ``apply_chat_template`` on the
same GGUF), messages checked before rendering, the template kept in Jinja's sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmc.models import ChatTemplate, ChatTemplateError
from tests.real_model import real_model_dir

DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n")


@pytest.fixture(scope="module")
def smol() -> ChatTemplate:
    template = ChatTemplate.from_model_dir(real_model_dir("fp32"))
    assert template is not None
    return template


def test_one_user_turn_gets_the_default_system_turn(smol: ChatTemplate) -> None:
    text = smol.render([{"role": "user", "content": "Hi"}])
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_multi_turn_with_a_system_turn(smol: ChatTemplate) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"}]
    assert smol.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n")


@pytest.mark.parametrize(("messages", "error"), [
    ("hello", "messages must be a list"),
    ([], "messages is empty"),
    ([{"role": "tool", "content": "x"}], "messages[0].role must be one of system, user, "
                                         "assistant, got 'tool'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
     "messages[1].content must be a string"),
    ([{"role": "user"}], "messages[0].content must be a string"),
    ([["user", "hi"]], "messages[0] must be an object"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "unsupported field(s): tool_calls"),
])
def test_bad_messages_are_named(smol: ChatTemplate, messages, error: str) -> None:
    with pytest.raises(ChatTemplateError) as e:
        smol.render(messages)
    assert error in str(e.value)


@pytest.mark.parametrize(("source", "error"), [
    ("{{ messages.append(1) }}", "unsafe"),                    # the sandbox is immutable
    ("{{ ''.__class__.__mro__ }}", "unsafe"),                  # and reaches no Python object
    ("{{ raise_exception('needs a system turn') }}", "refused the messages: needs a system"),
    ("{% for %}", "does not compile"),
])
def test_a_template_cannot_escape_or_crash(source: str, error: str) -> None:
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])
    assert error in str(e.value)


def test_template_sources_and_special_tokens(tmp_path: Path) -> None:
    assert ChatTemplate.from_model_dir(tmp_path) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"},
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ messages[0].content }}{{ eos_token }}"}]}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]) == "x</s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")  # wins
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template is not None and template.render([{"role": "user", "content": "x"}]) == "J1"
