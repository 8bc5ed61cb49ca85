"""Attacks on the files and flags ``lmc plan``, ``lmc replay`` and ``lmc workload`` read, run as
a careless or hostile user would: traces nested 200,000 deep, numbers past every C integer,
directories, binary junk and unreadable paths where a trace belongs, a key given twice,
broken tokenizers, lone surrogates, counts of 10**12. Each is a real ``lmc`` process that must
end with exit code 2 and one line naming what was wrong (``file:line`` where there is one),
never a traceback, a hang or a silently changed value.

Threat model: docs/threats/cli.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"arrival_s": 0, "request_id": "r1", "prompt_tokens": [1, 2, 3], "output_len": 4}
PLAN = ("--no-ttft", "--kv-bytes-per-token", "64")


def lmc(*args: str | Path, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc.cli", *map(str, args)], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout)


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """The run ended as an ordinary mistake: exit 2, no traceback, every needle named."""
    err = out.stderr
    assert "Traceback" not in err, err
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], err[-2000:])
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def text_line(prompt: str, **over: object) -> str:
    """A trace line with a text prompt (``prompt``) instead of token ids."""
    obj = {k: v for k, v in GOOD.items() if k != "prompt_tokens"}
    return json.dumps({**obj, "prompt": prompt, **over})


def trace(tmp_path: Path, *lines: str, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from lmc.reference import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


def _run_reader(command: str, path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``command`` reading ``path`` as its input file."""
    if command == "plan":
        return lmc("plan", path, *PLAN, cwd=tmp_path)
    if command == "replay":
        return lmc("replay", path, "--target", "reference", cwd=tmp_path)
    return lmc("workload", "sharegpt", path, "-o", tmp_path / "out.jsonl", cwd=tmp_path)


# ------------------------------------------------------------------- the file's contents
@pytest.mark.parametrize("command", ["plan", "replay", "sharegpt"])
def test_nesting_200000_deep_is_named_not_a_recursion_error(tmp_path, command):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "\n")
    refused(_run_reader(command, path, tmp_path), f"{path}:1: JSON nested deeper than 32")


def test_output_len_past_every_c_integer_is_named(tmp_path):
    path = trace(tmp_path, json.dumps(GOOD), json.dumps({**GOOD, "request_id": "r2",
                                                         "output_len": 2**63}))
    refused(lmc("plan", path, *PLAN, cwd=tmp_path),
            f"{path}:2: output_len: expected an integer in [1, 1048576], got 9223372036854775808")


def test_a_key_given_twice_is_refused_not_silently_the_last(tmp_path):
    line = json.dumps(GOOD)[:-1] + ', "output_len": 7}'
    path = trace(tmp_path, line)
    refused(lmc("plan", path, *PLAN, cwd=tmp_path), f"{path}:1: output_len: key given twice")


def test_binary_junk_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\x89PNG\r\n\x1a\n\xff\xfe\x00\x01\n")
    refused(lmc("plan", path, *PLAN, cwd=tmp_path), f"{path}:2: not UTF-8 text (byte 0x89")


@pytest.mark.parametrize("command", ["plan", "replay"])
def test_a_lone_surrogate_is_named_before_the_tokenizer_sees_it(tmp_path, model, command):
    path = trace(tmp_path, json.dumps({**GOOD, "request_id": "ok"}), text_line("\ud800 hi"))
    if command == "plan":
        out = lmc("plan", path, *PLAN, "--tokenizer", model, cwd=tmp_path)
    else:
        out = lmc("replay", path, "--target", f"reference:{model}", "--no-lmc", cwd=tmp_path)
    refused(out, f"{path}:2: prompt: a lone UTF-16 surrogate \\ud800 at character 0")


def test_a_sharegpt_surrogate_is_named_with_a_real_tokenizer(tmp_path, model):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi \udfff"},
                                                   {"from": "gpt", "value": "ok"}]}]))
    refused(lmc("workload", "sharegpt", path, "--tokenizer", model, "-o", tmp_path / "o.jsonl",
                cwd=tmp_path), f"{path}: conversation 0, turn 0: value: holds a lone UTF-16")


def test_a_profile_nested_deep_is_named(tmp_path):
    path = trace(tmp_path, json.dumps(GOOD))
    deep = tmp_path / "deep-profile.json"
    deep.write_text("{\"a\":" * 100_000)
    refused(lmc("plan", path, "--profile", deep, cwd=tmp_path),
            f"calibration profile {deep}:1: JSON nested deeper than 32")


@pytest.mark.parametrize("lie, needle", [
    ({"tiers": {"cpu": {"bytes_per_s": 0}}}, "tiers.cpu: expected bytes_per_s > 0"),
    ({"chunk_size": 0}, "chunk_size: expected [1, 2**20], got 0"),
    ({"kv_bytes_per_token": 1e999}, "cannot convert float infinity"),
])
def test_a_profile_that_lies_is_named(tmp_path, lie, needle):
    from lmc.planner.costmodel import PROFILE_VERSION

    profile = {"version": PROFILE_VERSION, "model": "m", "kv_bytes_per_token": 64,
               "chunk_size": 256, "prefill_points": [[256, 0.1], [1024, 0.4]],
               "tiers": {"cpu": {"bytes_per_s": 1e9}}, "fit": [0.01, 1e-4, 0.0], **lie}
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(profile).replace("Infinity", "1e999"))
    path = trace(tmp_path, json.dumps(GOOD))
    refused(lmc("plan", path, "--profile", prof, cwd=tmp_path), f"calibration profile {prof}",
            needle)


# ------------------------------------------------------------------------ the path itself
def _unreadable(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A path of ``kind`` where a file belongs, and what the error must say about it."""
    if kind == "missing":
        return tmp_path / "nope.jsonl", "no such file"
    if kind == "directory":
        (tmp_path / "d").mkdir()
        return tmp_path / "d", "is a directory, expected a file"
    if kind == "not-a-directory":
        (tmp_path / "f").write_text("x")
        return tmp_path / "f" / "t.jsonl", "cannot be read (Not a directory)"
    if kind == "symlink-loop":
        os.symlink(tmp_path / "loop", tmp_path / "loop")
        return tmp_path / "loop", "cannot be read (Too many levels of symbolic links)"
    if kind == "permission":
        path = trace(tmp_path, json.dumps(GOOD))
        path.chmod(0)
        return path, "permission denied"
    if kind == "binary":
        path = tmp_path / "b.jsonl"
        path.write_bytes(b"\x00\x01\x02\x03")
        return path, ":1: binary data (a NUL byte at column 1)"
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    return path, ":1: not UTF-8 text (byte 0xe9 at column 16)"


KINDS = ["missing", "directory", "not-a-directory", "symlink-loop", "permission", "binary",
         "latin-1"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["replay", "sharegpt"])
def test_every_unreadable_path_is_named(tmp_path, command, kind):
    if kind == "permission" and os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file")
    path, what = _unreadable(kind, tmp_path)
    refused(_run_reader(command, path, tmp_path), str(path), what)


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_plan_names_a_directory_or_binary_trace(tmp_path, kind):
    path, what = _unreadable(kind, tmp_path)
    refused(lmc("plan", path, *PLAN, cwd=tmp_path), str(path), what)


@pytest.mark.parametrize("content, what", [
    ("{}", "not a tokenizer.json the tokenizers library reads (Model missing"),
    ("\x00\x01", "not a tokenizer.json the tokenizers library reads"),
    ("[" * 100_000, "not a tokenizer.json the tokenizers library reads"),
])
def test_a_broken_tokenizer_is_named(tmp_path, content, what):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(content)
    refused(lmc("workload", "chat", "--tokenizer", tok, "-o", tmp_path / "o.jsonl",
                cwd=tmp_path), f"--tokenizer {tok}", what)


def test_plan_names_a_tokenizer_of_braces(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    path = trace(tmp_path, text_line("hi"))
    refused(lmc("plan", path, *PLAN, "--tokenizer", tmp_path, cwd=tmp_path),
            f"--tokenizer {tok}: not a tokenizer.json", "Model missing")


# ---------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("args, needle", [
    (("plan", "t.jsonl", *PLAN, "--chunk-size", "0"), "--chunk-size: expected a whole number in"),
    (("plan", "t.jsonl", *PLAN, "--chunk-size", "-256"), "--chunk-size"),
    (("plan", "t.jsonl", *PLAN, "--align", "0"), "--align"),
    (("plan", "t.jsonl", *PLAN, "--step-tokens", "-1"), "--step-tokens"),
    (("plan", "t.jsonl", *PLAN, "--jobs", "-1"), "--jobs"),
    (("plan", "t.jsonl", "--no-ttft", "--kv-bytes-per-token", "-5"), "--kv-bytes-per-token"),
    (("plan", "t.jsonl", *PLAN, "--limit", "0"), "--limit"),
    (("plan", "t.jsonl", *PLAN, "--l1", "99999999TiB"), "--l1 '99999999TiB': at most 1PiB"),
    (("plan", "--calibrate", "--reps", "1" + "0" * 30), "--reps"),
    (("plan", "--calibrate", "--lengths", "1,99999999999"), "--lengths"),
    (("replay", "t.jsonl", "--target", "reference", "--threads", "1" + "0" * 21), "--threads"),
    (("replay", "t.jsonl", "--target", "reference", "--concurrency", "10" * 7), "--concurrency"),
    (("replay", "t.jsonl", "--target", "http://127.0.0.1:9", "--timeout", "nan"), "--timeout"),
    (("replay", "t.jsonl", "--target", "http://127.0.0.1:9", "--timeout", "-1"), "--timeout"),
    (("workload", "chat", "-o", "o.jsonl", "--system-tokens", str(10**12)), "--system-tokens"),
    (("workload", "prefix", "-o", "o.jsonl", "--groups", str(10**12)), "--groups"),
    (("workload", "chat", "-o", "o.jsonl", "--turns", f"1-{10**9}"), "--turns"),
    (("workload", "chat", "-o", "o.jsonl", "--user-tokens", f"1-{10**9}"), "--user-tokens"),
    (("workload", "docqa", "-o", "o.jsonl", "--doc-tokens", str(10**12)), "--doc-tokens"),
    (("workload", "chat", "-o", "o.jsonl", "--seed", "1" + "0" * 30), "--seed"),
    (("workload", "sharegpt", "x.json", "-o", "o.jsonl", "--max-output-len", str(2**40)),
     "--max-output-len"),
])
def test_numeric_flags_past_their_range_are_refused_at_once(tmp_path, args, needle):
    trace(tmp_path, json.dumps(GOOD))
    refused(lmc(*args, cwd=tmp_path, timeout=60), needle)


@pytest.mark.parametrize("args", [
    ("workload", "prefix", "--groups", "100000", "--prompts-per-group", "100000"),
    ("workload", "chat", "--conversations", "100000", "--turns", "1000"),
    ("workload", "docqa", "--documents", "100000", "--doc-tokens", "1000000"),
])
def test_a_workload_too_large_to_finish_is_refused_before_it_starts(tmp_path, args):
    refused(lmc(*args, "-o", tmp_path / "o.jsonl", cwd=tmp_path, timeout=60),
            "prompt tokens; at most 1,073,741,824")
    assert not (tmp_path / "o.jsonl").exists()


def _bare_numeric_options(command: str) -> list[str]:
    from lmc.cli import build_parser

    def walk(p: argparse.ArgumentParser, name: str) -> list[str]:
        bare = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    bare += walk(sub, f"{name} {sub_name}")
            elif action.type in (int, float):
                bare.append(f"{name} {'/'.join(action.option_strings)}")
        return bare

    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return walk(sub.choices[command], command)


@pytest.mark.parametrize("command", [
    "plan", "replay", "workload", "demo", "server", "stats", "bench", "pd-proxy",
])
def test_every_numeric_option_has_a_range_checked_type(command):
    """The class, not the instances: no option takes a bare int or float (which would take
    0, -1, 10**30 or nan and let the command find out later, or never)."""
    assert _bare_numeric_options(command) == []


def test_a_config_nested_deep_is_named(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    path = trace(tmp_path, json.dumps(GOOD))
    refused(lmc("replay", path, "--target", "reference", "--config", deep, cwd=tmp_path),
            f"{deep}: YAML nested too deeply")
    refused(lmc("config", "--config", deep, cwd=tmp_path), f"{deep}: YAML nested too deeply")


def test_records_into_a_directory_is_refused_before_the_run(tmp_path):
    path = trace(tmp_path, json.dumps(GOOD))
    refused(lmc("replay", path, "--target", "http://127.0.0.1:9", "--records", tmp_path,
                cwd=tmp_path), f"--records {tmp_path}: is a directory")


def test_a_workload_written_over_a_directory_is_refused_by_name(tmp_path):
    (tmp_path / "out").mkdir()
    err = refused(lmc("workload", "prefix", "-o", tmp_path / "out", cwd=tmp_path),
                  f"{tmp_path / 'out'}: is a directory")
    assert ".tmp" not in err, err


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(max_size=40) | st.integers(-2**70, 2**70).map(str)
       | st.floats(allow_nan=True, allow_infinity=True).map(repr),
       st.integers(-2**64, 2**64), st.integers(0, 2**64))
def test_range_types_take_only_what_is_in_range(text, lo, width):
    """Any text either parses into the range or is an ArgumentTypeError naming what was
    given (argparse turns that into exit 2); never another exception, never out of range."""
    from lmc.cli_args import float_in, int_in, positive_int

    hi = lo + width
    for parse, ok in ((int_in(lo, hi), lambda v: type(v) is int and lo <= v <= hi),
                      (positive_int, lambda v: type(v) is int and 1 <= v < 2**63),
                      (float_in(lo, hi, low_open=True), lambda v: lo < v <= hi)):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as e:
            assert "expected" in str(e)
            continue
        assert ok(value), (text, value)


# ------------------------------------------------------------ memory the reading takes
def _lmc_under_3_gib(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """``lmc`` in a process whose address space is capped at 3 GiB (``RLIMIT_AS``)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from lmc.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)


def test_sharegpt_reads_a_small_file_under_a_3_gib_address_space(tmp_path):
    """The 4 GiB bound used to be one ``f.read(4 GiB + 1)``, which reserves the whole buffer
    before reading: a 100-byte file failed with MemoryError under a 3 GiB limit."""
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [
        {"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}]))
    assert path.stat().st_size < 200
    out = _lmc_under_3_gib("workload", "sharegpt", path, "-o", tmp_path / "o.jsonl",
                           cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "o.jsonl").read_text().count("\n") == 1


def test_sharegpt_past_the_bound_is_named_by_its_size_not_read(tmp_path):
    """A 5 GiB file (sparse: no disk used) is refused by its size, under the same limit,
    with the named error: not read into memory first."""
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(5 << 30)
    out = _lmc_under_3_gib("workload", "sharegpt", path, "-o", tmp_path / "o.jsonl",
                           cwd=tmp_path)
    refused(out, str(path), "larger than 4,294,967,296 bytes")
