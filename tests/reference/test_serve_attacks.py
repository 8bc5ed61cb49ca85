"""``lmc.reference.serve`` attacked where only the engine's server can be: poisoned sampling
values that reach the sampler, failures inside the engine (at admission, in a connector's
per-request hooks, in a step, in the scheduler itself, in the sampler) that must fail one
request alone, and the request validator fuzzed on its own. What every HTTP front must
withstand (lying Content-Length, bodies over the limit, bad JSON and values, half-sent
requests, slow loris, the connection cap, a socket flood) is ``tests/http/test_attacks.py``,
which runs against this server too. Threat model: docs/threats/http.md.

Real servers on 127.0.0.1 (in-process), real sockets, a tiny random-weight checkpoint (64
positions: a generation is short).
"""

from __future__ import annotations

import json
import math
import socket
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from lmc.reference import LLM
from lmc.reference.serve import BadRequest, Server, _Job, parse_completion
from tests.http.kit import (
    BODIES,
    LIMITS,
    NORMAL,
    PROMPT,
    expected_tokens,
    message,
    post,
    running_server,
    tiny_model,
)
from tests.reference.ref_connector import InMemoryConnector


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("attacks"))


@pytest.fixture(scope="module")
def want(ckpt) -> list[int]:
    return expected_tokens(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt) as srv:
        yield srv


def assert_served(server: Server, want: list[int]) -> None:
    """The ordinary request after an attack: answered, with the right tokens."""
    status, raw = post(server.port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want
    assert server.loop.alive


# ------------------------------------------------------------- poisoned requests

@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e300])
@pytest.mark.parametrize("stream", [False, True])
def test_extreme_temperatures_sample_and_poison_nothing(server, want, temperature, stream):
    """1e-300 used to reach the sampler as 0 in fp32 (NaN probabilities): every later step
    failed. Any finite temperature > 0 samples; a tiny one is the greedy token."""
    status, raw = post(server.port, {**NORMAL, "temperature": temperature, "seed": 1,
                                     "stream": stream})
    assert status == 200, raw
    if stream:
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
        ids = [t for e in raw.split(b"\n\n") if e.startswith(b"data: {")
               for c in json.loads(e[6:])["choices"] for t in c.get("token_ids", [])]
    else:
        ids = json.loads(raw)["choices"][0]["token_ids"]
    assert len(ids) == 4
    if temperature < 1e-100:
        assert ids == want
    assert_served(server, want)


def test_an_admission_crash_fails_that_request_alone(server, want):
    """Whatever the engine raises for one request at admission (a TypeError here, as the
    tokenizer's for a lone surrogate was) is that request's 500; the loop thread lives."""
    from lmc.reference.request import SamplingParams
    job = server.loop.submit(_Job([object()], SamplingParams(max_tokens=2), None, None))
    assert job.done.wait(10), "the engine loop did not answer"
    assert job.status == 500 and "TypeError" in job.error
    assert_served(server, want)


class HostileConnector(InMemoryConnector):
    """A connector that breaks on a request's own ``kv_transfer_params`` (which come from
    the client): in each per-request hook, or in the step that schedules it."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.breaks_step: set[str] = set()

    @staticmethod
    def _attack(request) -> str:
        return (getattr(request, "kv_transfer_params", None) or {}).get("attack", "")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._attack(request) == "lookup":
            raise KeyError("remote_engine_id")
        if self._attack(request) == "step":
            self.breaks_step.add(request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if self._attack(request) == "alloc":
            raise TypeError("block_ids")
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request):
        if self._attack(request) == "finish":
            raise RuntimeError("export failed")
        return super().request_finished(request)

    def build_connector_meta(self, scheduler_output):
        if {r.request_id for r in scheduler_output.scheduled_requests} & self.breaks_step:
            raise RuntimeError("the step broke")
        return super().build_connector_meta(scheduler_output)


class Innocent:
    """Another client's streamed request, running while an attack happens."""

    def __init__(self, port: int, max_tokens: int = 40) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = json.dumps({**NORMAL, "max_tokens": max_tokens, "stream": True}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body), body))
        self.buf = b""
        while b"data: {" not in self.buf:  # its first token is out: it is in the engine
            chunk = self.sock.recv(65536)
            assert chunk, self.buf
            self.buf += chunk

    def tokens(self) -> list[int]:
        """The rest of its stream; its token ids (asserts it ended cleanly)."""
        with self.sock:
            while chunk := self.sock.recv(65536):
                self.buf += chunk
        body = self.buf.partition(b"\r\n\r\n")[2]
        assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body, body[-300:]
        return [t for e in body.split(b"\n\n") if e.startswith(b"data: {")
                for c in json.loads(e[6:])["choices"] for t in c.get("token_ids", [])]


def test_connector_failures_fail_only_their_request(ckpt, want):
    """Each per-request hook that raises fails that request alone (500 naming the hook)
    while another client's request runs on unharmed; a failing step fails the requests
    scheduled in it; later requests are served, and no request or block is left behind."""
    llm = LLM(ckpt, num_blocks=32, kv_connector=HostileConnector(16))
    with LLM(ckpt, num_blocks=32) as ref:
        long_want = ref.generate([PROMPT], max_tokens=40, ignore_eos=True)[0].token_ids
    srv = Server(llm, limits=LIMITS)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for attack, expect in (("lookup", "KeyError"), ("alloc", "TypeError")):
            other = Innocent(srv.port)
            status, raw = post(srv.port, {**NORMAL, "kv_transfer_params": {"attack": attack}})
            assert status == 500 and expect in message(raw), (attack, raw)
            assert other.tokens() == long_want
            assert_served(srv, want)
        status, raw = post(srv.port, {**NORMAL, "kv_transfer_params": {"attack": "step"}})
        assert status == 500 and "the step broke" in message(raw), raw
        assert_served(srv, want)
        status, raw = post(srv.port, {**NORMAL, "kv_transfer_params": {"attack": "finish"}})
        assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == want, raw
        assert llm.scheduler.requests == {} and llm.block_manager.num_free_blocks == 32
        assert srv.loop.failures == 0  # each failure was pinned on its request
    finally:
        srv.close()


def test_a_failure_pinned_on_no_request_resets_the_engine_and_it_serves_on(ckpt, want):
    """The last resort: the scheduler itself raises (as a bug would) while a stream runs.
    Every request in the engine gets a 500, the engine is emptied (no request or block
    left), the loop thread lives, and the next request is served."""
    llm = LLM(ckpt, num_blocks=32)
    srv = Server(llm, limits=LIMITS)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    schedule, calls = llm.scheduler.schedule, []

    def broken():  # the 5th step's schedule raises, once: the stream is mid-way then
        calls.append(1)
        if len(calls) == 5:
            raise AssertionError("scheduler invariant broken")
        return schedule()
    llm.scheduler.schedule = broken
    try:
        other = Innocent(srv.port)
        with pytest.raises(AssertionError, match="error"):
            other.tokens()
        assert b"scheduler invariant broken" in other.buf
        assert srv.loop.failures == 1 and srv.loop.alive
        assert llm.scheduler.requests == {} and llm.block_manager.num_free_blocks == 32
        assert_served(srv, want)
    finally:
        srv.close()


def test_a_request_the_sampler_cannot_serve_fails_alone_in_its_batch(ckpt):
    """Below the server: a request whose sampling raises (NaN temperature forced past the
    checks, as a sampler bug would) is finished with its error; the request batched with
    it gets the tokens it gets alone."""
    from lmc.reference.request import SamplingParams
    with LLM(ckpt, num_blocks=32) as llm:
        want = llm.generate([PROMPT], max_tokens=6, ignore_eos=True)[0].token_ids
        bad = SamplingParams(max_tokens=6, temperature=1.0)
        object.__setattr__(bad, "temperature", math.nan)
        bad_id = llm.add_request(PROMPT[:5], bad)
        good_id = llm.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
        outs = {}
        while llm.has_unfinished_requests():
            outs.update((o.request_id, o) for o in llm.step())
        assert outs[bad_id].finish_reason == "abort" and "sampling" in llm.pop_error(bad_id)
        assert outs[good_id].token_ids == want and llm.pop_error(good_id) is None
        assert llm.scheduler.requests == {} and llm.block_manager.num_free_blocks == 32


# ------------------------------------------------------------------ fuzzing

@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(BODIES)
def test_fuzz_the_validator_refuses_with_a_message_or_accepts(body):
    """Any JSON value: a ``Completion`` the engine can take, or ``BadRequest``; no other
    exception."""
    try:
        req = parse_completion(body)
    except BadRequest as e:
        assert str(e)
        return
    from lmc.reference.request import SamplingParams
    SamplingParams(**req.sampling)  # accepted values are valid for the engine too
