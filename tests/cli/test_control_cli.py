"""``lmc cache`` (lmc/control_cli.py) against a real reference server with lmc and a real
daemon: pin, priority, delete, clear and prefetch by prompt over the server's admin endpoint,
clear of a daemon namespace with a tenant's token, another tenant's namespace refused; every
mistake one line and exit status 2, a refusal exit status 1."""

from __future__ import annotations

import json
import os
import threading

import pytest
import yaml

from lmc.cli import main
from lmc.connectors.reference.connector import LMCReferenceConnector
from lmc.reference import LLM
from lmc.reference.serve import Server
from tests.http.kit import NORMAL, PATIENT, PROMPT, post, tiny_model
from tests.server import wire as W
from tests.server.daemon_proc import DaemonProc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_model(tmp_path_factory.mktemp("cli"))
    conn = LMCReferenceConnector({"chunk_size": 4, "local_cpu_size": "8MiB",
                                  "local_cpu_prefault": "off", "pin_memory": "false"},
                                 model_dir=ckpt)
    srv = Server(LLM(ckpt, num_blocks=32, kv_connector=conn), limits=PATIENT)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()


def lmc(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["cache", *argv])
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err.strip()


def test_cache_ops_by_prompt_against_a_server(server, capsys):
    assert post(server.port, NORMAL)[0] == 200
    eng = server.llm.kv_connector.engine
    ids = ",".join(map(str, PROMPT))
    rc, out, err = lmc(capsys, "pin", "--server", server.url, "--tokens", ids, "--ttl", "2m",
                       "--session", "s1", "--priority", "2")
    assert rc == 0 and out.startswith("lmc cache pin: pinned 8 of 8 tokens"), (out, err)
    assert eng.stats()["ttl_pinned_chunks"] == 2
    rc, out, _ = lmc(capsys, "unpin", "--server", server.url, "--session", "s1")
    assert rc == 0 and out == "lmc cache unpin: unpinned 2 chunks"
    rc, out, _ = lmc(capsys, "priority", "--server", server.url, "--tokens", ids,
                     "--priority", "-3")
    assert rc == 0 and "priority set on 2 chunks" in out
    rc, out, _ = lmc(capsys, "delete", "--server", server.url, "--tokens", ids, "--json")
    assert rc == 0 and json.loads(out) == {"deleted": 2}
    assert eng.lookup(PROMPT) == 0
    rc, out, _ = lmc(capsys, "prefetch", "--server", server.url, "--tokens", ids)
    assert rc == 0 and "prefetch of 8 tokens queued" in out
    rc, out, _ = lmc(capsys, "clear", "--server", server.url)
    assert rc == 0 and out.startswith("lmc cache clear: cleared cpu:")


def test_mistakes_and_refusals_are_one_line(server, capsys, tmp_path):
    for argv, words in ((["pin", "--server", server.url, "--tokens", "1,2"], "needs --ttl"),
                        (["pin", "--server", server.url, "--tokens", "1,x", "--ttl", "1"],
                         "comma-separated integers"),
                        (["pin", "--server", server.url, "--tokens", "1", "--ttl", "soon"],
                         "--ttl"),
                        (["delete", "--daemon", "lmc://127.0.0.1:1", "--tokens", "1"],
                         "needs an engine's server"),
                        (["clear", "--daemon", "lmc://127.0.0.1:1"], "needs its namespace"),
                        (["delete", "--server", server.url, "--prompt-file",
                          str(tmp_path / "none")], "cannot read it")):
        rc, _, err = lmc(capsys, *argv)
        assert rc == 2 and words in err and "\n" not in err and "Traceback" not in err, err
    rc, _, err = lmc(capsys, "pin", "--server", server.url, "--tokens", "1,2", "--ttl", "2h")
    assert rc == 1 and "refused pin (400)" in err and "max_pin_ttl" in err, err
    rc, _, err = lmc(capsys, "clear", "--server", "http://127.0.0.1:1")
    assert rc == 1 and "cannot reach" in err


def test_clear_a_daemon_namespace_with_a_tenants_token(tmp_path, capsys):
    secrets = {n: f"{n}-{os.urandom(8).hex()}" for n in ("alpha", "beta")}
    for n, s in secrets.items():
        (tmp_path / n).write_text(s + "\n")
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump({"tokens": [
        {"token_file": str(tmp_path / "alpha"), "namespaces": ["alpha"]},
        {"token_file": str(tmp_path / "beta"), "namespaces": ["beta"]}]}))
    d = DaemonProc(tmp_path / "d", ["--config", str(cfg), "--size", "64MiB"]).start()
    try:
        c = W.RawClient(d.port)
        assert c.call(W.hello(secrets["beta"]))[0] == 0
        keys = [bytes([9, i]) * 8 for i in range(3)]
        assert c.call(W.put("beta", [W.value_bytes("beta", k) for k in keys]))[0] == 0
        rc, _, err = lmc(capsys, "clear", "--daemon", f"{d.url}?ns=beta", "--token-file",
                         str(tmp_path / "alpha"))
        assert rc == 1 and "does not grant namespace" in err, err
        status, meta, _ = c.call(W.frame(0x12, {"ns": "beta", "keys": keys}))
        assert meta["present"] == b"\x01\x01\x01", "another tenant's clear removed values"
        rc, out, err = lmc(capsys, "clear", "--daemon", d.url, "--namespace", "beta",
                           "--token-file", str(tmp_path / "beta"))
        assert rc == 0 and out == "lmc cache clear: cleared namespace 'beta': 3 values", err
        status, meta, _ = c.call(W.frame(0x12, {"ns": "beta", "keys": keys}))
        assert meta["present"] == b"\x00\x00\x00"
        c.close()
    finally:
        d.kill()


def test_lmc_stats_prints_an_engine_servers_funnel(server, capsys):
    assert post(server.port, NORMAL)[0] == 200
    assert post(server.port, NORMAL)[0] == 200
    assert main(["stats", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "hit-rate funnel" in out and "lmc found" in out and "engine used" in out, out
    assert main(["stats", "--url", server.url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["engine_used"] > 0 and rows["prompt_tokens"] >= 16
    assert main(["stats", "--url", "http://127.0.0.1:1"]) == 2
