"""Copy paths chosen per device and call shape: the selection rule, the per-device cache file
and its failure modes, on the CPU with injected timings (the measurement itself needs a GPU:
tests/transfer/test_cuda_transfer.py, benchmarks/gpu_check.sh).

Threat model: docs/design.md, "Transfer" -- the cache file lives in the user's cache dir; a
corrupt, truncated, foreign or stale (other kernels) file is ignored and recalibrated, never
a crash or a mode outside ("direct", "staged"); a failing calibration falls back to the
defaults.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmc.transfer import cuda_copy as ct

T = ct.PathTiming


def _timings(**ratios) -> dict:
    """Timings from 'direction_shape_mode=seconds' keywords."""
    out = {}
    for k, v in ratios.items():
        d, rest = k.split("_", 1)
        shape, mode = rest.rsplit("_", 1)
        out[(d, shape, mode)] = v if isinstance(v, ct.PathTiming) else T(v)
    return out


def test_the_h200_figures_pick_per_direction_and_call_shape():
    """The issue's H200 numbers (fraction of memcpy, higher is faster): per-layer scatter
    direct 0.90 vs staged 0.82, all-layer scatter staged 0.94; gather direct both ways."""
    got = ct.choose_paths(_timings(
        gather_per_layer_direct=1 / 0.93, gather_per_layer_staged=1 / 0.80,
        gather_all_layers_direct=1 / 0.94, gather_all_layers_staged=1 / 0.85,
        scatter_per_layer_direct=1 / 0.90, scatter_per_layer_staged=1 / 0.82,
        scatter_all_layers_direct=1 / 0.80, scatter_all_layers_staged=1 / 0.94))
    assert got == {("gather", "per_layer"): "direct", ("gather", "all_layers"): "direct",
                   ("scatter", "per_layer"): "direct", ("scatter", "all_layers"): "staged"}
    assert got == ct.DEFAULT_PATHS  # the defaults are these figures


def test_close_paths_prefer_the_one_that_slows_the_forward_less():
    near = ct.choose_paths(_timings(scatter_per_layer_direct=T(1.00, slowdown=0.12),
                                    scatter_per_layer_staged=T(1.04, slowdown=0.01)))
    assert near[("scatter", "per_layer")] == "staged"
    far = ct.choose_paths(_timings(scatter_per_layer_direct=T(1.00, slowdown=0.12),
                                   scatter_per_layer_staged=T(1.20, slowdown=0.01)))
    assert far[("scatter", "per_layer")] == "direct", "a 20% slower copy won on gentleness"
    unknown = ct.choose_paths(_timings(scatter_per_layer_direct=T(1.00, slowdown=0.12),
                                       scatter_per_layer_staged=T(1.04)))
    assert unknown[("scatter", "per_layer")] == "direct"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_broken_measurement_is_not_a_measurement(bad):
    got = ct.choose_paths(_timings(gather_all_layers_direct=bad, gather_all_layers_staged=2.0,
                                   scatter_all_layers_direct=bad))
    assert got[("gather", "all_layers")] == "staged"
    assert got[("scatter", "all_layers")] == ct.DEFAULT_PATHS[("scatter", "all_layers")]


def test_saves_weigh_the_forward_they_slow():
    """The H100's figures: direct gather 0.93 of memcpy with the forward +169%, staged 0.85
    with +0%: a save runs beside its forward, so staged wins; a load (scatter) with the same
    figures stays on the faster path."""
    fig = dict(gather_per_layer_direct=T(1 / 0.93, slowdown=1.69),
               gather_per_layer_staged=T(1 / 0.85, slowdown=0.0),
               scatter_per_layer_direct=T(1 / 0.93, slowdown=1.69),
               scatter_per_layer_staged=T(1 / 0.85, slowdown=0.0))
    got = ct.choose_paths(_timings(**fig))
    assert got[("gather", "per_layer")] == "staged"
    assert got[("scatter", "per_layer")] == "direct"
    # a gentle path at half the speed still loses to a kernel that barely slows the forward
    half = ct.choose_paths(_timings(gather_all_layers_direct=T(1.0, slowdown=0.2),
                                    gather_all_layers_staged=T(2.0, slowdown=0.0)))
    assert half[("gather", "all_layers")] == "direct"
    # a slowdown measured for one mode only: speed first, as before
    one = ct.choose_paths(_timings(gather_all_layers_direct=T(1.0, slowdown=5.0),
                                   gather_all_layers_staged=T(1.5)))
    assert one[("gather", "all_layers")] == "direct"


def _cost(t):
    return t.seconds * (1 + max(0.0, t.slowdown or 0.0))


@given(st.dictionaries(
    st.tuples(st.sampled_from(ct.DIRECTIONS), st.sampled_from(ct.SHAPES),
              st.sampled_from(ct.MODES)),
    st.builds(ct.PathTiming,
              st.one_of(st.floats(min_value=-1, max_value=1e9),
                        st.sampled_from([math.nan, math.inf])),
              st.one_of(st.none(), st.floats(min_value=0, max_value=10)))))
def test_choice_is_always_complete_and_never_clearly_worse(timings):
    got = ct.choose_paths(timings)
    assert set(got) == set(ct.DEFAULT_PATHS) and set(got.values()) <= set(ct.MODES)
    for key, mode in got.items():
        mine = timings.get((*key, mode))
        others = [t for m in ct.MODES if m != mode
                  and (t := timings.get((*key, m))) is not None and 0 < t.seconds < math.inf]
        if not others:
            continue
        assert mine is not None
        both = all(t.slowdown is not None for t in (mine, *others))
        if key[0] == "gather" and both:  # a save: seconds weighed by the forward's slowdown
            assert _cost(mine) <= min(_cost(t) for t in others)
        else:
            assert mine.seconds <= min(t.seconds for t in others) * (1 + ct.CLOSE)


def test_the_cache_file_round_trips_per_device(tmp_path):
    f = tmp_path / "paths.json"
    t = _timings(scatter_per_layer_direct=1.0, scatter_per_layer_staged=2.0)
    choice = ct.choose_paths(t)
    ct.save_paths("NVIDIA H100 80GB HBM3", choice, t, f)
    ct.save_paths("NVIDIA H200", dict(ct.DEFAULT_PATHS), {}, f)
    assert ct.load_paths("NVIDIA H100 80GB HBM3", f) == choice
    assert ct.load_paths("NVIDIA H200", f) == ct.DEFAULT_PATHS
    assert ct.load_paths("NVIDIA A100", f) is None
    data = json.loads(f.read_text())
    assert data["NVIDIA H100 80GB HBM3"]["measured"]["scatter/per_layer/direct"]["seconds"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".copy_paths.")]


@pytest.mark.parametrize("content", [
    "", "{", "[]", "null", '{"GPU": 3}', '{"GPU": {"kernel": "other", "choice": {}}}',
    '{"GPU": {"kernel": "%K", "choice": {"gather/per_layer": "zero-copy"}}}',
    '{"GPU": {"kernel": "%K", "choice": {"gather/per_layer": "direct"}}}',
    '{"GPU": {"kernel": "%K", "choice": ["direct"]}}',
    '{"GPU": {"kernel": "%K", "choice": {"gather/per_layer": "direct", '
    '"gather/all_layers": "direct", "scatter/per_layer": "direct", '
    '"scatter/all_layers": {"$ne": 1}}}}',
    "[" * 200_000,  # raised RecursionError out of the binding (not a ValueError)
    '{"GPU": 1, "GPU": 2}',
], ids=lambda s: s[:24])
def test_a_corrupt_foreign_or_stale_cache_file_is_ignored(tmp_path, content):
    """Whatever the file holds (a half-written file, another kernel's entry, a mode that is
    not one, missing keys), the answer is 'not cached': recalibrate, never crash."""
    f = tmp_path / "paths.json"
    f.write_text(content.replace("%K", ct.kernel_digest()))
    assert ct.load_paths("GPU", f) is None
    ct.save_paths("GPU", dict(ct.DEFAULT_PATHS), {}, f)  # and the next save repairs it
    assert ct.load_paths("GPU", f) == ct.DEFAULT_PATHS


def test_device_paths_calibrate_once_then_load_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(ct, "_CALIBRATED", {})
    f = tmp_path / "sub" / "paths.json"
    measured = []

    def measure(index):
        measured.append(index)
        return _timings(scatter_all_layers_direct=1.0, scatter_all_layers_staged=3.0)

    got = ct.device_paths(7, measure=measure, name="Fake GPU", path=f)
    assert got[("scatter", "all_layers")] == "direct" and measured == [7]
    assert ct.device_paths(7, measure=measure, name="Fake GPU", path=f) is got  # memo
    monkeypatch.setattr(ct, "_CALIBRATED", {})  # a new process: the file answers
    assert ct.device_paths(7, measure=measure, name="Fake GPU", path=f) == got
    assert measured == [7]
    ct.device_paths(7, measure=measure, name="Fake GPU", path=f, force=True)
    assert measured == [7, 7]


def test_a_failing_calibration_falls_back_to_the_defaults_uncached(tmp_path, monkeypatch,
                                                                    caplog):
    monkeypatch.setattr(ct, "_CALIBRATED", {})
    f = tmp_path / "paths.json"

    def oom(index):
        raise RuntimeError("CUDA out of memory")

    assert ct.device_paths(0, measure=oom, name="Full GPU", path=f) == ct.DEFAULT_PATHS
    assert "out of memory" in caplog.text and not f.exists() and 0 not in ct._CALIBRATED


def test_call_shape_and_resolution():
    assert ct.call_shape(1, 32) == "per_layer" and ct.call_shape(32, 32) == "all_layers"
    assert ct.call_shape(1, 1) == "all_layers" and ct.call_shape(2, 32) == "all_layers"
    p = ct.resolve_paths({("gather", "per_layer"): "staged"}, {"gather": None,
                                                               "scatter": "direct"})
    assert p[("gather", "per_layer")] == "staged"
    assert p[("gather", "all_layers")] == ct.DEFAULT_PATHS[("gather", "all_layers")]
    assert p[("scatter", "all_layers")] == "direct"
    with pytest.raises(ValueError, match="copy path for gather per_layer"):
        ct.resolve_paths({("gather", "per_layer"): "fast"}, {})


def test_the_cache_lives_in_the_users_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ct.paths_cache_file() == tmp_path / "lmc" / "copy_paths.json"
