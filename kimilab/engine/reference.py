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
        return self.memory.pool.n_used + sum(live.req.input_length // self.block for live in self.queue)

    @property
    def prefill_backlog(self) -> int:
        return (sum(live.req.input_length + live.generated for live in self.queue)
                + sum(live.ctx - live.done for live in self.running if live.done < live.ctx))

    def _step(self, until: float) -> bool:
        running, queue = self.running, self.queue
        if not self._blocked:
            pending = sum(live.ctx - live.done for live in running if live.done < live.ctx)
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
        decoders = [live for live in running if live.done >= live.ctx]
        budget = self.budget - len(decoders)
        chunks = []
        for live in running:
            if live.done < live.ctx and budget > 0:
                c = min(live.ctx - live.done, budget)
                chunks.append((live, c))
                budget -= c
        n_dec = len(decoders)
        ctx = sum(live.req.input_length + live.generated for live in decoders)
        pieces = [(c, live.done) for live, c in chunks]
        dt = self.timer.step(n_dec, ctx, pieces)
        k = 1
        if not chunks and (self._blocked or not len(queue)):
            k = min(min(live.req.output_length - live.generated,
                        live.base + live.own_tokens - live.req.input_length - live.generated) for live in decoders)
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
        for live in decoders:
            live.generated += k
        for live, c in chunks:
            live.done += c
            live.marked = live.cache.mark_computed(live.path, live.done, live.marked)
            if live.done >= live.ctx and live.generated < live.req.output_length:
                self._token_after_prefill(live)
        for live in decoders:
            self.queue.charge(live.req.tenant, output_tokens=k)
        for live in [live for live in running if live.done >= live.ctx and live.generated >= live.req.output_length]:
            if live.first_token_s is None:
                live.first_token_s = self.clock
            self._finish(live)
        return True
