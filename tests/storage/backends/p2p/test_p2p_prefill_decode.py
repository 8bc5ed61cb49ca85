"""Prefill on one reference-engine process, decode on another: the decode instance's lookup
finds the prompt's KV in the prefill instance's pool (the daemon's directory) and READs it
over NIXL; its greedy tokens equal a single instance's (fp32), and it computed only the
prompt's last token itself. This is the prefill/decode flow as a plain pull on a local miss
(no roles); the asynchronous ``kv_producer``/``kv_consumer`` roles are tested in
``test_pd_proxy.py`` (reference engine) and ``test_vllm_prefill_decode.py`` (vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmc.reference import make_tiny_checkpoint
from tests.server.daemon_proc import ROOT, DaemonProc

from .conftest import require_nixl

pytestmark = pytest.mark.integration
PROMPT = 300  # four 64-token chunks and 44 tokens


def _answer(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("@lmc "):
            return json.loads(line[5:])
    raise RuntimeError(f"{proc.args[3]} instance ended (rc={proc.wait(10)})")


def test_decode_instance_pulls_the_prefill_instances_kv(tmp_path):
    require_nixl()
    ckpt = make_tiny_checkpoint(tmp_path / "llama")
    d = DaemonProc(tmp_path / "d", ["--size", "8MiB"]).start()
    url = f"p2p+lmc://127.0.0.1:{d.info['port']}?ns=pd"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    log = open(tmp_path / "instances.log", "ab")  # noqa: SIM115

    def start(role: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.storage.backends.p2p.pd_proc", role, url,
                                 str(ckpt), str(PROMPT)], cwd=ROOT, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    procs = []
    try:
        procs.append(prefill := start("prefill"))
        ready = _answer(prefill)
        assert ready == {"ready": True, "cached": 0, "exports": 5}, ready
        procs.append(decode := start("decode"))
        got = _answer(decode)
        assert decode.wait(60) == 0
        prefill.stdin.close()
        assert prefill.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        d.kill()
        log.close()
    assert got["tokens"] == got["want"], got
    # every prompt token's KV came from the prefill instance (all five chunks, the partial
    # last one too); the decode instance computed only the last prompt token
    assert got["cached"] == PROMPT - 1 and got["p2p_hits"] == 5, got
    assert got["p2p_bytes"] > 0 and got["p2p_bytes"] % PROMPT == 0, got
