"""``lmc replay`` against a lying server: a loopback HTTP server started here answers
``/v1/models``, ``/v1/completions`` and the counter pages with JSON that is nested 100,000
deep, of the wrong type, past every C integer, or endless. The real ``lmc replay`` process
must finish (never hang on a request whose worker died), count a bad answer as that request's
failure, and end a bad model list or counter page with a named line, never a traceback.

Threat model: docs/threats/cli.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000
Answer = Callable[[BaseHTTPRequestHandler], None]


def _page(body: str | bytes, status: int = 200) -> Answer:
    data = body.encode() if isinstance(body, str) else body

    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return answer


def _stream(*events: bytes) -> Answer:
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        for e in events:
            h.wfile.write(e)
        h.close_connection = True

    return answer


GOOD_TOKEN = b'data: {"choices":[{"text":"a","token_ids":[5]}]}\n\n'
GOOD_STREAM = _stream(GOOD_TOKEN, b'data: {"choices":[],"usage":{"prompt_tokens":3,'
                      b'"completion_tokens":1}}\n\n', b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    """``start(**answers)``: a server whose paths answer as given (404 elsewhere)."""
    servers: list[ThreadingHTTPServer] = []

    def start(**answers: Answer) -> str:
        routes = {"/" + k.replace("__", "/").replace("_", "."): v for k, v in answers.items()}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                route = routes.get(self.path)
                if route is None:
                    _page("no", 404)(self)
                else:
                    route(self)

            do_GET = do_POST = _serve

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _replay(tmp_path: Path, url: str, *flags: str, requests: int = 3
            ) -> subprocess.CompletedProcess:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0, "request_id": f"r{i}",
                                         "prompt_tokens": [1, 2, 3], "output_len": 1}) + "\n"
                             for i in range(requests)))
    return subprocess.run([sys.executable, "-m", "lmc.cli", "replay", str(trace), "--target",
                           url, "--fast", "--timeout", "20", "--records",
                           str(tmp_path / "rec.jsonl"), *flags], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=90)


def _errors(tmp_path: Path) -> list[str | None]:
    lines = (tmp_path / "rec.jsonl").read_text().splitlines()
    return [json.loads(line)["error"] for line in lines]


@pytest.mark.parametrize("event, named", [
    (b"data: " + DEEP.encode() + b"\n\n", "JSON nested deeper than 32"),
    (b"data: [1, 2]\n\n", "expected a JSON object, got list"),
    (b'data: {"choices": [5]}\n\n', "choices: expected a list of objects"),
    (b'data: {"choices": [{"token_ids": [-1, "x"]}]}\n\n', "token_ids: expected a list of ids"),
    (b'data: {"choices": [], "usage": {"prompt_tokens": [3]}}\n\n', "usage.prompt_tokens"),
    (b'data: {"choices": [], "usage": {"completion_tokens": ' + b"9" * 30 + b"}}\n\n",
     "usage.completion_tokens"),
    (b"data: {" + b" " * (2 << 20) + b"}\n\n", "a stream line longer than 1 MiB"),
], ids=["deep", "list", "choice-int", "bad-ids", "usage-list", "usage-huge", "endless-line"])
def test_a_malformed_stream_fails_its_request_and_the_replay_finishes(tmp_path, server, event,
                                                                      named):
    url = server(v1__completions=_stream(GOOD_TOKEN, event, b"data: [DONE]\n\n"))
    out = _replay(tmp_path, url, "--model", "m")
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)  # all failed
    errors = _errors(tmp_path)
    assert len(errors) == 3 and all(e and named in e for e in errors), errors


def test_a_good_stream_still_replays(tmp_path, server):
    url = server(v1__completions=GOOD_STREAM)
    out = _replay(tmp_path, url, "--model", "m")
    assert out.returncode == 0, out.stderr
    assert _errors(tmp_path) == [None, None, None]


@pytest.mark.parametrize("models, named", [
    (DEEP, "/v1/models: JSON nested deeper than 32"),
    ("[1]", "/v1/models lists no model"),
    ('{"data": [{"id": ["m"]}]}', "/v1/models is not an OpenAI model list"),
    ('{"data": {"id": 1}}', "/v1/models is not an OpenAI model list"),
    ('{"data": [], "data": [{"id": "m"}]}', "/v1/models: data: key given twice"),
], ids=["deep", "list", "id-list", "data-object", "duplicate"])
def test_a_lying_model_list_is_named(tmp_path, server, models, named):
    url = server(v1__models=_page(models), v1__completions=GOOD_STREAM)
    out = _replay(tmp_path, url)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2 and named in out.stderr, (out.returncode, out.stderr)


@pytest.mark.parametrize("route, page", [
    ("lmc__stats", DEEP), ("lmc__stats", '{"worker.tokens_from_cpu": ' + "9" * 400 + "}"),
    ("lmc__stats", '{"worker.load_failures": "x", "worker.tokens_from_cpu": [1]}'),
    ("metrics", 'lmc:connector_total{stat="tokens_from_cpu"} NaNx\n'),
], ids=["stats-deep", "stats-huge", "stats-strings", "metrics-not-a-number"])
def test_a_lying_counter_page_means_unknown_hits_not_a_crash(tmp_path, server, route, page):
    url = server(v1__completions=GOOD_STREAM, **{route: _page(page)})
    out = _replay(tmp_path, url, "--model", "m")
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert _errors(tmp_path) == [None, None, None]
