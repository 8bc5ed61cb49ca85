"""``lmc workload agent`` (lmc/workloads/agent.py): sessions over one tools prefix whose turns
append to their context, sub-agents forking a parent's context, think time between turns,
background traffic with a burst; deterministic from its seed, bounds refused by name; and the
replay's session hints (``--session-hints``) as the connector reads them."""

from __future__ import annotations

import pytest

from lmc.cli import main
from lmc.reference import make_tiny_checkpoint
from lmc.workloads import generators as g
from lmc.workloads import read_trace
from lmc.workloads.agent import AgentSpec, agent_drafts
from lmc.workloads.replay import SessionHints
from lmc.workloads.trace import TraceRequest

SPEC = AgentSpec(sessions=6, turns=(4, 6), system_tokens=300, task_tokens=(20, 40),
                 tool_tokens=(20, 60), output_len=8, fork=0.5, sub_turns=(2, 3), think_s=1.0,
                 session_gap_s=1.0, background_rate=0.5, background_tokens=(50, 80),
                 burst_rate=10.0, burst_s=3.0, burst_at=0.5, seed=3)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("agent") / "m", hidden=64, layers=2)
    return g.load_tokenizer(ckpt)


def _rendered(tok, spec: AgentSpec = SPEC) -> list[TraceRequest]:
    drafts, arrivals = agent_drafts(spec, tok)
    return list(g.render(drafts, arrivals, tok))


def test_sessions_append_fork_and_share_the_tools_prefix(tok):
    reqs = _rendered(tok)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times)
    sessions: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        if r.session_id is not None:
            sessions.setdefault(r.session_id, []).append(r)
    top = [s for s in sessions if ".sub" not in s]
    subs = [s for s in sessions if ".sub" in s]
    assert len(top) == 6 and subs, sorted(sessions)
    system = sessions["agent-0"][0].prompt_tokens[:300]
    for name, turns in sessions.items():
        assert all(t.prefix_group == "agent" for t in turns)
        assert all(t.prompt_tokens[:300] == system for t in turns), f"{name}: another prefix"
        for a, b in zip(turns, turns[1:]):  # each turn holds the previous one's prompt
            assert b.prompt_tokens[:len(a.prompt_tokens)] == a.prompt_tokens, name
            assert b.arrival_s >= a.arrival_s
    for sub in subs:  # a sub-agent starts from its parent's context at the fork
        parent = sessions[sub.split(".sub")[0]]
        first = sessions[sub][0]
        assert any(first.prompt_tokens[:len(p.prompt_tokens)] == p.prompt_tokens
                   for p in parent)
    reuse = [len(a.prompt_tokens) / len(b.prompt_tokens)
             for turns in sessions.values() for a, b in zip(turns, turns[1:])]
    assert sum(reuse) / len(reuse) > 0.8  # most of a turn is the previous turn


def test_background_has_no_session_and_a_burst(tok):
    reqs = _rendered(tok)
    bg = [r for r in reqs if r.session_id is None]
    assert bg and all(r.prefix_group == "background" for r in bg)
    span = max(r.arrival_s for r in reqs if r.session_id is not None)
    start = SPEC.burst_at * span
    inside = [r for r in bg if start <= r.arrival_s < start + SPEC.burst_s]
    assert len(inside) > 2 * SPEC.background_rate * SPEC.burst_s  # denser than the rest
    assert len({tuple(r.prompt_tokens[:20]) for r in bg}) == len(bg)  # unrelated prompts


def test_the_same_seed_gives_the_same_trace_and_bounds_are_named(tok):
    assert _rendered(tok) == _rendered(tok)
    other = _rendered(tok, AgentSpec(**{**SPEC.__dict__, "seed": 4}))
    assert other != _rendered(tok)
    for bad, words in ((dict(fork=1.5), "fork"), (dict(turns=(3, 2)), "turns"),
                       (dict(burst_at=2.0), "burst_at"), (dict(think_s=-1.0), "think_s"),
                       (dict(sessions=0), "sessions"),
                       (dict(sessions=90_000, system_tokens=1 << 20), "prompt tokens")):
        with pytest.raises(ValueError, match=words):
            agent_drafts(AgentSpec(**{**SPEC.__dict__, **bad}))


def test_the_command_writes_a_trace_and_refuses_rate(tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["workload", "agent", "-o", str(out), "--sessions", "3", "--turns", "2-3",
                 "--system-tokens", "200", "--burst-s", "2"]) == 0
    said = capsys.readouterr().out
    assert "wrote" in said and "arrivals over" in said
    reqs = list(read_trace(out))
    assert {r.prefix_group for r in reqs} <= {"agent", "background"}
    assert main(["workload", "agent", "-o", str(out), "--rate", "2"]) == 2
    assert "not --rate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own refusal, naming the flag
        main(["workload", "agent", "-o", str(out), "--fork", "2"])
    assert e.value.code == 2 and "--fork: expected a fraction" in capsys.readouterr().err


def test_session_hints_become_kv_transfer_params():
    h = SessionHints(600.0, 5, -5)
    turn = TraceRequest(0.0, "a-1", "agent-1", "agent", [1, 2], None, 4)
    bg = TraceRequest(0.0, "bg-1", None, "background", [1, 2], None, 4)
    assert h.params(turn) == {"lmc_session": "agent-1", "lmc_ttl": 600.0, "lmc_priority": 5}
    assert h.params(bg) == {"lmc_priority": -5}
    assert SessionHints().params(turn) is None and SessionHints().params(bg) is None
