"""The engine's slow twin: every step walks every running request, as the loop reads on paper.

:class:`ReferenceEngine` is :class:`~kimilab.engine.Engine` with the plain step: it sums the
queue for the router's page count, grows every decoding request every step, and lists the
decoders, their contexts and the finishers by walking the running batch. The fast engine
keeps counters and a decode clock instead; ``tests/test_engine.py`` holds the two equal
(every latency, hit and preemption), and ``bench/bench_fleet.py`` times them side by side.
"""

from __future__ import annotations

import math

from kimilab.engine.engine import Engine

__all__ = ["ReferenceEngine"]


class ReferenceEngine(Engine):
    """The same engine, with the per-step work of the obvious loop (O(batch + queue) per event)."""

    @property
    def cache_pages(self) -> int:
        return self.memory.pool.n_used + sum(l.req.input_length // self.block for l in self.queue)

    @property
    def prefill_backlog(self) -> int:
        return (sum(l.req.input_length + l.generated for l in self.queue)
                + sum(l.ctx - l.done for l in self.running if l.done < l.ctx))

    def _step(self, until: float) -> bool:
        running, queue = self.running, self.queue
        if not self._blocked:
            pending = sum(l.ctx - l.done for l in running if l.done < l.ctx)
            while len(queue) and len(running) < self.max_batch and pending < self.budget:
                live = queue.peek()
                if not self._admit(live):
                    self._blocked = True
                    break
                assert queue.pop() is live
                queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)
                running.append(live)
                pending += live.ctx - live.done
        if not running:
            if not len(queue):
                return False
            for cache in self.memory.all_caches():
                cache.evict_all()
            live = queue.pop()
            if self._admit(live):
                queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)
                running.append(live)
            else:
                self.refused.append(live)
            self._blocked = False
            return True
        for live in list(running):
            if live.done >= live.ctx and live in running:
                self._grow(live)
        decoders = [l for l in running if l.done >= l.ctx]
        budget = self.budget - len(decoders)
        chunks = []
        for l in running:
            if l.done < l.ctx and budget > 0:
                c = min(l.ctx - l.done, budget)
                chunks.append((l, c))
                budget -= c
        n_dec = len(decoders)
        ctx = sum(l.req.input_length + l.generated for l in decoders)
        pieces = [(c, l.done) for l, c in chunks]
        dt = self.timer.step(n_dec, ctx, pieces)
        k = 1
        if not chunks and (self._blocked or not len(queue)):
            k = min(min(l.req.output_length - l.generated,
                        l.base + l.own_tokens - l.req.input_length - l.generated) for l in decoders)
            if until != math.inf:
                k = min(k, max(1, math.ceil((until - self.clock) / dt)))
            k = max(k, 1)
            if k > 1:
                dt = self.timer.step(n_dec, ctx + n_dec * (k - 1) // 2, pieces)
        if self.executor is not None:
            self.executor.run(decoders, chunks, k)
        start = self.clock
        self.clock += k * dt
        self._record_busy(start, k * dt)
        self.n_steps += k
        if self.steps is not None:
            self.steps.append((start, dt, k, n_dec, sum(c for _, c in chunks)))
        if n_dec:
            self.gaps.add_run(start, dt, k, n_dec)
        for l in decoders:
            l.generated += k
        for l, c in chunks:
            l.done += c
            l.marked = l.cache.mark_computed(l.path, l.done, l.marked)
            if l.done >= l.ctx and l.generated < l.req.output_length:
                self._token_after_prefill(l)
        for l in decoders:
            self.queue.charge(l.req.tenant, output_tokens=k)
        for l in [l for l in running if l.done >= l.ctx and l.generated >= l.req.output_length]:
            if l.first_token_s is None:
                l.first_token_s = self.clock
            self._finish(l)
        return True
