"""Replay against an OpenAI-compatible server (vLLM with lmc, or any other) over HTTP.

Each request is a streaming ``POST /v1/completions`` (standard library only): the first
streamed choice is the first token, so TTFT is what a client sees. The final usage chunk
(``stream_options.include_usage``) gives prompt tokens and, where the server reports it
(vLLM's ``--enable-prompt-tokens-details``), the prompt tokens it did not compute.

Per-tier hit tokens come from the server's own lmc counters: vLLM with lmc exports them on
``/metrics`` as ``lmc:connector_total{stat="tokens_from_<tier>"}`` (see
``lmc/connectors/vllm/stats.py``); lmc's reference server (``python -m lmc.reference.serve``)
on ``/lmc/stats``. They are server-wide counters, read before and after the
replay (and about once a second for the timeline); a server without them gets "unknown",
never an estimate.

The server is not trusted to answer well: pages and stream lines are read up to a bound,
parsed by :func:`lmc.workloads.inputs.parse_json` (depth-bounded) and type-checked, and a
request whose answer is malformed is recorded as failed while the replay goes on (threat
model: ``docs/threats/cli.md``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmc.bounded_io import read_at_most
from lmc.remote_counters import counter, counters, json_page
from lmc.storage import funnel_report
from lmc.workloads.dispatch import Dispatcher
from lmc.workloads.inputs import parse_json, printable
from lmc.workloads.replay import Progress, ReplayResult, RequestRecord, SessionHints
from lmc.workloads.trace import TraceRequest

METRIC = "lmc:connector_total"
MAX_PAGE_BYTES = 16 << 20  # /v1/models, /metrics, /lmc/stats
MAX_EVENT_BYTES = 1 << 20  # one line of a completion stream
MAX_STREAM_TOKENS = 1 << 21  # token ids one answer may stream (twice the longest output_len)
_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')
_STAT = re.compile(r'stat="([^"]*)"')


class Endpoint:
    """``http://host:port`` (a path prefix such as ``/api`` is kept)."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--target {url!r}: expected http://host:port")
        self.url = url.rstrip("/")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port
        self.prefix = u.path.rstrip("/")
        self.timeout = timeout

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = self.connect(timeout)
        try:
            conn.request("GET", self.prefix + path)
            resp = conn.getresponse()
            body = read_at_most(resp, MAX_PAGE_BYTES)
            if len(body) > MAX_PAGE_BYTES:
                raise OSError(f"{self.url}{path} answered more than {MAX_PAGE_BYTES >> 20} MiB")
            return resp.status, body
        finally:
            conn.close()

    def model(self) -> str:
        """The first model the server lists (``GET /v1/models``)."""
        where = f"{self.url}/v1/models"
        status, body = self.get("/v1/models")
        if status != 200:
            raise OSError(f"{where} answered HTTP {status}; pass --model")
        page = parse_json(body.decode("utf-8", "replace"), where)
        data = page.get("data") if isinstance(page, dict) else None
        if not data:
            raise OSError(f"{where} lists no model; pass --model")
        first = data[0] if isinstance(data, list) else None
        if not isinstance(first, dict) or not isinstance(first.get("id"), str) \
                or not first["id"].isprintable():
            raise OSError(f"{where} is not an OpenAI model list; pass --model")
        return first["id"]


def parse_tier_metrics(text: str) -> tuple[dict[str, float], float | None] | None:
    """``{tier: tokens}`` and load failures from a Prometheus text page, summed over label
    sets (engines, ranks); None when the page has no lmc connector counters."""
    tiers: dict[str, float] = {}
    failures: float | None = None
    found = False
    for line in text.splitlines():
        if not line.startswith(METRIC):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) != METRIC:
            continue
        found = True
        stat = _STAT.search(m.group(2) or "")
        if stat is None:
            continue
        value = counter(m.group(3))
        if value is None:
            continue
        name = stat.group(1)
        if name.startswith("tokens_from_"):
            tier = name.removeprefix("tokens_from_")
            tiers[tier] = tiers.get(tier, 0.0) + value
        elif name == "load_failures":
            failures = (failures or 0.0) + value
    return (tiers, failures) if found else None


def parse_lmc_stats(stats: Any) -> tuple[dict[str, float], float | None] | None:
    """The same figures from an ``/lmc/stats`` JSON page (the reference engine's server:
    its connector's flat counters, ``worker.tokens_from_<tier>``); None if not such a page."""
    if not isinstance(stats, dict):
        return None
    known = counters(stats)  # a value no counter holds is unknown, left out
    tiers = {k.removeprefix("worker.tokens_from_"): v for k, v in known.items()
             if k.startswith("worker.tokens_from_")}
    return tiers, known.get("worker.load_failures")


class _Scraper:
    """Reads the server's lmc counters: ``lmc:connector_total`` on ``/metrics`` (vLLM with
    lmc), else ``/lmc/stats`` (lmc's reference server). ``found`` turns true once either
    has carried them: vLLM creates its series only when a count first becomes non-zero, so a
    fresh server shows none before the replay and counts from zero."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.found = False
        self.source = ""
        self.why_unknown: str | None = None

    def read(self) -> tuple[dict[str, float], float | None] | None:
        """Counters now (zeros while none are exported); None when neither page answers."""
        problems: list[str] = []
        for path in ("/metrics", "/lmc/stats"):
            if self.source and self.source != path:
                continue  # settled on the other page
            try:
                status, body = self.ep.get(path, timeout=10)
            except OSError as e:
                problems.append(f"{path} unreachable ({e})")
                continue
            if status != 200:
                problems.append(f"{path} answered HTTP {status}")
                continue
            text = body.decode("utf-8", "replace")
            if path == "/metrics":
                got = parse_tier_metrics(text)
                if got is None:
                    problems.append(f"{path} has no {METRIC}")
                    continue
            else:
                page = json_page(text, path)
                got = parse_lmc_stats(page) if page else None
                if got is None:
                    problems.append(f"{path} is empty (no lmc connector)" if page == {}
                                    else f"{path} is not lmc's stats")
                    continue
            self.found, self.source = True, path
            return got
        self.why_unknown = f"unknown: {self.ep.url}: " + "; ".join(problems)
        if self.source or any("has no" in p for p in problems):
            return {}, None  # a page that may carry the counters once there is traffic
        return None


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {t: v - before.get(t, 0.0) for t, v in sorted(after.items())}


def _body(req: TraceRequest, model: str, vllm_extras: bool,
          hints: SessionHints | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt_tokens if req.prompt_tokens is not None else req.prompt_text,
        "max_tokens": req.output_len, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if vllm_extras:  # generate exactly output_len tokens; return them for comparisons
        body.update(ignore_eos=True, return_token_ids=True)
    kv = None if hints is None else hints.params(req)
    if kv is not None:  # cache hints, in vLLM's field (lmc's connectors read them there)
        body["kv_transfer_params"] = kv
    return body


class _Open:
    """Sockets of the streams in flight, so an interrupted replay can cut them and free its
    threads at once instead of waiting for every answer to end. (Sockets, not connections:
    http.client drops a connection's socket once an HTTP/1.0 response owns it.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.closed = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            if self.closed:
                raise OSError("replay interrupted")
            self._socks.add(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            socks, self._socks = list(self._socks), set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on the stream


def _events(resp: http.client.HTTPResponse, deadline: float) -> Any:
    """The JSON objects of a server-sent event stream up to ``[DONE]``; a line past
    MAX_EVENT_BYTES, a stream past the deadline or an event that is not an object is a
    ValueError (the request fails, the replay goes on)."""
    while True:
        raw = resp.readline(MAX_EVENT_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_EVENT_BYTES:
            raise ValueError(f"a stream line longer than {MAX_EVENT_BYTES >> 20} MiB")
        if time.perf_counter() > deadline:
            raise ValueError("the stream went on past --timeout")
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event = parse_json(data.decode("utf-8", "replace"), "stream event")
        if not isinstance(event, dict):
            raise ValueError(f"stream event: expected a JSON object, got {type(event).__name__}")
        yield event


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    """``obj[key]`` as a list (absent or null: empty); ``choices`` hold objects,
    ``token_ids`` whole numbers >= 0."""
    value = obj.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list")
    want = dict if key == "choices" else int
    if not all(isinstance(v, want) and not isinstance(v, bool) for v in value) \
            or (want is int and any(v < 0 for v in value)):
        raise ValueError(f"{key}: expected a list of {'objects' if want is dict else 'ids'}")
    return value


def _count(obj: dict[str, Any], key: str) -> int | None:
    """A token count the server reported: a whole number >= 0 below 2**63, or absent."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"usage.{key}: expected a token count, got {printable(repr(value), 40)}")
    return value


def send(ep: Endpoint, req: TraceRequest, model: str, vllm_extras: bool, rec: RequestRecord,
         t_due: float, open_: _Open | None = None, hints: SessionHints | None = None) -> None:
    """One streaming completion; fills ``rec`` (times from ``t_due``, a perf_counter)."""
    conn = ep.connect()
    sock: socket.socket | None = None
    try:
        if open_ is not None:
            conn.connect()
            sock = conn.sock
            open_.add(sock)
        conn.request("POST", ep.prefix + "/v1/completions",
                     body=json.dumps(_body(req, model, vllm_extras, hints)).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(2000).decode("utf-8", "replace").strip()
            rec.error = f"HTTP {resp.status}: {detail[:300]}"
            return
        ids: list[int] = []
        chunks = 0
        for event in _events(resp, time.perf_counter() + ep.timeout):
            if "error" in event:
                rec.error = f"server error: {printable(str(event['error']), 300)}"
                return
            for choice in _list(event, "choices"):
                got = _list(choice, "token_ids")
                # a chunk with nothing in it (some servers open with one) is not a token
                if not (got or choice.get("text") or choice.get("finish_reason")):
                    continue
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t_due
                chunks += 1
                if len(ids) + len(got) > MAX_STREAM_TOKENS:
                    raise ValueError(f"the stream sent more than {MAX_STREAM_TOKENS} tokens")
                ids.extend(got)
            usage = event.get("usage")
            if usage:
                if not isinstance(usage, dict):
                    raise ValueError("usage: expected an object")
                rec.prompt_tokens = _count(usage, "prompt_tokens")
                rec.output_tokens = _count(usage, "completion_tokens") or 0
                details = usage.get("prompt_tokens_details") or {}
                if not isinstance(details, dict):
                    raise ValueError("usage.prompt_tokens_details: expected an object")
                if details.get("cached_tokens") is not None:
                    rec.cached_tokens = _count(details, "cached_tokens")
        rec.latency_s = time.perf_counter() - t_due
        if rec.ttft_s is None:
            rec.error = "the stream ended without a token"
        if not rec.output_tokens:
            rec.output_tokens = len(ids) or chunks
        if ids:
            rec.output_ids = ids
        if rec.prompt_tokens is None and req.prompt_tokens is not None:
            rec.prompt_tokens = len(req.prompt_tokens)
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec.error = f"{type(e).__name__}: {printable(str(e), 300)}"
    finally:
        if open_ is not None and sock is not None:
            open_.discard(sock)
        conn.close()


def replay_http(requests: Sequence[TraceRequest], url: str, *, model: str | None = None,
                fast: bool = False, concurrency: int | None = None,
                progress: Progress | None = None, vllm_extras: bool = True,
                timeout: float = 600.0, scrape_every: float = 1.0,
                hints: SessionHints | None = None) -> ReplayResult:
    """Replay ``requests`` against the server at ``url``; a request's failure (HTTP error,
    timeout, broken stream) is recorded on it and the replay goes on."""
    ep = Endpoint(url, timeout)
    model = model or ep.model()
    scraper = _Scraper(ep)
    before = scraper.read()
    read_funnel = funnel_report.http_reader(lambda path: ep.get(path, timeout=10))
    funnel_before = read_funnel()
    records = {r.request_id: RequestRecord(r.request_id, r.session_id, r.prefix_group, 0.0)
               for r in requests}
    records_text = {r.request_id: r.prompt_tokens is None for r in requests}
    disp = Dispatcher(requests, fast=fast, concurrency=concurrency)
    done_q: queue.Queue[RequestRecord] = queue.Queue()
    workers = min(512, concurrency or max(1, len(records)))
    timeline: list[tuple[float, float, dict[str, float]]] = []
    sent_prompt = 0.0
    start = time.perf_counter()
    if before is not None:
        timeline.append((0.0, 0.0, {t: 0.0 for t in before[0]}))
    next_scrape = start + scrape_every
    open_ = _Open()

    def run(req: TraceRequest, rec: RequestRecord) -> None:
        try:
            send(ep, req, model, vllm_extras, rec, start + rec.due_s, open_, hints)
        except Exception as e:  # a bug or an answer no check foresaw: this request fails,
            rec.error = f"{type(e).__name__}: {printable(str(e), 300)}"  # the replay goes on
        finally:
            done_q.put(rec)  # always: the dispatcher waits for every request

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmc-replay")
    finished: list[RequestRecord] = []
    interrupted = False
    try:
        while not disp.all_done:
            now = time.perf_counter()
            for req in disp.ready(now - start):
                rec = records[req.request_id]
                rec.due_s = disp.due[req.request_id]
                if req.prompt_tokens is not None:
                    sent_prompt += len(req.prompt_tokens)
                pool.submit(run, req, rec)
            if before is not None and now >= next_scrape:
                got = scraper.read()
                if got is not None:
                    timeline.append((now - start, sent_prompt, _delta(got[0], before[0])))
                next_scrape = now + scrape_every
            nxt = disp.next_due()
            wait = next_scrape - now if before is not None else 1.0
            if nxt is not None:
                wait = min(wait, nxt - (now - start))
            try:
                rec = done_q.get(timeout=max(0.0, wait))
            except queue.Empty:
                continue
            t_done = time.perf_counter() - start
            disp.done(rec.request_id, t_done)
            finished.append(rec)
            if rec.prompt_tokens and records_text[rec.request_id]:
                sent_prompt += rec.prompt_tokens  # a text prompt's length: known now
            if progress is not None:
                progress(rec, disp.finished, len(records))
    except KeyboardInterrupt:  # Ctrl-C: what finished is reported
        interrupted = True
    finally:  # normally all done; interrupted: streams cut, queued requests dropped
        open_.close_all()
        pool.shutdown(wait=True, cancel_futures=True)
    duration = time.perf_counter() - start
    tier_tokens, failures, source = _final_counters(scraper, before,
                                                    settle_s=1.0 if interrupted else 10.0)
    if tier_tokens is None:
        timeline = []
    else:
        timeline.append((duration, sent_prompt, tier_tokens))
    done = finished if interrupted else list(records.values())
    res = ReplayResult(url, "fast" if fast else "timed", done, duration, tier_tokens, source,
                       failures, timeline, interrupted, len(records))
    res.funnel = funnel_report.view(funnel_report.delta(read_funnel(), funnel_before))
    return res


def _final_counters(scraper: _Scraper, before: Any, settle_s: float = 10.0
                    ) -> tuple[dict[str, float] | None, float | None, str]:
    """Counters after the replay: vLLM hands the worker's counts over with a later step,
    so read until two reads a second apart agree (``settle_s`` at most: 10 s, 1 s after a
    Ctrl-C, when the person is waiting for the summary)."""
    if before is None:
        return None, None, scraper.why_unknown or "unknown"
    last: tuple[dict[str, float], float | None] | None = None
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        got = scraper.read()
        if got is None:
            return None, None, scraper.why_unknown or "unknown"
        if got == last:
            break
        last = got
        time.sleep(1.0)
    if last is None or not scraper.found:
        return None, None, scraper.why_unknown or "unknown"
    failures = None if last[1] is None and before[1] is None else \
        (last[1] or 0.0) - (before[1] or 0.0)
    what = METRIC if scraper.source == "/metrics" else "lmc's counters"
    return (_delta(last[0], before[0]), failures,
            f"{what} from {scraper.ep.url}{scraper.source} (server-wide: other clients' "
            "traffic during the replay is counted too)")
