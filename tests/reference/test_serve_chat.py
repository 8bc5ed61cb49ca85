"""The reference server on the real model, text in and text out: ``/v1/chat/completions``
applies the checkpoint's chat template and ends with the assistant's turn, as ``LLM.chat``
does (plain and streamed); ``/v1/completions`` takes and returns text; streamed pieces join to
the whole text even where one character spans several tokens."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmc.reference import LLM, make_tiny_checkpoint
from lmc.reference.openai_api import TextStream, parse_chat
from lmc.reference.serve import BadRequest, Server
from lmc.reference.tokenizer import Tokenizer
from tests.real_model import real_model_dir

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
TURNS = [{"role": "system", "content": "You answer in one short sentence."},
         {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."},
         {"role": "user", "content": "And what is the capital of Italy?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = Server(LLM(real_model_dir("fp32"), max_model_len=2048, num_blocks=256))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()
    torch.set_num_threads(before)


def _post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    events = raw.decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events if e.startswith("data: {")]


def test_chat_answers_as_llm_chat_plain_and_streamed(server: Server) -> None:
    want = {name: server.loop.call(lambda m=m: server.llm.chat(m, max_tokens=32)[0])
            for name, m in (("france", FRANCE), ("turns", TURNS))}
    assert want["france"].text == "The capital of France is Paris."
    for name, messages in (("france", FRANCE), ("turns", TURNS)):
        status, raw = _post(server.url, "/v1/chat/completions",
                            {"messages": messages, "max_tokens": 32, "return_token_ids": True})
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
        choice = answer["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want[name].text}
        assert choice["finish_reason"] == "stop" and choice["token_ids"] == want[name].token_ids
        assert answer["usage"]["prompt_tokens"] == len(want[name].prompt_token_ids)
    status, raw = _post(server.url, "/v1/chat/completions", {
        "messages": TURNS, "max_completion_tokens": 32, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = _chunks(raw)
    assert status == 200 and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == want["turns"].text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(want["turns"].token_ids)


def test_completions_take_and_return_text(server: Server) -> None:
    prompt = "The three primary colours are"
    want = server.loop.call(lambda: server.llm.generate(prompt, max_tokens=12)[0])
    status, raw = _post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 12})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want.text
    assert len(want.text) > 10
    status, raw = _post(server.url, "/v1/completions",
                        {"prompt": prompt, "max_tokens": 12, "stream": True})
    pieces = [c["choices"][0]["text"] for c in _chunks(raw)]
    assert "".join(pieces) == want.text


@pytest.mark.parametrize(("body", "field"), [
    ({}, "messages must be a list"),
    ({"messages": []}, "messages is empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content is not valid"),
    ({"messages": FRANCE, "n": 2}, "n must be 1"),
    ({"messages": FRANCE, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": FRANCE, "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, "exceeds max_model_len=2048"),
])
def test_bad_chat_bodies_are_400_naming_the_field(server: Server, body: dict, field: str
                                                  ) -> None:
    status, raw = _post(server.url, "/v1/chat/completions", body)
    assert status == 400 and field in json.loads(raw)["error"]["message"], raw


def test_a_checkpoint_without_a_template_refuses_chat(tmp_path: Path) -> None:
    srv = Server(LLM(make_tiny_checkpoint(tmp_path / "tiny", layers=1), num_blocks=16))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        status, raw = _post(srv.url, "/v1/chat/completions", {"messages": FRANCE})
        assert status == 400 and "has no chat template" in json.loads(raw)["error"]["message"]
    finally:
        srv.close()
    with pytest.raises(BadRequest, match="JSON object"):
        parse_chat([FRANCE])


@pytest.mark.parametrize("text", ["日本語のテキストです", "emoji 😀👍🏽 and 🇫🇷", "naïve café ✓"])
def test_streamed_pieces_join_to_the_whole_text(text: str) -> None:
    """Decoding each token alone gives replacement characters for a character split over
    tokens (what the stream sent before); the pieces now never hold one and join exactly."""
    tok = Tokenizer(real_model_dir("fp32") / "tokenizer.json")
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the case exists in this text
    stream = TextStream(tok.decode)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
