"""``lmc plan`` on a hybrid sliding-window/full checkpoint: its capacity counts what lmc
stores of the trace's prompts (sliding layers only around each prompt's checkpoints), not
every layer of every token."""

from __future__ import annotations

import json

from lmc.cli import main
from lmc.planner.calibrate import hybrid_bytes_per_token, kv_bytes_per_token
from lmc.reference import make_tiny_checkpoint


def test_plan_prices_what_a_hybrid_model_stores(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = make_tiny_checkpoint(tmp_path / "swa", hidden=64, layers=4, sliding_window=128,
                                 max_position_embeddings=8192)
    every = kv_bytes_per_token(model)
    stored, every_again, words = hybrid_bytes_per_token(model, 256, [6000])
    assert every_again == every and words == "full x 2, sliding(128) x 2"
    # half the layers for every token; the sliding half for the chunks whose parts the
    # checkpoints 2048, 4096, 5888 and 6000 keep (their windows of 128 and a chunk's slack):
    # [1536, 2048), [3584, 4096), [5376, 6000) -- 1,648 positions
    half = every / 2
    assert stored == half + half * 1648 / 6000
    plain = make_tiny_checkpoint(tmp_path / "plain", hidden=64, layers=4)
    assert hybrid_bytes_per_token(plain, 256, [6000]) is None
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i, "request_id": f"r{i}",
                                         "prompt_tokens": list(range(6000)), "output_len": 1})
                             + "\n" for i in range(2)))
    assert main(["plan", str(trace), "--no-ttft", "--model", str(model), "--l1", "64MiB",
                 "--json"]) == 0
    out = capsys.readouterr()
    assert "hybrid model (full x 2, sliding(128) x 2)" in out.err, out.err
    assert json.loads(out.out)["kv_bytes_per_token"] == round(stored) < every
