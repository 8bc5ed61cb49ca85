"""``lmc.bounded_io``: a bound of N bytes must not cost N bytes before anything is read.

Measured with ``tracemalloc`` (the allocations Python made, whatever their pages): reading a
100-byte file under a 1 GiB bound used to allocate the whole GiB (``f.read(limit + 1)``).
"""

from __future__ import annotations

import http.server
import os
import threading
import tracemalloc

import pytest

from lmc.bounded_io import read_at_most
from lmc.router.relay import read_bounded as relay_read
from lmc.workloads.inputs import InputError, read_bounded


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_small_file_under_a_huge_bound_allocates_what_it_holds(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"x" * 100)
    with open(path, "rb") as f:
        data, peak = _peak(lambda: read_at_most(f, 1 << 30))
    assert data == b"x" * 100
    assert peak < 4 << 20, f"{peak} bytes allocated to read 100"


def test_what_is_past_the_bound_is_cut_at_one_byte_more(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 << 20))
    with open(path, "rb") as f:
        assert read_at_most(f, 1 << 20) == path.read_bytes()[: (1 << 20) + 1]
    with open(path, "rb") as f:
        assert read_at_most(f, 3 << 20) == path.read_bytes()
    with open(path, "rb") as f, pytest.raises(InputError, match="larger than 1,048,576 bytes"):
        read_bounded(f, 1 << 20, "f")


def test_a_pipe_has_no_size_and_is_read_in_pieces():
    r, w = os.pipe()
    payload = os.urandom(5 << 20)

    def feed():
        with os.fdopen(w, "wb") as out:
            out.write(payload)

    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r, "rb") as f:
        data, peak = _peak(lambda: read_at_most(f, 1 << 30))
    t.join()
    assert data == payload
    assert peak < 3 * len(payload), peak  # the pieces and their join, not the bound


def test_a_file_grown_past_the_bound_is_refused_by_its_size(tmp_path):
    path = tmp_path / "g"
    path.write_bytes(b"a" * 1000)
    with open(path, "rb") as f:
        with open(path, "ab") as grow:  # after the size was known, before the read ends
            grow.write(b"b" * 2000)
        with pytest.raises(InputError, match="larger than 1,500 bytes"):
            # the size said 3000 already: refused by the size
            read_bounded(f, 1500, "g")


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b"y" * 1000

    def do_GET(self):
        self.send_response(200)
        self.end_headers()  # no Content-Length: read until the server closes
        self.wfile.write(self.body)
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_an_http_answer_without_length_allocates_what_arrived():
    import http.client

    server = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    t = threading.Thread(target=server.handle_request)
    t.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/")
        resp = conn.getresponse()
        data, peak = _peak(lambda: relay_read(resp, 1 << 30, "upstream"))
        conn.close()
    finally:
        t.join(10)
        server.server_close()
    assert data == _Answer.body
    assert peak < 4 << 20, f"{peak} bytes allocated for a 1000-byte answer"
