"""``lmc.reference.serve`` attacked as a careless or hostile client would: poisoned sampling
values, lone surrogates, numbers out of every range, deep nesting, lying Content-Length,
half-sent requests, slow-loris trickles and a socket flood at a low RLIMIT_NOFILE. Each
attack gets its own error (or a correct answer) and the next ordinary request is served.
Threat model: docs/threats/http.md.

Real servers on 127.0.0.1 (in-process, or a subprocess where RLIMIT_NOFILE is lowered),
real sockets, a tiny random-weight checkpoint (64 positions: a generation is short).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc.http.json_api import HttpLimits
from lmc.reference import LLM
from lmc.reference.serve import BadRequest, Server, _Job, parse_completion
from tests.deadlines import AT_ONCE_S, HANG_S, SLACK_S
from tests.http_attack_kit import (
    LIMITS,
    NORMAL,
    PATIENT,
    PROMPT,
    expected_tokens,
    flood_then_serve,
    low_nofile,
    message,
    post,
    read_answer,
    running_server,
    tiny_model,
    wait_for,
)
from tests.reference.ref_connector import InMemoryConnector
from tests.server.daemon_proc import ROOT


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


@pytest.fixture(scope="module")
def patient(ckpt):
    """A server whose read timeout only a hang reaches: what must happen before it, at
    once, is told from waiting for it whatever the machine's load."""
    with running_server(ckpt, PATIENT) as srv:
        yield srv


def assert_served(server: Server, want: list[int]) -> None:
    """The ordinary request after an attack: answered, with the right tokens."""
    status, raw = post(server.port, NORMAL)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want
    assert server.loop.alive


# ------------------------------------------------------------- poisoned requests

NESTED = b'{"prompt": [1, 2], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
FIELD_ERRORS = [  # (raw body, the field the 400 must name)
    (b'{"prompt": [1, 2, 3], "temperature": NaN}', "temperature"),
    (b'{"prompt": [1, 2, 3], "temperature": Infinity}', "temperature"),
    (b'{"prompt": [1, 2, 3], "temperature": -1e-300}', "temperature"),
    (b'{"prompt": [1, 2, 3], "top_p": NaN}', "top_p"),
    (b'{"prompt": [1, 2, 3], "top_p": -Infinity}', "top_p"),
    (b'{"prompt": "\\ud800 hi"}', "prompt"),
    (b'{"prompt": ["\\udfff"]}', "prompt"),
    (b'{"prompt": [1, 2, 3], "max_tokens": Infinity}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 1e999}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": NaN}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 18446744073709551616}', "max_tokens"),
    (b'{"prompt": [1, 2, 3], "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": [1, 2, 3], "seed": -18446744073709551616}', "seed"),
    (b'{"prompt": [1, 2, 3], "seed": 1.5}', "seed"),
    (b'{"prompt": [1, 2, 3], "stream": true, "stream_options": 5}', "stream_options"),
    (b'{"prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": 5}}',
     "include_usage"),
    (b'{"prompt": [1, 2, 3], "stream": "yes"}', "stream"),
    (b'{"prompt": [1, 2, 3], "model": {"a": 1}}', "model"),
    (b'{"prompt": [1, 99999999999999999999999]}', "out of range"),
    (NESTED, "nested"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
]


@pytest.mark.parametrize("body,field", FIELD_ERRORS,
                         ids=[f"{i}-{f}" for i, (_, f) in enumerate(FIELD_ERRORS)])
def test_bad_values_are_a_400_naming_the_field_and_the_next_request_is_served(
        server, want, body, field):
    status, raw = post(server.port, body)
    assert status == 400 and field in message(raw), raw[:300]
    assert_served(server, want)


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


# ----------------------------------------------------------------- the socket layer

@pytest.mark.parametrize("header,status,words", [
    (b"Content-Length: -1\r\n", 400, "Content-Length"),
    (b"Content-Length: abc\r\n", 400, "Content-Length"),
    (b"Content-Length: 1e3\r\n", 400, "Content-Length"),
    (b"", 411, "Content-Length required"),
    (b"Transfer-Encoding: chunked\r\n", 411, "Transfer-Encoding"),
    (b"Content-Length: 16777216\r\n", 413, "--max-body"),
    (b"Content-Length: " + b"9" * 5000 + b"\r\n", 413, "--max-body"),
])
def test_lying_content_length_is_answered_at_once_with_the_socket_left_open(
        patient, want, header, status, words):
    """The client sends its headers and keeps the socket open (no body, no FIN): the
    answer must come from the headers alone, before the read timeout."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", patient.port), timeout=HANG_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\n" + header + b"\r\n")
        got, raw = read_answer(s)
    assert got == status and words in message(raw), raw
    assert time.monotonic() - t0 < AT_ONCE_S  # not the read timeout's HANG_S
    assert_served(patient, want)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server, want):
    """16 MiB announced, 64 KiB sent (the limit is 256 KiB): the 413 comes while the client is still sending."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (16 << 20))
        with contextlib.suppress(OSError):
            s.sendall(b"0" * (64 << 10))
        status, raw = read_answer(s)
    assert status == 413, raw
    assert_served(server, want)


@pytest.mark.parametrize("partial", [
    b"POST /v1/comp",  # half a request line
    b"POST /v1/completions HTTP/1.0\r\nContent-Le",  # half the headers
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 100\r\n\r\n{\"prompt\"",  # half a body
])
def test_a_half_sent_request_is_dropped_after_the_read_timeout(server, want, partial):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) as s:
        s.sendall(partial)
        with contextlib.suppress(OSError):
            while s.recv(4096):
                pass
    assert time.monotonic() - t0 < LIMITS.read_timeout + SLACK_S  # not HANG_S
    assert_served(server, want)


def test_slow_loris_cannot_hold_a_connection_by_trickling(server, want):
    """A byte every 0.1 s keeps each read alive; the deadline is for the whole request
    (the trickle would last 60 s: a connection still open at the read timeout plus
    ``SLACK_S`` was not dropped by it)."""
    t0 = time.monotonic()
    closed = False
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) as s:
        for b in b"POST /v1/completions HTTP/1.0\r\nX-Pad: " + b"a" * 600:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > LIMITS.read_timeout + SLACK_S:
                break
        if not closed:
            s.setblocking(False)  # closed by now, or never
            try:
                closed = s.recv(1) == b""
            except BlockingIOError:
                closed = False
            except ConnectionError:
                closed = True
    assert closed
    assert_served(server, want)
    assert_served(server, want)


def test_at_the_connection_cap_silent_sockets_give_way_to_real_requests(patient, want):
    """3x the cap of connections that never finish their request line: the oldest ones are
    displaced, so a real client is still served at once (no wait for the read timeout)."""
    socks = []
    try:
        for _ in range(3 * PATIENT.max_connections):
            s = socket.create_connection(("127.0.0.1", patient.port), timeout=HANG_S)
            s.sendall(b"POST /v1/comp")
            socks.append(s)
        t0 = time.monotonic()
        assert_served(patient, want)
        assert time.monotonic() - t0 < AT_ONCE_S  # not the read timeout's HANG_S
        assert len(patient.httpd.conns) <= patient.httpd.cap
    finally:
        for s in socks:
            s.close()


def test_a_flood_at_nofile_128_leaves_the_server_serving_everyone(ckpt, want, tmp_path):
    """The server in its own process at RLIMIT_NOFILE 128 (the issue's setting): 300 half-
    sent request lines, then an ordinary client is served, and the server still runs."""
    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmc.reference.serve", "--model", str(ckpt), "--port", "0",
             "--num-blocks", "32", "--ready-file", str(ready)], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
            stderr=err, preexec_fn=low_nofile)
        try:
            wait_for(ready, proc, log)
        except BaseException:
            proc.kill()
            raise
        port = json.loads(ready.read_text())["port"]
        flood_then_serve(proc, port, log, want, [body for body, _ in FIELD_ERRORS])


@pytest.mark.parametrize("kw,words", [
    ({"max_connections": 0}, "max_connections"), ({"read_timeout": 0}, "read_timeout"),
    ({"read_timeout": math.inf}, "read_timeout"), ({"read_timeout": math.nan}, "read_timeout"),
    ({"max_body": 0}, "max_body")])
def test_limits_out_of_range_are_refused_by_name(kw, words):
    with pytest.raises(ValueError, match=words):
        HttpLimits(**kw)


# ------------------------------------------------------------------ fuzzing

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["\ud800", 2**64, -(2**64), 1e-300, 5e-324]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stream",
          "stream_options", "return_token_ids", "kv_transfer_params", "model"]
SURROGATES = st.sampled_from(["\ud800", "a\udfff b", "\udbff\udc00"])  # lone and a pair
PROMPTS = (st.lists(st.integers(0, 2047), min_size=1, max_size=8) | st.text(max_size=8)
           | SURROGATES | JSON)
BODIES = st.fixed_dictionaries({"prompt": PROMPTS}, optional={
    f: st.integers(-3, 70) | JSON if f in ("max_tokens", "seed") else JSON
    for f in FIELDS[1:]}) | JSON


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


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(BODIES)
def test_fuzz_the_server_answers_200_or_a_4xx_with_a_message(server, body):
    """Random bodies at the live server: 200, or a 4xx with a message, within 20 s."""
    status, raw = post(server.port, json.dumps(body).encode())
    if status == 200:
        if raw.startswith(b"data: "):
            assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
        else:
            assert json.loads(raw)["choices"], raw
    else:
        assert 400 <= status < 500 and message(raw), (status, raw[:300])
    assert server.loop.alive
