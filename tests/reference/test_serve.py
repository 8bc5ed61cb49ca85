"""The reference engine's OpenAI-style server (``lmc.reference.serve``) in-process, without
lmc: completions equal ``LLM.generate`` (plain and streamed, concurrent requests batched by
one engine thread), bad bodies are 400s naming the field; and ``lmc pd-proxy``'s prefill
request shape."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmc.reference import LLM, make_tiny_checkpoint
from lmc.reference.serve import BadRequest, Server, parse_completion
from lmc.router.pd_proxy import prefill_body
from tests.reference.prompts import random_prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "llama")
    srv = Server(LLM(ckpt, num_blocks=64))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_completions_equal_generate_plain_streamed_and_concurrent(server):
    prompts = [random_prompt(i, 40 + 17 * i) for i in range(4)]
    want = [o.token_ids for o in LLM(server.llm.model_dir, num_blocks=64).generate(
        prompts, max_tokens=5, ignore_eos=True)]
    body = {"max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: _post(server.url, {**body, "prompt": p}), prompts))
    got = [json.loads(b)["choices"][0]["token_ids"] for _, b in outs]
    assert got == want
    usage = json.loads(outs[0][1])["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 5
    assert json.loads(outs[0][1])["kv_transfer_params"] is None  # no connector
    status, raw = _post(server.url, {**body, "prompt": [prompts[1]], "stream": True,
                                     "stream_options": {"include_usage": True}})
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] \
        == want[1]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    status, raw = _post(server.url, {**body, "prompt": "a text prompt"})  # tokenized
    assert status == 200 and len(json.loads(raw)["choices"][0]["token_ids"]) == 5


@pytest.mark.parametrize("body,field", [
    ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ({"prompt": [1, 2], "kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"prompt": [1, 10**9]}, "out of range"),  # refused by the engine, still a 400
    ({"prompt": [1, 2], "top_p": 0}, "top_p"),
])
def test_bad_bodies_are_400_naming_the_field(server, body, field):
    status, raw = _post(server.url, body)
    assert status == 400 and field in json.loads(raw)["error"]["message"], raw


def test_parse_and_prefill_body():
    with pytest.raises(BadRequest, match="JSON object"):
        parse_completion([1])
    req = parse_completion({"prompt": [[3, 4]], "kv_transfer_params": {"a": 1}})
    assert req.prompt == [3, 4] and req.sampling["max_tokens"] == 16
    assert req.kv_transfer_params == {"a": 1} and not req.stream
    pb = prefill_body({"prompt": [1], "max_tokens": 50, "stream": True,
                       "stream_options": {"include_usage": True}})
    assert pb == {"prompt": [1], "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}}
