"""Little branching conversations for the prefix-cache twin tests (test_runs, test_segments).

A turn is ``(path, short)``: ``path`` is a list of small choices, one per block, and a
block's hash id names the whole prefix up to it (as Mooncake's ids do); ``short`` tokens
are cut from the prompt's last block.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kimilab.traffic import Request

__all__ = ["requests_from", "conversations"]


def requests_from(turns, block_size: int) -> list[Request]:
    """One request per turn, at time t, with one output token."""
    out = []
    for t, (path, short) in enumerate(turns):
        ids = tuple(hash(tuple(path[: j + 1])) % 10**9 for j in range(len(path)))
        out.append(Request(t, t, len(path) * block_size - short, 1, hash_ids=ids))
    return out


@st.composite
def conversations(draw, max_turns: int = 40, max_fresh: int = 10, max_new: int = 8, shorts=(0, 0, 1)):
    """Prompts that branch, repeat, stop short and extend earlier ones (multi-turn), as real traffic
    does: each turn either starts afresh (up to ``max_fresh`` blocks) or cuts an earlier turn's path
    and adds up to ``max_new`` blocks; its ``short`` is drawn from ``shorts``."""
    turns = []
    for _ in range(draw(st.integers(1, max_turns))):
        if turns and draw(st.booleans()):
            base = draw(st.sampled_from(turns))[0]
            path = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, 2), max_size=max_new))
        else:
            path = draw(st.lists(st.integers(0, 2), max_size=max_fresh))
        turns.append((path or [0], draw(st.sampled_from(list(shorts)))))
    return turns
