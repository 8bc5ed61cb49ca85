"""``lmc plan --codec``: a disk tier holding KV through a codec holds more of it, so a trace
whose working set overflows the disk hits more; the capacity is said on stderr; a bad codec
is one line naming the flag (exit 2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from .test_cli_steps import lmc


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Twelve 1,024-token documents, each asked twice, the second round after all firsts:
    the second round hits only what the tiers still hold."""
    rng = random.Random(5)
    docs = [[rng.randrange(2, 2000) for _ in range(1024)] for _ in range(12)]
    with (tmp_path / "t.jsonl").open("w") as f:
        for i, d in enumerate(docs + docs):
            f.write(json.dumps({"arrival_s": i, "request_id": f"r{i}", "prompt_tokens": d,
                                "output_len": 1}) + "\n")
    return tmp_path / "t.jsonl"


def _hit_rate(out: str) -> float:
    rows = json.loads(out)["results"]
    assert len(rows) == 1
    return rows[0]["hit_rate"]["total"]


def test_a_codec_holds_more_and_hits_more(trace: Path) -> None:
    # 512 B/token: a document is 512 KiB; L1 holds 2, the disk 4 raw (bf16) or 12 as int4
    common = ("plan", trace, "--no-ttft", "--json", "--kv-bytes-per-token", "512",
              "--l1", "1MiB", "--disk", "2MiB", "--jobs", "1")
    plain = lmc(*common, cwd=trace.parent)
    coded = lmc(*common, "--codec", "int4-kivi", "--head-size", "64", cwd=trace.parent)
    assert plain.returncode == 0 and coded.returncode == 0, (plain.stderr, coded.stderr)
    assert "codec int4-kivi.g32.h64 stores 0.31" in coded.stderr
    assert "2.00 MiB disk holds 6.40 MiB" in coded.stderr, coded.stderr
    assert _hit_rate(coded.stdout) > _hit_rate(plain.stdout) + 0.15


def test_a_bad_codec_is_named(trace: Path) -> None:
    out = lmc("plan", trace, "--no-ttft", "--codec", "int5", cwd=trace.parent)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--codec: unknown codec 'int5'" in out.stderr, out.stderr
