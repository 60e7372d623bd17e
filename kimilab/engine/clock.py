"""Decoding requests on a decode clock: what the engine needs of them in O(1) per step.

Every decoding request makes the same number of tokens in a step (one; with speculation, the
step's accepted drafts plus one, :mod:`kimilab.engine.speculation`), so the engine keeps
one counter ``G`` (tokens each decoder has made since the engine started) and anchors a
request when it starts decoding: its ``generated`` is ``gen0 + G - g0``. The batch's
summed context is one running sum, and two heaps say, in decode-clock ticks, when the
next decoder needs a KV page and when the next one has made its last token. A step
then costs O(its events), not O(batch); :class:`~kimilab.engine.reference.ReferenceEngine`,
a standalone twin that neither subclasses the engine nor uses this clock, walks the batch
instead, and a test holds the two equal.
"""

from __future__ import annotations

import heapq

import math

from kimilab.engine.live import Live

__all__ = ["DecodeClock"]


class DecodeClock:
    """The decoders' bookkeeping, mixed into :class:`~kimilab.engine.Engine`."""

    def _start_clock(self) -> None:
        self._G = 0
        self._n_dec = 0
        self._ctx_base = 0  # sum over decoders of input_length + gen0 - g0: their context is this + n_dec * G
        self._grow_heap: list = []  # (G after which it needs a page, serial, epoch, live)
        self._done_heap: list = []  # (G at which it has made every token, serial, epoch, live)
        self._serial = 0
        self._dec_tenants: dict[str, int] = {}  # decoders per tenant (fair queues charge their tokens)

    def _anchor(self, live: Live) -> None:
        """``live`` starts decoding now (its ``generated`` is current): put it on the clock."""
        live.g0, live.gen0 = self._G, live.generated
        live.epoch += 1
        live.decoding_now = True
        self._n_dec += 1
        self._ctx_base += live.req.input_length + live.generated - self._G
        t = live.req.tenant
        self._dec_tenants[t] = self._dec_tenants.get(t, 0) + 1
        self._serial += 1
        done_at = self._G + live.req.output_length - live.generated
        heapq.heappush(self._done_heap, (done_at, self._serial, live.epoch, live))
        self._push_grow(live)

    def _push_grow(self, live: Live) -> None:
        slack = live.base + live.own_tokens - live.req.input_length - live.generated - 1 - self._lookahead
        self._serial += 1
        heapq.heappush(self._grow_heap, (self._G + slack, self._serial, live.epoch, live))

    def _sync(self, live: Live) -> None:
        """Bring a decoder's ``generated`` up to the decode clock."""
        live.generated = min(live.gen0 + self._G - live.g0, live.req.output_length)  # a verify may overshoot

    def _leave(self, live: Live) -> None:
        """``live`` stops decoding here (finished, preempted or lost): its ``generated`` made current."""
        if not live.decoding_now:
            if live in self._prefilling:  # a short list: the requests the token budget admitted
                self._prefilling.remove(live)
            return
        self._sync(live)
        live.decoding_now = False
        live.epoch += 1  # its heap entries are stale from now on
        self._n_dec -= 1
        self._ctx_base -= live.req.input_length + live.gen0 - live.g0
        self._dec_tenants[live.req.tenant] -= 1

    def _valid(self, entry) -> bool:
        live = entry[3]
        return live.epoch == entry[2] and live.decoding_now

    def _due(self, heap: list, limit: int) -> list:
        """Pop the valid entries of ``heap`` whose key is below ``limit``: their lives, oldest admission first."""
        out = []
        while heap and heap[0][0] < limit:
            entry = heapq.heappop(heap)
            if self._valid(entry):
                out.append(entry[3])
        out.sort(key=lambda live: live.seq)
        return out

    def _top(self, heap: list) -> int | None:
        """The smallest valid key of ``heap`` (stale entries dropped on the way)."""
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None


    def _plan(self, n_dec: int, ctx: int, pieces: list, jump: bool, until: float) -> tuple[int, float, list | None]:
        """(steps, seconds each, tokens each decoder keeps per step or None for one) of what runs now:
        one step, or with ``jump`` the run of decode-only steps up to the next event (a decoder that
        needs a page or makes its last token), at most to ``until``, timed at its middle context."""
        spec, G = self.spec, self._G
        first = None if spec is None else [spec.spec.tokens(self.n_steps)]
        dt = self.timer.step(n_dec, ctx, pieces) if spec is None else spec.step(n_dec, ctx, pieces, first)
        if not jump:
            return 1, dt, first
        need = min(self._top(self._done_heap), self._top(self._grow_heap) + 1) - G  # decode-clock ticks
        limit = need if until == math.inf else min(need, max(1, math.ceil((until - self.clock) / dt)))
        if spec is None:
            k = max(limit, 1)
            if k > 1:  # contexts grow by one a step: time the run at its middle context
                dt = self.timer.step(n_dec, ctx + n_dec * (k - 1) // 2, pieces)
            return k, dt, None
        k, kept = spec.spec.steps_to(self.n_steps, need, limit)
        if k > 1:  # contexts grow by the tokens kept: time the run at its middle context
            dt = spec.step(n_dec, ctx + n_dec * sum(kept[:-1]) // 2, pieces, kept)
        return k, dt, kept
