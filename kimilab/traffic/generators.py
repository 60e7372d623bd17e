"""Seeded workload generators: chat, agent loops, document Q&A, a Mooncake-like trace, a mixed load,
and shared prefixes of Zipf popularity (the skew knob real traces do not have).

Every generator is seeded with ``numpy.random.default_rng`` and returns the
same requests on every machine. The chat, agent and document generators
build each prompt from segments (:mod:`kimilab.traffic.segments`) and return
token-level :class:`~kimilab.traffic.request.Request` objects;
:func:`mooncake_conversation_like` returns hash-id requests (one trace line
each) without materialising its ~143M tokens; :func:`mixed_workload` returns
length-only requests (chats and long documents) for admission simulations.
"""

from __future__ import annotations

import math

import numpy as np

from kimilab.traffic.request import DEFAULT_BLOCK_SIZE, Request
from kimilab.traffic.segments import (DEFAULT_VOCAB, Spec, Uids, draw_lengths, materialise,
                                      poisson_times_ms, sorted_specs, specs_to_trace)
from kimilab.validate import check_float, check_int

__all__ = ["chat_specs", "chat_sessions", "agent_loops", "document_qa", "mooncake_conversation_like",
           "mixed_workload", "zipf_prefixes"]


def chat_specs(n_sessions: int, seed: int, *, mean_turns: float, max_turns: int,
               system_len: int, user_len: float, reply_len: float, session_rate_per_s: float,
               think_ms: float) -> list[Spec]:
    """Multi-turn chat as segment specs: each turn re-sends the history, the last reply included."""
    check_int("n_sessions", n_sessions, 1)
    check_int("max_turns", max_turns, 1)
    check_int("system_len", system_len, 0)
    if mean_turns < 1:
        raise ValueError(f"mean_turns={mean_turns!r}: expected >= 1")
    rng = np.random.default_rng(seed)
    uid = Uids()
    system = uid()
    starts = poisson_times_ms(rng, n_sessions, session_rate_per_s)
    turns = np.minimum(1 + rng.poisson(mean_turns - 1, n_sessions), max_turns)
    out: list[tuple[float, int, Spec]] = []
    for s in range(n_sessions):
        n = int(turns[s])
        users = draw_lengths(rng, user_len, n)
        replies = draw_lengths(rng, reply_len, n)
        gaps = rng.exponential(think_ms, n)
        history: list[tuple[int, int]] = [(system, system_len)] if system_len else []
        t = float(starts[s])
        for k in range(n):
            history.append((uid(), int(users[k])))
            out.append((t, len(out), Spec(0, tuple(history), int(replies[k]), s)))
            history.append((uid(), int(replies[k])))  # the reply is re-sent next turn
            t += gaps[k]
    return sorted_specs(out)


def chat_sessions(n_sessions: int = 60, *, seed: int = 0, mean_turns: float = 5.0,
                  max_turns: int = 16, system_len: int = 1200, user_len: float = 250.0,
                  reply_len: float = 350.0, session_rate_per_s: float = 0.5,
                  think_ms: float = 20_000.0, vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Multi-turn chat: every turn re-sends system prompt + whole history + a new message.

    Sessions start as a Poisson process (``session_rate_per_s``); turns within a
    session are ``think_ms`` apart on average (exponential); turns per session
    are ``1 + Poisson(mean_turns - 1)`` capped at ``max_turns``. The previous
    turn's reply (``output_length`` tokens) is part of the next prompt.
    """
    specs = chat_specs(n_sessions, seed, mean_turns=mean_turns, max_turns=max_turns,
                        system_len=system_len, user_len=user_len, reply_len=reply_len,
                        session_rate_per_s=session_rate_per_s, think_ms=think_ms)
    return materialise(specs, seed, vocab_size)


def _agent_specs(n_tasks: int, seed: int, *, tool_prompt_len: int, task_len: float,
                 mean_steps: float, action_len: float, tool_output_len: float,
                 branch_prob: float, n_branches: int, sub_steps: int,
                 task_rate_per_s: float, step_ms: float) -> list[Spec]:
    check_int("n_tasks", n_tasks, 1)
    check_int("tool_prompt_len", tool_prompt_len, 0)
    check_int("n_branches", n_branches, 1)
    check_int("sub_steps", sub_steps, 1)
    if not 0.0 <= branch_prob <= 1.0:
        raise ValueError(f"branch_prob={branch_prob!r}: expected a probability in [0, 1]")
    if mean_steps < 1:
        raise ValueError(f"mean_steps={mean_steps!r}: expected >= 1")
    rng = np.random.default_rng(seed)
    uid = Uids()
    tools = uid()
    starts = poisson_times_ms(rng, n_tasks, task_rate_per_s)
    steps = 1 + rng.poisson(mean_steps - 1, n_tasks)
    out: list[tuple[float, int, Spec]] = []

    def run(context: list, n_steps: int, t: float, session: int) -> tuple[list, float]:
        """One agent loop: call the model, get an action, append action + tool output."""
        actions = draw_lengths(rng, action_len, n_steps)
        outputs = draw_lengths(rng, tool_output_len, n_steps, sigma=0.9)
        gaps = rng.exponential(step_ms, n_steps)
        for k in range(n_steps):
            out.append((t, len(out), Spec(0, tuple(context), int(actions[k]), session)))
            context = context + [(uid(), int(actions[k])), (uid(), int(outputs[k]))]
            t += gaps[k]
        return context, t

    for task in range(n_tasks):
        context = [(tools, tool_prompt_len)] if tool_prompt_len else []
        context.append((uid(), int(draw_lengths(rng, task_len, 1)[0])))
        t = float(starts[task])
        for step in range(int(steps[task])):
            context, t = run(context, 1, t, task)
            if step + 1 < steps[task] and rng.random() < branch_prob:
                # Sub-tasks fork from this exact context, run in parallel, then the
                # main loop resumes with a summary of their results appended.
                ends = []
                for _ in range(n_branches):
                    instruction = [(uid(), int(draw_lengths(rng, task_len, 1)[0]))]
                    _, t_end = run(context + instruction, sub_steps, t, task)
                    ends.append(t_end)
                context = context + [(uid(), int(draw_lengths(rng, tool_output_len, 1)[0]))]
                t = max(ends)
    return sorted_specs(out)


def agent_loops(n_tasks: int = 16, *, seed: int = 0, tool_prompt_len: int = 6000,
                task_len: float = 300.0, mean_steps: float = 8.0, action_len: float = 120.0,
                tool_output_len: float = 500.0, branch_prob: float = 0.25, n_branches: int = 3,
                sub_steps: int = 3, task_rate_per_s: float = 0.2, step_ms: float = 3_000.0,
                vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Agent / tool loops: a long shared tool prompt, tool outputs appended step by step.

    Each task: tool prompt (shared by all tasks) + task text, then ``1 +
    Poisson(mean_steps - 1)`` steps; each step's prompt is the previous one plus
    the model's action (its ``output_length``) and the tool's output. After a
    step, with probability ``branch_prob``, ``n_branches`` sub-tasks fork from
    that same context (each adds its own instruction and runs ``sub_steps``
    steps); the main loop then resumes with their summary appended.
    """
    specs = _agent_specs(n_tasks, seed, tool_prompt_len=tool_prompt_len, task_len=task_len,
                         mean_steps=mean_steps, action_len=action_len,
                         tool_output_len=tool_output_len, branch_prob=branch_prob,
                         n_branches=n_branches, sub_steps=sub_steps,
                         task_rate_per_s=task_rate_per_s, step_ms=step_ms)
    return materialise(specs, seed, vocab_size)


def _document_specs(n_questions: int, seed: int, *, n_documents: int, system_len: int,
                    doc_len: float, question_len: float, answer_len: float, zipf_a: float,
                    followup_prob: float, rate_per_s: float) -> list[Spec]:
    check_int("n_questions", n_questions, 1)
    check_int("n_documents", n_documents, 1)
    check_int("system_len", system_len, 0)
    if not 0.0 <= followup_prob < 1.0:
        raise ValueError(f"followup_prob={followup_prob!r}: expected a probability in [0, 1)")
    rng = np.random.default_rng(seed)
    uid = Uids()
    system = uid()
    docs = [(uid(), int(n)) for n in draw_lengths(rng, doc_len, n_documents, sigma=0.5)]
    popularity = 1.0 / np.arange(1, n_documents + 1) ** zipf_a
    popularity /= popularity.sum()
    times = poisson_times_ms(rng, n_questions, rate_per_s)
    picks = rng.choice(n_documents, n_questions, p=popularity)
    out: list[tuple[float, int, Spec]] = []
    produced = 0
    reader = 0
    while produced < n_questions:
        base = [(system, system_len)] if system_len else []
        context = base + [docs[int(picks[reader])]]
        t = float(times[reader])
        # A reader asks one question, then follow-ups with probability followup_prob.
        while produced < n_questions:
            context = context + [(uid(), int(draw_lengths(rng, question_len, 1)[0]))]
            answer = int(draw_lengths(rng, answer_len, 1)[0])
            out.append((t, len(out), Spec(0, tuple(context), answer, reader)))
            produced += 1
            context = context + [(uid(), answer)]
            t += rng.exponential(15_000.0)
            if rng.random() >= followup_prob:
                break
        reader += 1
    return sorted_specs(out)


def document_qa(n_questions: int = 300, *, seed: int = 0, n_documents: int = 12,
                system_len: int = 400, doc_len: float = 8000.0, question_len: float = 60.0,
                answer_len: float = 200.0, zipf_a: float = 1.1, followup_prob: float = 0.3,
                rate_per_s: float = 1.0, vocab_size: int = DEFAULT_VOCAB) -> list[Request]:
    """Shared-document Q&A: many readers ask about a few popular documents.

    Prompt = system prompt + document + question (+ earlier Q&A of the same
    reader for follow-ups). Readers arrive as a Poisson process; each picks a
    document with Zipf(``zipf_a``) popularity and asks follow-ups with
    probability ``followup_prob``.
    """
    specs = _document_specs(n_questions, seed, n_documents=n_documents, system_len=system_len,
                            doc_len=doc_len, question_len=question_len, answer_len=answer_len,
                            zipf_a=zipf_a, followup_prob=followup_prob, rate_per_s=rate_per_s)
    return materialise(specs, seed, vocab_size)


def _conversation_specs(seed: int, *, duration_s: float, n_sessions: int, system_len: int,
                        opening_median: float, opening_sigma: float, document_prob: float,
                        document_median: float, document_sigma: float, mean_turns: float,
                        user_len: float, reply_len: float, think_ms: float,
                        max_input: int) -> list[Spec]:
    rng = np.random.default_rng(seed)
    uid = Uids()
    system = uid()
    duration_ms = duration_s * 1000.0
    starts = np.sort(rng.uniform(0.0, duration_ms, n_sessions))  # Poisson given the count
    turns = rng.geometric(1.0 / mean_turns, n_sessions)
    openings = rng.lognormal(math.log(opening_median), opening_sigma, n_sessions)
    documents = rng.lognormal(math.log(document_median), document_sigma, n_sessions)
    openings = np.rint(openings + np.where(rng.random(n_sessions) < document_prob, documents, 0.0))
    out: list[tuple[float, int, Spec]] = []
    for s in range(n_sessions):
        n = int(turns[s])
        users = draw_lengths(rng, user_len, n, sigma=1.0)
        replies = draw_lengths(rng, reply_len, n, sigma=0.8, hi=4096)
        gaps = rng.exponential(think_ms, n)
        history = [(system, system_len), (uid(), int(max(1, openings[s])))]
        length = system_len + int(max(1, openings[s]))
        t = float(starts[s])
        for k in range(n):
            if k:
                history.append((uid(), int(users[k])))
                length += int(users[k])
            if length > max_input or t >= duration_ms:
                break  # the conversation outgrew the context window / the hour ended
            out.append((t, len(out), Spec(0, tuple(history), int(replies[k]), s)))
            history.append((uid(), int(replies[k])))
            length += int(replies[k])
            t += gaps[k] + 20.0 * replies[k]  # think time + time to stream the reply
    return sorted_specs(out)


def mooncake_conversation_like(seed: int = 0, *, duration_s: float = 3600.0,
                               n_sessions: int = 4150, system_len: int = 1000,
                               opening_median: float = 4100.0, opening_sigma: float = 0.9,
                               document_prob: float = 0.08, document_median: float = 40_000.0,
                               document_sigma: float = 0.6,
                               mean_turns: float = 3.0, user_len: float = 250.0,
                               reply_len: float = 340.0, think_ms: float = 60_000.0,
                               max_input: int = 131_072,
                               block_size: int = DEFAULT_BLOCK_SIZE) -> list[Request]:
    """A trace shaped like Mooncake's published conversation trace: hash-id Requests.

    Targets (Mooncake FAST'25 conversation trace): ~12,000 requests in an hour,
    input mean ~12k / p50 ~7k / p99 ~85k tokens, output mean ~340, one common
    first block. Structure: ``n_sessions`` conversations start uniformly in the
    hour; each opens with a log-normal "opening" (context + question; with
    probability ``document_prob`` plus a long pasted document, which makes the
    heavy p99 tail) after a shared ``system_len``-token system prompt, then runs a geometric
    number of turns (mean ``mean_turns``), each re-sending the history plus the
    previous reply and a new message. Turns beyond the hour or beyond
    ``max_input`` tokens are dropped. Records are produced straight from the
    segment structure (no tokens; the full trace would be ~150M tokens).
    """
    if system_len < block_size:
        raise ValueError(
            f"system_len={system_len!r}: expected >= block_size={block_size} so that every "
            "request shares its first block"
        )
    specs = _conversation_specs(seed, duration_s=duration_s, n_sessions=n_sessions,
                                system_len=system_len, opening_median=opening_median,
                                opening_sigma=opening_sigma, document_prob=document_prob,
                                document_median=document_median,
                                document_sigma=document_sigma, mean_turns=mean_turns,
                                user_len=user_len, reply_len=reply_len, think_ms=think_ms,
                                max_input=max_input)
    return specs_to_trace(specs, block_size)


def mixed_workload(seed: int = 0, *, duration_ms: int = 60_000, chat_rate_per_s: float = 10.0,
                   chat_prompt_median: int = 700, chat_prompt_range: tuple[int, int] = (64, 4096),
                   chat_output_range: tuple[int, int] = (32, 512),
                   doc_window_ms: tuple[int, int] = (20_000, 40_000), doc_rate_per_s: float = 1.0,
                   doc_prompt_range: tuple[int, int] = (8192, 65536),
                   doc_output_range: tuple[int, int] = (64, 512)) -> list[Request]:
    """Chats arrive all along (Poisson); documents arrive only inside ``doc_window_ms``.

    Chat prompts are log-normal around ``chat_prompt_median`` (clipped to the
    range), document prompts log-uniform over their range; outputs uniform.
    Requests carry lengths only (no tokens, no block ids) and ``kind`` "chat" or
    "document". Same seed, same list, on every machine.
    """
    for name, value in (("duration_ms", duration_ms), ("chat_rate_per_s", chat_rate_per_s),
                        ("doc_rate_per_s", doc_rate_per_s)):
        check_float(name, value, minimum=0)
    lo, hi = doc_window_ms
    if not 0 <= lo <= hi <= duration_ms:
        raise ValueError(f"doc_window_ms={doc_window_ms!r}: expected 0 <= start <= end <= duration_ms")
    rng = np.random.default_rng(seed)

    def arrivals(rate, start, end):
        n = rng.poisson(rate * (end - start) / 1000.0)
        return np.sort(rng.uniform(start, end, size=n)).astype(np.int64)

    chats_t = arrivals(chat_rate_per_s, 0, duration_ms)
    chat_prompt = np.clip(np.round(chat_prompt_median * np.exp(0.8 * rng.standard_normal(chats_t.size))),
                          *chat_prompt_range).astype(np.int64)
    chat_out = rng.integers(chat_output_range[0], chat_output_range[1] + 1, size=chats_t.size)
    docs_t = arrivals(doc_rate_per_s, lo, hi)
    doc_prompt = np.round(np.exp(rng.uniform(np.log(doc_prompt_range[0]), np.log(doc_prompt_range[1]),
                                             size=docs_t.size))).astype(np.int64)
    doc_out = rng.integers(doc_output_range[0], doc_output_range[1] + 1, size=docs_t.size)
    rows = [(int(t), 0, "chat", int(p), int(o)) for t, p, o in zip(chats_t, chat_prompt, chat_out)]
    rows += [(int(t), 1, "document", int(p), int(o)) for t, p, o in zip(docs_t, doc_prompt, doc_out)]
    rows.sort()
    return [Request(i, t, p, o, kind=kind) for i, (t, _, kind, p, o) in enumerate(rows)]


def zipf_prefixes(n_requests: int = 1000, *, exponent: float = 1.0, n_prefixes: int = 256,
                  prefix_blocks: int = 16, seed: int = 0, rate_per_s: float = 6.0,
                  tail_blocks: tuple[int, int] = (1, 8), output_range: tuple[int, int] = (50, 600),
                  block_size: int = DEFAULT_BLOCK_SIZE) -> list[Request]:
    """Requests that open with one of ``n_prefixes`` shared prefixes, drawn Zipf(``exponent``).

    Prefix i (0-based) has weight ``(i + 1) ** -exponent``: exponent 0 is uniform
    popularity, 1-2 is a few hot documents or system prompts. Each prefix is
    ``prefix_blocks`` blocks; each request adds its own tail of ``tail_blocks`` blocks
    (its last one partial) and arrives Poisson at ``rate_per_s``. Hash-id requests;
    the same seed gives the same list for every exponent except the prefixes drawn.
    """
    n_requests = check_int("n_requests", n_requests, 1)
    n_prefixes = check_int("n_prefixes", n_prefixes, 1)
    prefix_blocks = check_int("prefix_blocks", prefix_blocks, 1, unit="blocks")
    exponent = check_float("exponent", exponent, minimum=0)
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s={rate_per_s!r}: expected a positive rate (requests per second)")
    lo, hi = tail_blocks
    if not 1 <= lo <= hi:
        raise ValueError(f"tail_blocks={tail_blocks!r}: expected 1 <= low <= high")
    if not 0 <= output_range[0] <= output_range[1]:
        raise ValueError(f"output_range={output_range!r}: expected 0 <= low <= high (tokens)")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1000.0 / rate_per_s, n_requests)
    tails = rng.integers(lo, hi + 1, n_requests)
    short = rng.integers(0, block_size - 1, n_requests)
    outs = rng.integers(output_range[0], output_range[1] + 1, n_requests)
    u = rng.random(n_requests)  # one uniform per request: the exponent only bends the inverse CDF
    weights = np.arange(1, n_prefixes + 1, dtype=np.float64) ** -float(exponent)
    which = np.searchsorted(np.cumsum(weights) / weights.sum(), u, side="right")
    base, fresh = 10**9, 2 * 10**9
    out, t = [], 0.0
    for i in range(n_requests):
        t += gaps[i]
        head = tuple(range(base + int(which[i]) * prefix_blocks, base + (int(which[i]) + 1) * prefix_blocks))
        ids = head + tuple(range(fresh, fresh + int(tails[i])))
        fresh += int(tails[i])
        out.append(Request(i, int(t), len(ids) * block_size - int(short[i]), int(outs[i]), hash_ids=ids))
    return out
