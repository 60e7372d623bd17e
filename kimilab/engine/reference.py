"""The engine's slow twin: the serving loop written out plainly, sharing no scheduling code.

:class:`ReferenceEngine` is not an :class:`~kimilab.engine.Engine` and calls none of its
methods. It is written from the rules alone -- admission in queue order while batch, token
budget and pool allow (a head that does not fit blocks the queue until memory is freed),
chunked prefill, decoders growing a KV page at a time, the newest request preempted and
later recomputed when the pool is full, decode-only steps run k at a time up to the next
event -- and keeps no counter, heap or decode clock: every step it walks every running
request (who decodes, who needs a page, who prefills, how far a run may go, who finished),
and a router's page count and backlog are sums over the queue and the batch. It shares only
what lies below the scheduler: pool and prefix caches, the Live/Finished records, the step
timer, the gap log and the queues. ``tests/test_engine.py`` holds the two equal, decision for
decision, so a bug in the engine's admission, growth or preemption shows up there;
``bench/bench_fleet.py`` times them side by side.
"""

from __future__ import annotations

import math

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer
from kimilab.engine.dp import DpDeviceTimer
from kimilab.engine.fairness import FairQueue, FifoQueue
from kimilab.engine.gaps import GapLog
from kimilab.engine.live import Finished, Live
from kimilab.engine.memory import InstanceMemory
from kimilab.engine.speculation import spec_timer
from kimilab.prefix.policies import Placement
from kimilab.validate import check_int

__all__ = ["ReferenceEngine"]


def _prompt(req) -> dict:
    """How the prefix cache looks a request up: by its tokens, or by its hash ids and length."""
    if req.tokens is not None:
        return {"tokens": req.tokens}
    return {"keys": req.hash_ids if req.hash_ids is not None else (), "n_tokens": req.input_length}


class ReferenceEngine:
    """One serving instance, the obvious way (O(batch + queue) per step and per router question).

    Same constructor, attributes and interface as :class:`~kimilab.engine.Engine` (``submit``,
    ``advance``, ``drain``, ``fail``, ``load``, ``cache_pages``, ``prefill_backlog``, ``match``,
    ``route_view``, ``finished``, ``refused``, ``busy``, ``gaps``, ``steps``, ``executor=``), so a
    :class:`~kimilab.fleet.Fleet` runs on it with ``engine_class=ReferenceEngine``."""

    def __init__(self, config: ModelConfig, *, deployment: Deployment, capacity_tokens: int | None,
                 block_size: int = 512, token_budget: int | None = None, max_batch: int | None = None,
                 policy: str | None = None,
                 quotas: dict[str, float] | None = None, fair: bool = False, timer: StepTimer | None = None,
                 index: int = 0, bucket_s: float = 10.0, keep_steps: bool = False, executor=None,
                 dp_device: bool = False, host_bytes: float | None = None, host_link=None, store=None,
                 overlap_loads: bool = False, speculation=None):
        self.config, self.block = config, check_int("block_size", block_size, 1)
        self.budget = check_int("token_budget", deployment.max_batched_tokens if token_budget is None
                                else token_budget, 1, unit="tokens per step")
        self.max_batch = check_int("max_batch", deployment.max_num_seqs if max_batch is None else max_batch, 1)
        if policy is None:  # a transformer reuses every cached token
            policy = "dual" if config.kda_layers else "kv-only"
        self.capacity_tokens, self.policy, self.quotas = capacity_tokens, policy, quotas
        dp = deployment.attention == "dp" and deployment.n_devices > 1
        if dp != bool(dp_device):
            raise ValueError(f"deployment={deployment.name!r}: an engine models one attention group; under "
                             "DP-attention each device is an engine of its own: pass dp_device=True (only then)")
        self.deployment = deployment
        self.memory = InstanceMemory(config, deployment=deployment, block_size=block_size,
                                     capacity_tokens=capacity_tokens, policy=policy, quotas=quotas,
                                     host_bytes=host_bytes, host_link=host_link, store=store,
                                     overlap_loads=overlap_loads)
        self.timer = timer or (DpDeviceTimer(config, deployment) if dp else StepTimer(config, deployment))
        if self.timer.deployment != deployment or self.timer.cfg != config:
            raise ValueError(f"timer: built for {self.timer.cfg.name} on {self.timer.deployment.name}, "
                             f"expected {config.name} on {deployment.name}")
        self.spec = spec_timer(config, deployment, speculation, self.timer, dp)  # verify steps' seconds
        self.ahead = 0 if speculation is None else speculation.k  # KV slots a verify writes past the context
        self.queue = FairQueue() if fair else FifoQueue()
        self.index, self.bucket_s = index, bucket_s
        self.running: list[Live] = []  # in admission order
        self.finished: list[Finished] = []
        self.refused: list = []
        self.clock = 0.0
        self.alive = True
        self.busy: dict[int, float] = {}
        self.steps: list | None = [] if keep_steps else None
        self.gaps = GapLog(bucket_s)
        self.n_steps = self.preemptions = 0
        self.blocked = False  # the queue's head did not fit: no admission until memory is freed
        self.admissions = 0
        self.executor = executor
        if executor is not None:
            executor.bind(self)

    # ----- what routers read: sums, every time ----------------------------------------------
    @property
    def load(self) -> int:
        return len(self.running) + len(self.queue)

    @property
    def cache_pages(self) -> int:
        """Pages in use plus the prompt blocks of every queued request."""
        return self.memory.pool.n_used + sum(live.req.input_length // self.block for live in self.queue)

    @property
    def prefill_backlog(self) -> int:
        """Queued prompts (with what they streamed) whole, plus what running prefills have left."""
        return (sum(live.req.input_length + live.generated for live in self.queue)
                + sum(live.ctx - live.done for live in self.running if live.done < live.ctx))

    def match(self, req) -> tuple[int, int]:
        kv, usable, _ = self.route_view(req)
        return kv, usable

    def route_view(self, req) -> tuple[int, int, int]:
        """(KV hit, usable hit, left behind) a router estimates here; checkpoints still being computed count."""
        cache = self.memory.cache(req.tenant)
        m = cache.tree.match(**_prompt(req))
        nodes, hit, limit = m.nodes, m.hit_tokens, req.input_length - 1
        kv = min(hit, limit)
        if cache.policy.free_states:
            return kv, kv, 0
        usable = max((node.end for node in nodes if node.payload is not None and node.end <= limit), default=0)
        if hit <= usable:
            return kv, usable, 0
        n_full = req.input_length // self.block
        ends = [self.block * (j + 1) for j in range(n_full)]
        branch = 0 < len(nodes) < n_full and len(nodes[-1].children) >= 1
        picked = cache.policy.positions(Placement(ends, len(nodes), usable, req.input_length, branch))
        return kv, usable, max((ends[i] for i in picked if usable < ends[i] <= hit), default=0)

    # ----- requests ------------------------------------------------------------------------
    def fits_alone(self, req) -> bool:
        """Its whole context's blocks, its states and a checkpoint or two, in an empty pool."""
        pages = -(-(req.input_length + req.output_length + 1 + self.ahead) // self.block) + 3 * self.memory.state_pages
        return pages <= self.memory.pool.n_pages

    def submit(self, live: Live) -> None:
        if not self.alive:
            raise RuntimeError(f"instance {self.index} has failed: route elsewhere")
        if self.executor is not None:
            self.executor.check(live.req)
        if not self.fits_alone(live.req):
            self.refused.append(live)
            return
        live.instance = self.index
        self.queue.push(live)

    def _try_admit(self, live: Live) -> bool:
        """Pin the prompt's path in the cache and take the request's own pages (states, and KV from
        the last cached whole block to one token past its context). False, nothing held, if no room."""
        mem, req, bs = self.memory, live.req, self.block
        cache = mem.cache(req.tenant)
        out, path, usable_node, _ = cache.begin(**_prompt(req))
        live.ctx = req.input_length + live.generated  # its prompt and what it streamed so far
        base = path[-1].end if path else 0
        kv_pages = -(-(live.ctx + 1 - base) // bs)
        if base < req.input_length // bs * bs or not mem.make_room(req.tenant, mem.state_pages + kv_pages):
            cache.abandon(path, 0)
            return False
        live.allocs = [mem.pool.allocate("kv", kv_pages)]
        if mem.state_pages:
            live.allocs.append(mem.pool.allocate("kda_state", mem.state_pages))
        live.cache, live.path, live.base, live.own_tokens = cache, path, base, kv_pages * bs
        live.hit, live.kv_hit, live.done = out.usable_hit, out.kv_hit, out.usable_hit
        live.marked = sum(1 for node in path if node.end <= out.usable_hit)  # nodes its prefill has passed
        live.served += out.usable_hit
        live.computed += live.ctx - out.usable_hit
        live.contexts += live.ctx
        if live.admissions == 0:
            live.first_hit, live.first_kv_hit = out.usable_hit, out.kv_hit
        live.admissions += 1
        self.admissions += 1
        live.seq = self.admissions
        if self.executor is not None:
            self.executor.admit(live, usable_node)
        return True

    def _release(self, live: Live) -> None:
        """Give back a request's own pages and unpin its path (what its prefill did not compute leaves)."""
        for alloc in live.allocs:
            self.memory.pool.free(alloc)
        live.allocs = []
        if live.done >= live.ctx:
            live.cache.finish(live.path, live.marked)
        else:
            live.cache.abandon(live.path, live.done, live.marked)
        live.path, live.cache = [], None
        self.blocked = False  # memory was freed: the queue's head may fit now

    def _preempt(self) -> Live:
        """The newest running request loses its memory and goes back to the queue's head (recompute)."""
        victim = self.running.pop()
        if self.executor is not None:
            self.executor.drop(victim)
        self._release(victim)
        victim.preemptions += 1
        self.preemptions += 1
        victim.done = 0
        self.queue.push_front(victim)
        return victim

    def _make_page_room(self, live: Live) -> None:
        """Pages until a decoding request's KV holds its context and the token it makes next,
        preempting the newest running request while the pool is full (it may be ``live`` itself)."""
        mem = self.memory
        while live.base + live.own_tokens < live.req.input_length + live.generated + 1 + self.ahead:
            if mem.make_room(live.req.tenant, 1):
                live.allocs.append(mem.pool.allocate("kv", 1))
                live.own_tokens += self.block
            elif self._preempt() is live:
                return

    def _retire(self, live: Live) -> None:
        self.running.remove(live)
        if self.executor is not None:
            self.executor.finish(live)
        self._release(live)
        r = live.req
        self.finished.append(Finished(r.request_id, r.tenant, self.index, live.arrival_s, live.first_token_s,
                                      self.clock, r.input_length, r.output_length, live.first_hit,
                                      live.first_kv_hit, live.served, live.computed, live.preemptions,
                                      live.restarts, live.generated, live.contexts))

    # ----- time ------------------------------------------------------------------------------
    def _add_busy(self, start: float, dt: float) -> None:
        """Busy seconds into the ``bucket_s`` buckets the interval [start, start + dt) crosses."""
        w = self.bucket_s
        while dt > 0:
            b = int(start // w)
            if (b + 1) * w <= start:  # floor division rounded an edge down
                b += 1
            part = min(dt, (b + 1) * w - start)
            self.busy[b] = self.busy.get(b, 0.0) + part
            start += part
            dt -= part

    def _one_step(self, until: float) -> bool:
        """One forward pass (or a run of k identical decode passes); False if there is nothing to run."""
        running, queue = self.running, self.queue
        if not self.blocked:  # admit in queue order while the batch, the budget and the pool allow
            while (len(queue) and len(running) < self.max_batch
                   and sum(live.ctx - live.done for live in running if live.done < live.ctx) < self.budget):
                live = queue.peek()
                if not self._try_admit(live):
                    self.blocked = True
                    break
                queue.pop()
                queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)
                running.append(live)
        if not running:
            if not len(queue):
                return False
            for cache in self.memory.all_caches():  # idle, and the head does not fit: clear the cache
                cache.evict_all()
            live = queue.pop()
            if self._try_admit(live):
                queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)
                running.append(live)
            else:  # it does not fit even now
                self.refused.append(live)
            self.blocked = False
            return True
        for live in list(running):  # each decoder, oldest first, gets the page its next token needs
            if live in running and live.done >= live.ctx:
                self._make_page_room(live)
        decoders = [live for live in running if live.done >= live.ctx]
        room = self.budget - len(decoders) * (1 + self.ahead)  # a token each (and its drafts); prefill chunks fill the rest
        chunks = []
        for live in running:
            if live.done < live.ctx and room > 0:
                chunks.append((live, min(live.ctx - live.done, room)))
                room -= chunks[-1][1]
        n_dec = len(decoders)
        ctx = sum(live.req.input_length + live.generated for live in decoders)
        pieces = [(c, live.done) for live, c in chunks]
        spec = self.spec  # with speculation, every decoder keeps the same tokens in a step
        kept = None if spec is None else [spec.spec.tokens(self.n_steps)]
        dt = self.timer.step(n_dec, ctx, pieces) if spec is None else spec.step(n_dec, ctx, pieces, kept)
        k = 1
        if not chunks and (self.blocked or not len(queue)):  # only decodes, and nobody can be admitted
            need = min(min(live.req.output_length - live.generated,  # its last token
                           live.base + live.own_tokens - live.req.input_length - live.generated - self.ahead)
                       for live in decoders)  # ... or its next page
            limit = need if until == math.inf else min(need, max(1, math.ceil((until - self.clock) / dt)))
            if spec is None:
                k = max(limit, 1)
                if k > 1:  # timed at the run's middle context
                    dt = self.timer.step(n_dec, ctx + n_dec * (k - 1) // 2, pieces)
            else:  # steps until the tokens kept reach ``need``
                while len(kept) < limit and sum(kept) < need:
                    kept.append(spec.spec.tokens(self.n_steps + len(kept)))
                k = len(kept)
                if k > 1:
                    dt = spec.step(n_dec, ctx + n_dec * sum(kept[:-1]) // 2, pieces, kept)
        load = self.memory.take_link_seconds()  # host-tier loads admitted since the last step
        if load > 0:  # this step waits for them, or overlaps them: one step, longer by what is left
            kept = None if spec is None else kept[:1]
            one = self.timer.step(n_dec, ctx, pieces) if spec is None else spec.step(n_dec, ctx, pieces, kept)
            k, dt = 1, self.memory.step_seconds(one, load)
        if self.executor is not None:
            self.executor.run(decoders, chunks, k, kept)
        start = self.clock
        self.clock += k * dt
        self._add_busy(start, k * dt)
        self.n_steps += k
        if self.steps is not None:
            self.steps.append((start, dt, k, n_dec, sum(c for _, c in chunks)))
        if n_dec:
            self.gaps.add_run(start, dt, k, n_dec)
        served: dict[str, int] = {}
        for live in decoders:
            made = min(k if kept is None else sum(kept), live.req.output_length - live.generated)
            live.generated += made
            live.last_token_s = self.clock
            served[live.req.tenant] = served.get(live.req.tenant, 0) + made
        for tenant, n in served.items():
            queue.charge(tenant, output_tokens=n)
        for live, c in chunks:
            live.done += c
            live.marked = live.cache.mark_computed(live.path, live.done, live.marked)
            if live.done >= live.ctx and live.generated < live.req.output_length:
                live.generated += 1  # the prefill's last logits: its first token, or the next after a recompute
                if live.first_token_s is None:
                    live.first_token_s = self.clock
                else:
                    self.gaps.add(self.clock, self.clock - live.last_token_s)
                live.last_token_s = self.clock
        for live in [live for live in running if live.done >= live.ctx and live.generated >= live.req.output_length]:
            if live.first_token_s is None:  # asked for no tokens: done when its prefill is
                live.first_token_s = self.clock
            self._retire(live)
        return True

    def advance(self, until: float, *, stop_on_finish: bool = False) -> None:
        """Run steps that start before ``until``; idle time is skipped."""
        n = len(self.finished)
        while self.alive and self.clock < until:
            if not self._one_step(until):
                if until != math.inf:
                    self.clock = until
                return
            if stop_on_finish and len(self.finished) > n:
                return

    def drain(self) -> None:
        self.advance(math.inf)

    def fail(self) -> list[Live]:
        """The instance dies with its pool and cache; its running and queued requests are returned."""
        lost = self.running + self.queue.clear()
        self.running = []
        for live in lost:
            if self.executor is not None:
                self.executor.drop(live)
            live.lose()
        self.alive = False
        self.close()
        return lost

    def close(self) -> None:
        """Done: unlink the caches' trees so they are freed as soon as they are dropped."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def check_no_leak(self) -> None:
        """After the last request: nothing pinned, every used page belongs to a cache."""
        assert not self.running and not len(self.queue)
        self.memory.check_no_leak()
