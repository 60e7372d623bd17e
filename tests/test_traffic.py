"""Traffic: the one Request, the workload generators and the Mooncake trace format (kimilab.traffic)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

import kimilab.traffic as wl
from kimilab.traffic import Request, generators, segments

DATA = Path(__file__).resolve().parents[1] / "data"
_BLOCK_SALT = 0x6C616221  # separates trace-block token streams from other seeds

SMALL = {
    "chat": lambda seed: wl.chat_sessions(6, seed=seed, system_len=40, user_len=20, reply_len=25,
                                          mean_turns=4, vocab_size=97),
    "agent": lambda seed: wl.agent_loops(4, seed=seed, tool_prompt_len=70, task_len=15,
                                         mean_steps=5, action_len=10, tool_output_len=30,
                                         branch_prob=0.5, vocab_size=97),
    "document": lambda seed: wl.document_qa(30, seed=seed, n_documents=4, system_len=20,
                                            doc_len=120, question_len=8, answer_len=12,
                                            vocab_size=97),
}


def same_requests(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(
        x.request_id == y.request_id and x.arrival_ms == y.arrival_ms
        and x.output_length == y.output_length and x.session == y.session
        and np.array_equal(x.tokens, y.tokens)
        for x, y in zip(a, b)
    )


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_generators_are_deterministic_and_seed_dependent(kind):
    a, b, c = SMALL[kind](0), SMALL[kind](0), SMALL[kind](1)
    assert same_requests(a, b)
    assert not same_requests(a, c)
    assert all(r.tokens.dtype == np.int32 and r.tokens.max() < 97 for r in a)
    assert [r.request_id for r in a] == list(range(len(a)))
    arrivals = [r.arrival_ms for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0


def test_chat_turn_resends_history_and_previous_reply():
    reqs = wl.chat_sessions(5, seed=3, system_len=30, user_len=10, reply_len=12, vocab_size=1000)
    by_session: dict[int, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    multi = 0
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            n = prev.input_length
            assert np.array_equal(cur.tokens[:n], prev.tokens)  # whole history re-sent
            assert cur.input_length > n + prev.output_length  # + reply + new message
            multi += 1
    assert multi > 0
    first = {r.tokens[:30].tobytes() for r in reqs}
    assert len(first) == 1  # the system prompt is shared by every session


def test_agent_subtasks_branch_from_one_context():
    reqs = wl.agent_loops(6, seed=5, tool_prompt_len=50, task_len=10, mean_steps=6,
                          action_len=5, tool_output_len=10, branch_prob=1.0, n_branches=3,
                          vocab_size=1000)
    assert all(np.array_equal(r.tokens[:50], reqs[0].tokens[:50]) for r in reqs)
    # with one-token blocks the hash ids form the token trie: look for a fork
    # (a node with >= 3 children) deeper than the shared tool prompt
    children: dict[tuple[int, int], set[int]] = {}
    for rec in wl.to_trace(reqs, 1):
        parent = -1
        for depth, h in enumerate(rec.hash_ids):
            children.setdefault((depth, parent), set()).add(h)
            parent = h
    assert any(depth > 50 and len(kids) >= 3 for (depth, _), kids in children.items())


def test_document_qa_shares_documents_by_popularity():
    reqs = wl.document_qa(200, seed=2, n_documents=5, system_len=10, doc_len=100,
                          question_len=5, answer_len=5, vocab_size=1000)
    docs = [r.tokens[10:20].tobytes() for r in reqs]
    counts = sorted((docs.count(d) for d in set(docs)), reverse=True)
    assert len(counts) <= 5 and counts[0] > counts[-1]


def test_bad_parameters_name_the_argument():
    with pytest.raises(ValueError, match="n_sessions"):
        wl.chat_sessions(0)
    with pytest.raises(ValueError, match="branch_prob"):
        wl.agent_loops(2, branch_prob=1.5)
    with pytest.raises(ValueError, match="rate_per_s"):
        wl.document_qa(5, rate_per_s=0.0)
    with pytest.raises(ValueError, match="system_len"):
        wl.mooncake_conversation_like(0, system_len=100, block_size=512)
    with pytest.raises(ValueError, match="Request.tokens"):
        Request(0, 0, 4, 1, tokens=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match=r"^Request.output_length=-1: expected an int >= 0$"):
        Request(0, 1, 1, -1, hash_ids=(0,))


# ----------------------------------------------------------------------------- hash ids


@settings(max_examples=examples(25), deadline=None)
@given(kind=st.sampled_from(sorted(SMALL)), seed=st.integers(0, 50), block=st.integers(1, 40))
def test_hash_ids_equal_iff_prefixes_equal(kind, seed, block):
    reqs = SMALL[kind](seed)
    records = wl.to_trace(reqs, block)
    prefix_of: dict[int, bytes] = {}
    id_of: dict[bytes, int] = {}
    for r, rec in zip(reqs, records):
        assert rec.input_length == r.input_length and rec.n_blocks(block) == len(rec.hash_ids)
        for j, h in enumerate(rec.hash_ids):
            prefix = r.tokens[: (j + 1) * block].tobytes()
            assert prefix_of.setdefault(h, prefix) == prefix  # equal ids -> equal prefixes
            assert id_of.setdefault(prefix, h) == h  # equal prefixes -> equal ids
    # ids are 0, 1, 2, ... in order of first appearance
    firsts = list(dict.fromkeys(h for rec in records for h in rec.hash_ids))
    assert firsts == list(range(len(firsts)))
    wl.check_chain(records)


@settings(max_examples=examples(20), deadline=None)
@given(kind=st.sampled_from(sorted(SMALL)), seed=st.integers(0, 50), block=st.integers(1, 64))
def test_segment_ids_match_token_ids(kind, seed, block):
    """Records computed from segments (no tokens) equal to_trace of the materialised tokens."""
    reqs = SMALL[kind](seed)
    specs = {
        "chat": lambda: generators.chat_specs(6, seed, mean_turns=4, max_turns=16, system_len=40,
                                       user_len=20, reply_len=25, session_rate_per_s=0.5,
                                       think_ms=20_000.0),
        "agent": lambda: generators._agent_specs(4, seed, tool_prompt_len=70, task_len=15, mean_steps=5,
                                         action_len=10, tool_output_len=30, branch_prob=0.5,
                                         n_branches=3, sub_steps=3, task_rate_per_s=0.2,
                                         step_ms=3_000.0),
        "document": lambda: generators._document_specs(30, seed, n_documents=4, system_len=20,
                                               doc_len=120, question_len=8, answer_len=12,
                                               zipf_a=1.1, followup_prob=0.3, rate_per_s=1.0),
    }[kind]()
    # vocab 97 makes accidental token equality across segments possible for tiny blocks,
    # so compare on a large vocabulary where it is not.
    big = segments.materialise(specs, seed, 2**31 - 1)
    assert [r.input_length for r in big] == [r.input_length for r in reqs]
    assert segments.specs_to_trace(specs, block) == wl.to_trace(big, block)


def record_tokens(record: Request, block_size: int, *, vocab_size: int, seed: int = 0) -> np.ndarray:
    """Deterministic token ids for a trace line: block ``h``'s tokens are a seeded function of ``h``.

    A partial last block takes the first tokens of its id's stream, so equal ids
    always give equal tokens and (for realistic vocabularies) different ids give
    different tokens.
    """
    parts = [np.random.default_rng([_BLOCK_SALT, seed, h]).integers(0, vocab_size, block_size, np.int32)[:n]
             for h, n in zip(record.hash_ids, record.block_lengths(block_size))]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def records_to_requests(records: list[Request], block_size: int, *, vocab_size: int) -> list[Request]:
    """Token-level requests for a (small) trace; ``to_trace`` of them gives the ids back."""
    return [Request(i, r.arrival_ms, r.input_length, r.output_length,
                    tokens=record_tokens(r, block_size, vocab_size=vocab_size))
            for i, r in enumerate(records)]


def test_records_to_tokens_roundtrip():
    records = wl.to_trace(SMALL["agent"](4), 16)
    reqs = records_to_requests(records, 16, vocab_size=1000)
    assert wl.to_trace(reqs, 16) == records
    again = records_to_requests(records, 16, vocab_size=1000)
    assert same_requests(reqs, again)


def test_to_trace_rejects_unsorted_requests():
    reqs = SMALL["chat"](0)
    with pytest.raises(ValueError, match="arrival_ms"):
        wl.to_trace([reqs[-1], reqs[0]], 16)


# ----------------------------------------------------------------------------- file format


def test_write_load_roundtrip(tmp_path):
    records = wl.to_trace(SMALL["document"](1), 32)
    path = wl.write_trace(tmp_path / "t.jsonl", records)
    assert wl.load_trace(path, 32, chained=True) == records
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]


def _valid_lines(n: int = 6) -> list[str]:
    records = wl.to_trace(SMALL["chat"](2), 16)[:n]
    return [r.to_json() for r in records]


CORRUPTIONS = {
    "json": (None, lambda d, line: line[:-3]),
    "missing_timestamp": ("timestamp", lambda d, line: json.dumps({k: v for k, v in d.items() if k != "timestamp"})),
    "missing_hash_ids": ("hash_ids", lambda d, line: json.dumps({k: v for k, v in d.items() if k != "hash_ids"})),
    "negative_input": ("input_length", lambda d, line: json.dumps({**d, "input_length": -5})),
    "float_output": ("output_length", lambda d, line: json.dumps({**d, "output_length": 3.5})),
    "string_timestamp": ("timestamp", lambda d, line: json.dumps({**d, "timestamp": "7"})),
    "bool_output": ("output_length", lambda d, line: json.dumps({**d, "output_length": True})),
    "short_hash_ids": ("hash_ids", lambda d, line: json.dumps({**d, "hash_ids": d["hash_ids"][:-1]})),
    "long_hash_ids": ("hash_ids", lambda d, line: json.dumps({**d, "hash_ids": d["hash_ids"] + [1]})),
    "negative_id": ("hash_ids", lambda d, line: json.dumps({**d, "hash_ids": [-1] + d["hash_ids"][1:]})),
    "hash_ids_not_list": ("hash_ids", lambda d, line: json.dumps({**d, "hash_ids": 3})),
    "not_object": (None, lambda d, line: json.dumps([1, 2, 3])),
    "empty": (None, lambda d, line: "   "),
}


@settings(max_examples=examples(40), deadline=None)
@given(kind=st.sampled_from(sorted(CORRUPTIONS)), where=st.integers(0, 5))
def test_loader_names_line_and_field(tmp_path_factory, kind, where):
    lines = _valid_lines()
    field, corrupt = CORRUPTIONS[kind]
    lines[where] = corrupt(json.loads(lines[where]), lines[where])
    path = tmp_path_factory.mktemp("bad") / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        wl.load_trace(path, 16)
    message = str(err.value)
    assert message.startswith(f"line {where + 1}:")
    if field is not None:
        assert f"'{field}'" in message


def test_loader_checks_timestamp_order(tmp_path):
    lines = _valid_lines()
    late = json.loads(lines[1])
    late["timestamp"] = json.loads(lines[2])["timestamp"] + 1000
    lines[1] = json.dumps(late)
    path = tmp_path / "order.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"^line 3: field 'timestamp'"):
        wl.load_trace(path, 16)
    assert len(wl.load_trace(path, 16, require_sorted=False)) == len(lines)


def test_check_chain_detects_reparented_id(tmp_path):
    records = [Request(0, 0, 20, 1, hash_ids=(0, 1)), Request(1, 1, 20, 1, hash_ids=(2, 1))]
    path = wl.write_trace(tmp_path / "c.jsonl", records)
    assert len(wl.load_trace(path, 10, chained=False)) == 2
    with pytest.raises(ValueError, match=r"line 2: field 'hash_ids'\[1\]"):
        wl.load_trace(path, 10)  # chained is the default


# ----------------------------------------------------------------------------- committed data


def test_conversation_like_matches_published_statistics():
    records = wl.mooncake_conversation_like(0)
    s = wl.trace_stats(records)
    assert 11_000 <= s["requests"] <= 13_000
    assert 3_400 <= s["duration_s"] <= 3_600
    assert 11_000 <= s["input_mean"] <= 13_000
    assert 6_000 <= s["input_p50"] <= 8_000
    assert 75_000 <= s["input_p99"] <= 95_000
    assert 300 <= s["output_mean"] <= 380
    assert s["share_first_block"] == 1.0
    assert len({r.hash_ids[0] for r in records}) == 1
    assert 0.3 <= s["reuse_upper_bound"] <= 0.9  # multi-turn reuse exists; not forced


def test_regenerate_is_byte_identical(tmp_path):
    written = wl.regenerate(tmp_path)
    assert sorted(p.name for p in written) == sorted(wl.DATASETS)
    for path in written:
        committed = DATA / path.name
        assert committed.exists(), f"{committed} missing: run python -m kimilab traces regenerate data/"
        assert path.read_bytes() == committed.read_bytes(), f"{path.name} differs from data/"


def test_committed_traces_load_and_readme_lists_them():
    readme = (DATA / "README.md").read_text()
    for name in wl.DATASETS:
        records = wl.load_trace(DATA / name, 512, chained=True)
        assert name in readme and f"{len(records):,}" in readme


def test_the_real_mooncake_trace_is_shipped_as_published_and_its_stats_run(capsys):
    """data/mooncake_conversation.jsonl is Moonshot's file byte for byte (sha256, size), with its
    licence; every line passes load_trace as is (its own timestamps, 512-token blocks);
    `traces stats` reports it: 12,031 requests and the infinite-cache hit rate 0.374."""
    import hashlib

    from kimilab.__main__ import main

    (name, facts), = wl.REAL_TRACES.items()
    path = DATA / name
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == facts["sha256"] and len(raw) == facts["bytes"]
    assert (DATA / "LICENSE-mooncake-APACHE").read_text().lstrip().startswith("Apache License")
    readme = (DATA / "README.md").read_text()
    assert name in readme and facts["sha256"] in readme and facts["commit"] in readme
    assert main(["traces", "stats", str(path)]) == 0
    line = capsys.readouterr().out
    assert f"requests={facts['requests']} " in line and "reuse_upper_bound=0.374" in line
    assert "share_first_block=1.000" in line


@pytest.mark.parametrize("kind,n,params", [
    ("chat", 6, dict(system_len=40, user_len=20, reply_len=25, mean_turns=4)),
    ("agent", 4, dict(tool_prompt_len=70, task_len=15, mean_steps=5, branch_prob=0.5)),
    ("document", 30, dict(n_documents=4, doc_len=120)),
])
def test_spec_builders_share_the_public_defaults(kind, n, params):
    """Block ids from segments, with the public generator's defaults, equal to_trace of its tokens."""
    public, build = {"chat": (wl.chat_sessions, generators.chat_specs),
                     "agent": (wl.agent_loops, generators._agent_specs),
                     "document": (wl.document_qa, generators._document_specs)}[kind]
    defaults = {name: p.default for name, p in inspect.signature(public).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("seed", "vocab_size")}
    assert set(params) <= set(defaults)
    tokens = public(n, seed=7, vocab_size=2**31 - 1, **params)
    specs = build(n, 7, **{**defaults, **params})
    assert segments.specs_to_trace(specs, 32) == wl.to_trace(tokens, 32)


# ----------------------------------------------------------------------------- mixed workload


def test_mixed_workload_is_deterministic_and_windowed():
    a, b = wl.mixed_workload(0), wl.mixed_workload(0)
    assert a == b and a != wl.mixed_workload(1)
    assert [r.request_id for r in a] == list(range(len(a)))
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)
    assert {r.kind for r in a} == {"chat", "document"}
    assert all(r.tokens is None and r.hash_ids is None for r in a)
    docs = [r for r in a if r.kind == "document"]
    assert docs and all(20_000 <= r.arrival_ms <= 40_000 and r.input_length >= 8192 for r in docs)
    chats = [r for r in a if r.kind == "chat"]
    assert all(64 <= r.input_length <= 4096 and 32 <= r.output_length <= 512 for r in chats)
    with pytest.raises(ValueError, match="doc_window_ms"):
        wl.mixed_workload(0, doc_window_ms=(5, 1))
    with pytest.raises(ValueError, match="chat_rate_per_s"):
        wl.mixed_workload(0, chat_rate_per_s=-1.0)


# ----------------------------------------------------------------------------- the Request


def test_request_forms_and_validation():
    tok = Request(3, 10, 5, 2, tokens=np.arange(5), session=1, tenant="acme", kind="chat")
    assert tok.tokens.dtype == np.int32 and not tok.tokens.flags.writeable and tok.hash_ids is None
    assert tok == Request(3, 10, 5, 2, tokens=np.arange(5, dtype=np.int64), session=1, tenant="acme",
                          kind="chat")
    assert tok != Request(3, 10, 5, 2, tokens=np.arange(5), session=1, kind="chat")  # other tenant
    assert len({tok, Request(3, 10, 5, 2, tokens=np.arange(5), session=1, tenant="acme", kind="chat")}) == 1
    line = Request(0, 7, 1030, 4, hash_ids=(0, 1, 2))
    assert line.tenant == "default" and line.kind == "" and line.tokens is None
    assert line.n_blocks(512) == 3 and line.block_lengths(512).tolist() == [512, 512, 6]
    assert json.loads(line.to_json()) == {"timestamp": 7, "input_length": 1030, "output_length": 4,
                                          "hash_ids": [0, 1, 2]}
    counted = Request(0, 0, 100, 10, kind="document")  # lengths only: admission simulations
    with pytest.raises(ValueError, match="hash_ids=None"):
        counted.to_json()
    with pytest.raises(ValueError, match=r"^Request.input_length=4: expected len\(tokens\)=5$"):
        Request(0, 0, 4, 1, tokens=np.arange(5))
    with pytest.raises(ValueError, match=r"^Request.hash_ids\[1\]=-2: expected an int >= 0$"):
        Request(0, 0, 20, 1, hash_ids=(0, -2))
    with pytest.raises(ValueError, match=r"^Request.arrival_ms=True: expected an int >= 0$"):
        Request(0, True, 1, 1)
    with pytest.raises(ValueError, match="Request.tenant"):
        Request(0, 0, 1, 1, tenant="")
    with pytest.raises(ValueError, match="block_size"):
        line.n_blocks(0)
    with pytest.raises(ValueError, match=r"requests\[0\].tokens=None"):
        wl.to_trace([line])


def test_zipf_prefixes_skew_moves_only_the_prefixes():
    """Exponent 0 spreads requests over all prefixes; a high one piles them on prefix 0. Arrivals,
    tails and outputs are the same draws at every exponent (common random numbers for a sweep)."""
    flat, steep = wl.zipf_prefixes(2000, exponent=0.0), wl.zipf_prefixes(2000, exponent=2.5)
    assert flat == wl.zipf_prefixes(2000, exponent=0.0)
    heads = {e: np.array([r.hash_ids[0] for r in reqs]) for e, reqs in ((0, flat), (2.5, steep))}
    top = {e: np.mean(h == h.min()) for e, h in heads.items()}
    assert len(set(heads[0])) > 200 and top[0] < 0.02  # 256 prefixes, each about 1/256
    assert top[2.5] > 0.6  # 1 / zeta(2.5) ~ 0.75 of requests open with the top prefix
    for a, b in zip(flat, steep):
        assert (a.arrival_ms, a.output_length, len(a.hash_ids)) == (b.arrival_ms, b.output_length, len(b.hash_ids))
        assert a.hash_ids[16:] == b.hash_ids[16:]  # the private tail
        assert (len(a.hash_ids) - 1) * 512 < a.input_length <= len(a.hash_ids) * 512
    shared = [r.hash_ids[:16] for r in steep]
    assert all(h == tuple(range(h[0], h[0] + 16)) for h in shared)
    tails = [i for r in steep for i in r.hash_ids[16:]]
    assert len(tails) == len(set(tails)), "tails are private"


@pytest.mark.parametrize("kwargs, name", [({"exponent": -1.0}, "exponent"), ({"rate_per_s": 0.0}, "rate_per_s"),
                                          ({"n_prefixes": 0}, "n_prefixes"), ({"tail_blocks": (3, 2)}, "tail_blocks"),
                                          ({"n_requests": 0}, "n_requests"), ({"output_range": (5, 1)}, "output_range")])
def test_zipf_prefixes_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        wl.zipf_prefixes(**kwargs)


# ----- real agent traffic: the Claude Code sessions -----------------------------------------

CLAUDE_SOURCE = DATA.parent.parent / "shared" / "traces" / "claude-code"


def test_the_claude_code_sessions_are_shipped_converted_with_their_licence():
    """data/claude_code_sessions.jsonl.gz: the registry's sha256, 80 sessions, 5,668 requests,
    one id per 512 tokens; a session's prompts reuse ~96% of their tokens at infinite cache."""
    import hashlib

    from kimilab.traffic import CLAUDE_CODE, CLAUDE_CODE_SOURCE, load_sessions

    path = DATA / CLAUDE_CODE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CLAUDE_CODE_SOURCE["sha256"]
    assert (DATA / "LICENSE-claude-code-APACHE").read_text().lstrip().startswith("Apache License")
    readme = (DATA / "README.md").read_text()
    assert CLAUDE_CODE in readme and CLAUDE_CODE_SOURCE["sha256"] in readme and CLAUDE_CODE_SOURCE["commit"] in readme
    rows = load_sessions(path)
    assert len(rows) == CLAUDE_CODE_SOURCE["requests"] and len({r.session for r in rows}) == CLAUDE_CODE_SOURCE["sessions"]
    seen, hit, total = set(), 0, 0
    for r in sorted(rows, key=lambda r: (r.session, r.t_ms)):
        k = next((i for i, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        hit, total = hit + min(512 * k, r.input_length), total + r.input_length
        seen.update(r.hash_ids)
    assert 0.95 < hit / total < 0.97


@pytest.mark.skipif(not CLAUDE_SOURCE.is_dir(), reason="the original sessions are not on this machine")
def test_the_claude_code_conversion_is_reproducible_byte_for_byte(tmp_path):
    from kimilab.__main__ import main
    from kimilab.traffic import CLAUDE_CODE

    assert main(["traces", "convert-claude-code", str(CLAUDE_SOURCE), str(tmp_path / "cc.jsonl.gz")]) == 0
    assert (tmp_path / "cc.jsonl.gz").read_bytes() == (DATA / CLAUDE_CODE).read_bytes()


def test_agent_sessions_on_a_poisson_timeline():
    from kimilab.traffic import CLAUDE_CODE, agent_requests, load_sessions

    rows = load_sessions(DATA / CLAUDE_CODE)
    a, b = agent_requests(rows, 0.05, seed=1), agent_requests(rows, 0.05, seed=1)
    assert [(r.arrival_ms, r.hash_ids) for r in a] == [(r.arrival_ms, r.hash_ids) for r in b]
    assert len(a) == len(rows) and [r.request_id for r in a] == list(range(len(a)))
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(a, a[1:]))
    twice = agent_requests(rows, 0.05, seed=1, n_sessions=160)
    first = {h for r in twice if r.session < 80 for h in r.hash_ids}
    assert len(twice) == 2 * len(rows) and not first & {h for r in twice if r.session >= 80 for h in r.hash_ids}
    with pytest.raises(ValueError, match="sessions_per_s"):
        agent_requests(rows, 0.0)
