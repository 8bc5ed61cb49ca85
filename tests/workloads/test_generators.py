"""Generators: the structure each workload promises (turn counts, histories that really
extend, prefixes shared token for token, varied document text), determinism from the seed,
and the ShareGPT loader's handling of real-world files."""

from __future__ import annotations

import json
import os
import random
import statistics

import pytest

from lmc.cli import main
from lmc.reference import make_tiny_checkpoint
from lmc.workloads import TraceError, read_trace
from lmc.workloads import generators as g
from lmc.workloads.text import TextGen

SEED = int(os.environ.get("LMC_TEST_SEED", random.randrange(1 << 16)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


@pytest.fixture(scope="module")
def tok(ckpt):
    return g.load_tokenizer(ckpt)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _trace(drafts, tok=None, rate=None):
    return list(g.render(drafts, g.arrival_times(len(drafts), rate, SEED), tok))


def test_chat_turns_extend_their_history_over_one_system_prompt(tok):
    print("seed", SEED)
    spec = g.ChatSpec(conversations=5, system_tokens=200, user_tokens=(5, 20), output_len=8,
                      active=2, seed=SEED)
    reqs = _trace(g.chat_drafts(spec, tok), tok)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 5
    system = None
    for turns in by_session.values():
        assert 12 <= len(turns) <= 18
        assert [r.request_id.rsplit("-", 1)[1] for r in turns] == [str(k) for k in
                                                                    range(len(turns))]
        for a, b in zip(turns, turns[1:]):  # turn k+1 = turn k + its answer + a new question
            assert b.prompt_tokens[:len(a.prompt_tokens)] == a.prompt_tokens
            assert len(b.prompt_tokens) >= len(a.prompt_tokens) + spec.output_len + 5
        first = turns[0].prompt_tokens
        system = first if system is None else system
        assert _common(system, first) >= spec.system_tokens  # one system prompt for all
    # at most `active` conversations open at any point of the trace
    last = {sid: max(i for i, r in enumerate(reqs) if r.session_id == sid) for sid in by_session}
    first_seen = {sid: min(i for i, r in enumerate(reqs) if r.session_id == sid)
                  for sid in by_session}
    for i in range(len(reqs)):
        assert sum(first_seen[s] <= i <= last[s] for s in by_session) <= spec.active


def test_chat_text_trace_shares_prefixes_when_the_server_tokenizes(tok):
    """A text trace is re-tokenized whole by the target: turn boundaries sit on newlines,
    so each turn's tokens still begin with the previous turn's."""
    spec = g.ChatSpec(conversations=2, turns=(12, 12), system_tokens=150,
                      user_tokens=(5, 15), output_len=6, seed=SEED)
    prev: dict[str, list[int]] = {}
    for r in _trace(g.chat_drafts(spec, tok)):
        ids = tok.encode(r.prompt_text)
        if r.session_id in prev:
            assert ids[:len(prev[r.session_id])] == prev[r.session_id]
        prev[r.session_id] = ids


def test_prefix_groups_share_their_system_prompt_exactly(tok):
    spec = g.PrefixSpec(groups=3, prompts_per_group=4, system_tokens=300, question_tokens=10,
                        output_len=2, seed=SEED)
    reqs = _trace(g.prefix_drafts(spec, tok), tok)
    assert len(reqs) == 12
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.prefix_group, []).append(r.prompt_tokens)
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4]
    for members in groups.values():
        assert len({tuple(m) for m in members}) == 4  # different questions
        assert min(_common(members[0], m) for m in members[1:]) >= spec.system_tokens
    heads = [v[0] for v in groups.values()]
    assert max(_common(a, b) for a in heads for b in heads if a is not b) < 10
    assert [r.prefix_group for r in reqs] != sorted(r.prefix_group for r in reqs)  # shuffled


def test_docqa_documents_are_varied_text_asked_in_rounds(tok):
    spec = g.DocQASpec(documents=3, doc_tokens=1500, rounds=3, question_tokens=10,
                       output_len=2, seed=SEED)
    reqs = _trace(g.docqa_drafts(spec))
    assert [r.request_id.rsplit("-", 1)[1] for r in reqs] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    assert [r.prefix_group for r in reqs[:3]] == [r.prefix_group for r in reqs[3:6]]  # tile
    docs = {r.prefix_group: r.prompt_text.split("\nQuestion:")[0] for r in reqs}
    assert len(docs) == 3
    for doc in docs.values():
        assert len(tok.encode(doc)) >= spec.doc_tokens * 0.9  # estimated without a tokenizer
        words = doc.split()
        assert len(set(words)) > 150  # a vocabulary, not one word repeated
        top = statistics.mode(words)
        assert words.count(top) < 0.1 * len(words), top  # no word dominates
        sentences = [s for s in doc.replace("?", ".").replace("!", ".").split(".") if s.strip()]
        assert len(set(sentences)) > 0.95 * len(sentences)  # sentences do not repeat
    texts = list(docs.values())
    for a in range(3):
        for b in range(a + 1, 3):  # documents differ: few shared 6-word runs
            grams = [{tuple(t.split()[i:i + 6]) for i in range(len(t.split()) - 5)}
                     for t in (texts[a], texts[b])]
            assert len(grams[0] & grams[1]) < 0.01 * len(grams[0])
    questions = [r.prompt_text.split("\nQuestion:")[1] for r in reqs if r.prefix_group == "doc-0"]
    assert len(set(questions)) == 3  # a new question each round
    shuffled = _trace(g.docqa_drafts(g.DocQASpec(documents=6, doc_tokens=50, rounds=4,
                                                 order="random", seed=SEED)))
    orders = {tuple(r.prefix_group for r in shuffled[k * 6:(k + 1) * 6]) for k in range(4)}
    assert len(orders) > 1 and all(len(set(o)) == 6 for o in orders)


def test_docqa_with_a_tokenizer_reaches_the_requested_size(tok):
    reqs = _trace(g.docqa_drafts(g.DocQASpec(documents=2, doc_tokens=800, rounds=1,
                                             question_tokens=5, seed=SEED), tok), tok)
    for r in reqs:
        assert 800 <= len(r.prompt_tokens) <= 800 * 1.3


def test_same_seed_same_trace_other_seed_other_text():
    spec = g.PrefixSpec(groups=2, prompts_per_group=2, system_tokens=100, seed=SEED)
    a = _trace(g.prefix_drafts(spec), rate=5.0)
    assert a == _trace(g.prefix_drafts(spec), rate=5.0)
    b = _trace(g.prefix_drafts(g.PrefixSpec(groups=2, prompts_per_group=2, system_tokens=100,
                                            seed=SEED + 1)), rate=5.0)
    assert {r.prompt_text for r in a}.isdisjoint({r.prompt_text for r in b})
    assert TextGen(SEED).words(50) == TextGen(SEED).words(50) != TextGen(SEED + 1).words(50)


def test_poisson_arrivals_have_the_requested_rate():
    times = g.arrival_times(4000, 20.0, SEED)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.15)  # exponential
    assert g.arrival_times(3, None, SEED) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate must be a positive"):
        g.arrival_times(3, 0.0, SEED)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="turns: expected 1 <= min <= max, got 5-3"):
        g.chat_drafts(g.ChatSpec(turns=(5, 3)))
    with pytest.raises(ValueError, match="groups must be >= 1"):
        g.prefix_drafts(g.PrefixSpec(groups=0))
    with pytest.raises(ValueError, match="order must be 'tile' or 'random'"):
        g.docqa_drafts(g.DocQASpec(order="zigzag"))


SHAREGPT = [
    {"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is a cache?"},
        {"from": "gpt", "value": "A place to keep things you will need again soon."},
        {"from": "human", "value": "And a tier?"},
        {"from": "gpt", "value": "One level of it."}]},
    {"conversations": [{"from": "gpt", "value": "An answer with no question."}]},
    {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": ""}]},
    {"conversations": [{"from": "human", "value": "Last?"},
                       {"from": "chatgpt", "value": "Yes, " + "word " * 50}]},
]


def test_sharegpt_turns_become_requests_over_their_history(tmp_path, tok):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    drafts, skipped = g.sharegpt_drafts(g.ShareGPTSpec(str(path), max_output_len=40), tok)
    assert skipped == 2  # no human turn; an empty answer
    reqs = {r.request_id: r for r in _trace(drafts)}
    assert set(reqs) == {"sharegpt-c1-0", "sharegpt-c1-1", "sharegpt-3-0"}
    first, second = reqs["sharegpt-c1-0"], reqs["sharegpt-c1-1"]
    assert first.prompt_text.startswith("System: Be brief.\n")
    assert first.prompt_text.endswith("User: What is a cache?\nAssistant:")
    assert second.prompt_text.startswith(first.prompt_text + " A place to keep")
    assert first.output_len == len(tok.encode("A place to keep things you will need again soon.",
                                              add_special_tokens=False))
    assert reqs["sharegpt-3-0"].output_len == 40  # capped
    assert [r.request_id for r in _trace(drafts) if r.session_id == "sharegpt-c1"] == [
        "sharegpt-c1-0", "sharegpt-c1-1"]


@pytest.mark.parametrize("data, message", [
    ({"conversations": []}, "expected a JSON list of conversations"),
    ([{"turns": []}], "conversation 0: expected an object with a 'conversations' list"),
    ([{"conversations": [{"from": "human"}]}], "conversation 0, turn 0: expected"),
    ([{"conversations": [{"from": "robot", "value": "x"}]}], "unknown role 'robot'"),
])
def test_sharegpt_errors_name_the_entry(tmp_path, data, message):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=message):
        g.sharegpt_drafts(g.ShareGPTSpec(str(path)))
    path.write_text("[{")
    with pytest.raises(TraceError, match=r"sg.json:1: malformed JSON"):
        g.sharegpt_drafts(g.ShareGPTSpec(str(path)))


def test_workload_command_writes_a_readable_trace(tmp_path, tok, capsys):
    out = tmp_path / "chat.jsonl"
    assert main(["workload", "chat", "--conversations", "2", "--turns", "12-13",
                 "--system-tokens", "50", "--user-tokens", "5-9", "--output-len", "4",
                 "--rate", "10", "--seed", str(SEED), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    reqs = list(read_trace(out))
    assert 24 <= len(reqs) <= 26 and f"wrote {len(reqs)} requests" in said
    assert "2 sessions" in said and "at 10/s" in said
    assert reqs[-1].arrival_s > 0 and all(r.prompt_text for r in reqs)
    with pytest.raises(SystemExit) as e:
        main(["workload", "chat", "--turns", "9-3", "-o", str(out)])
    assert e.value.code == 2 and "MIN-MAX" in capsys.readouterr().err
    missing = tmp_path / "nope.json"
    assert main(["workload", "sharegpt", str(missing), "-o", str(out)]) == 2
    assert "nope.json" in capsys.readouterr().err
    rag = tmp_path / "rag.jsonl"
    assert main(["workload", "rag", "--documents", "4", "--doc-words", "10", "-k", "2",
                 "--queries", "6", "--seed", str(SEED), "-o", str(rag)]) == 0
    assert "wrote 6 requests" in capsys.readouterr().out
    assert all(r.segment_separator == " # # " and r.prompt_text.count(" # # ") == 3
               for r in read_trace(rag))
    assert main(["workload", "rag", "--documents", "2", "-k", "3", "-o", str(rag)]) == 2
    assert "k (3) must not exceed documents (2)" in capsys.readouterr().err


# --------------------------------------------------------------------------------- rag
def test_rag_queries_mark_their_documents_as_segments(ckpt, tok):
    """Token mode: each document's span holds exactly that document's tokens, wherever the
    query puts it; the ids and spans are what the engine itself makes of the text trace
    (pieces tokenized alone, the system prompt a prefix rather than a segment)."""
    from lmc.blend.rag_workload import make_rag_workload
    from lmc.reference import LLM
    from lmc.reference.segments import DEFAULT_SEPARATOR

    assert g.RAG_SEPARATOR == DEFAULT_SEPARATOR
    spec = g.RagSpec(documents=5, doc_words=20, k=3, queries=8, output_len=2, seed=SEED)
    drafts = g.rag_drafts(spec)
    wl = make_rag_workload(num_docs=5, doc_words=20, k=3, num_queries=8, seed=SEED)
    assert [d.segments for d in drafts] == [tuple(wl.pieces(q)) for q in wl.queries]
    text, ids = _trace(drafts), _trace(drafts, tok)
    seen: dict[str, list[int]] = {}
    for q, t in zip(wl.queries, ids, strict=True):
        assert t.prefix_group == "system" and t.segments is not None and len(t.segments) == 3
        for d, (s, e) in zip(q.doc_ids, t.segments, strict=True):
            assert seen.setdefault(f"doc{d}", t.prompt_tokens[s:e]) == t.prompt_tokens[s:e]
            assert tok.encode(wl.documents[d], add_special_tokens=False) == t.prompt_tokens[s:e]
    assert len(seen) > 3  # documents recur in other queries, at other places
    llm = LLM(ckpt)
    for t, x in zip(ids, text, strict=True):
        assert x.segment_separator == DEFAULT_SEPARATOR and x.segments is None
        engine_ids, spans = llm.encode_segments(x.prompt_text, separator=x.segment_separator)
        assert engine_ids == t.prompt_tokens and tuple(spans[1:]) == t.segments
    with pytest.raises(ValueError, match=r"k \(6\) must not exceed documents \(5\)"):
        g.rag_drafts(g.RagSpec(documents=5, k=6))
    with pytest.raises(ValueError, match="separator 'the' occurs in the generated text"):
        g.rag_drafts(g.RagSpec(separator="the"))
    with pytest.raises(ValueError, match="documents must be <= 100,000"):
        g.rag_drafts(g.RagSpec(documents=200_000))
    with pytest.raises(ValueError, match="the document pool would hold about"):
        g.rag_drafts(g.RagSpec(documents=100_000, doc_words=1 << 20, k=3, queries=100))
    with pytest.raises(ValueError, match="the trace would hold about"):
        g.rag_drafts(g.RagSpec(documents=100, doc_words=100_000, k=100, queries=1000))
