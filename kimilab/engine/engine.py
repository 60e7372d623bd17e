"""A continuous-batching engine on the hybrid cache, on deterministic simulated time.

Each step serves every decoding request one token and fills the rest of a token budget with
prefill chunks (chunked prefill, as vLLM and SGLang schedule). Requests are admitted against ONE
page pool (:class:`InstanceMemory`) that also holds the prefix cache: an admitted request pins its
prompt's blocks in the cache (its usable hit is where its prefill starts), takes pages for its live
KDA/conv states and for its KV past the cached blocks, and grows one page at a time while decoding.
When the pool is full (after evicting unpinned cache) the newest running request is preempted and
later recomputed from its usable hit; a finished request unpins its blocks, which stay cached. A
step is ONE forward pass of its decodes and prefill chunks, timed by :class:`kimilab.costs.StepTimer`
on the engine's :class:`~kimilab.costs.Deployment` (the weights read once, each
request's KV and states once, communication and the per-layer overhead); pages are
per device of that deployment. Steps that only decode are fast-forwarded in one go
until the next page boundary, finish or arrival, so traces of any length run in
seconds (the run of k steps is timed at its middle context).

Per-event work does not grow with the queue or the batch: the queued prompt blocks a
router reads are a counter, and decoding requests are kept on a *decode clock* (every
decoder makes the same tokens a step), with two heaps saying when the next one needs a
page and when the next one finishes. :class:`kimilab.engine.reference.ReferenceEngine`
is its slow twin: a standalone loop written from the rules above that walks every running
request each step and shares none of this scheduling code (only the pool and caches, the
records, the step timer, the gap log and the queues); a test holds the two equal.

``executor=`` (e.g. :class:`kimilab.engine.tensor.TensorExecutor`) is told every decision of this
one loop -- admission, each step's chunks and decodes (a fast-forwarded run of k decode steps is
handed over as k, and run token by token), preemption, finish -- and carries them out for real;
the decisions and times stay exactly those of the accounting run.
"""

from __future__ import annotations

import bisect
import math

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer
from kimilab.engine.clock import DecodeClock
from kimilab.engine.dp import DpDeviceTimer
from kimilab.engine.fairness import FairQueue, FifoQueue
from kimilab.engine.gaps import GapLog
from kimilab.engine.live import Finished, Live
from kimilab.engine.memory import InstanceMemory
from kimilab.engine.speculation import Speculation, spec_timer
from kimilab.prefix.policies import Placement
from kimilab.validate import check_int

__all__ = ["Engine", "prompt_of"]


def prompt_of(req) -> dict:
    """The prefix-cache lookup arguments of a request: its tokens, or its hash ids and length."""
    if req.tokens is not None:
        return {"tokens": req.tokens}
    return {"keys": req.hash_ids if req.hash_ids is not None else (), "n_tokens": req.input_length}


class Engine(DecodeClock):
    """One serving instance. ``submit`` requests, ``advance(t)`` its clock, read ``finished``.

    ``token_budget`` (tokens a step may carry) and ``max_batch`` (requests running at once) are the
    deployment's ``max_batched_tokens`` and ``max_num_seqs`` unless given. ``gaps`` records every
    output token's time since the request's previous token (:class:`~kimilab.engine.gaps.GapLog`)."""

    def __init__(self, config: ModelConfig, *, deployment: Deployment, capacity_tokens: int | None,
                 block_size: int = 512, token_budget: int | None = None, max_batch: int | None = None,
                 policy: str | None = None,
                 quotas: dict[str, float] | None = None, fair: bool = False, timer: StepTimer | None = None,
                 index: int = 0, bucket_s: float = 10.0, keep_steps: bool = False, executor=None,
                 dp_device: bool = False, host_bytes: float | None = None, host_link=None, store=None,
                 overlap_loads: bool = False, speculation: Speculation | None = None):
        self.config, self.block = config, check_int("block_size", block_size, 1)
        if token_budget is None:
            token_budget = deployment.max_batched_tokens
        if max_batch is None:
            max_batch = deployment.max_num_seqs
        self.budget = check_int("token_budget", token_budget, 1, unit="tokens per step")
        self.max_batch = check_int("max_batch", max_batch, 1)
        if policy is None:  # a transformer reuses every cached token: its states are free
            policy = "dual" if config.kda_layers else "kv-only"
        self.capacity_tokens, self.policy, self.quotas = capacity_tokens, policy, quotas
        dp = deployment.attention == "dp" and deployment.n_devices > 1
        if dp != bool(dp_device):
            raise ValueError(f"deployment={deployment.name!r}: an Engine models one attention group (tensor "
                             "parallel); under DP-attention each device is an engine of its own: pass "
                             "dp_device=True (and only then; kimilab.engine.dp says what that leaves out)")
        self.deployment = deployment
        self.memory = InstanceMemory(config, deployment=deployment, block_size=block_size,
                                     capacity_tokens=capacity_tokens, policy=policy, quotas=quotas,
                                     host_bytes=host_bytes, host_link=host_link, store=store,
                                     overlap_loads=overlap_loads)
        self.timer = timer or (DpDeviceTimer(config, deployment) if dp else StepTimer(config, deployment))
        if self.timer.deployment != deployment or self.timer.cfg != config:
            raise ValueError(f"timer: built for {self.timer.cfg.name} on {self.timer.deployment.name}, "
                             f"expected {config.name} on {deployment.name}")
        self.spec = spec_timer(config, deployment, speculation, self.timer, dp)
        self._lookahead = speculation.k if speculation is not None else 0  # KV slots a verify writes ahead
        self.queue = FairQueue() if fair else FifoQueue()
        self._fair = fair  # only fair queues count the tokens each tenant was served
        self.index, self.bucket_s = index, bucket_s
        self.running: list[Live] = []
        self.finished: list[Finished] = []
        self.refused: list = []
        self.clock = 0.0
        self.alive = True
        self.busy: dict[int, float] = {}  # time bucket -> busy seconds
        self.steps: list | None = [] if keep_steps else None  # (start_s, dt_s, k, n_decode, prefill_tokens)
        self.gaps = GapLog(bucket_s)  # time between tokens, token by token (bounded memory)
        self.n_steps = self.preemptions = 0
        self._blocked = False  # the queue head did not fit; retry after memory is freed
        self._seq = 0
        self._queued_blocks = 0  # prompt blocks of the queued requests (what cache_pages adds)
        self._backlog = 0  # prompt tokens still to prefill, queued and running (prefill_backlog)
        self._prefilling: list[Live] = []  # running requests still prefilling, in admission order
        self._start_clock()
        self.executor = executor  # None: accounting only
        if executor is not None:
            executor.bind(self)

    # ----- what routers read ------------------------------------------------
    @property
    def load(self) -> int:
        """Requests running or waiting here."""
        return len(self.running) + len(self.queue)

    @property
    def cache_pages(self) -> int:
        """Pages in use plus the prompt blocks of queued requests (what SGLang's router tree counts
        as soon as it routes a request, before the instance admits it): a counter, not a sum."""
        return self.memory.pool.n_used + self._queued_blocks

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens still to prefill here: queued prompts whole, running ones what is left (a
        counter; what a token-weighted router balances)."""
        return self._backlog

    def match(self, req) -> tuple[int, int]:
        """(KV hit, usable hit) a request would get here, without touching the cache. A router's
        estimate: it counts checkpoints whose prefill is still under way (computed, as a rule,
        before a request routed now is admitted); admission itself starts only from computed ones."""
        kv, usable, _ = self.route_view(req)
        return kv, usable

    def route_view(self, req) -> tuple[int, int, int]:
        """(KV hit, usable hit, left behind) for a request routed here now. *Left behind* is the
        deepest position in (usable, KV hit] where the cache's policy would admit a checkpoint for
        it: KV already here that its prefill makes usable for the next request (0: none)."""
        cache = self.memory.cache(req.tenant)
        if req.tokens is None:  # hash ids: the tree's direct walk (every instance is asked, per request)
            nodes = cache.tree.match_keys(req.hash_ids if req.hash_ids is not None else (), req.input_length)
            hit = nodes[-1].end if nodes else 0
        else:
            m = cache.tree.match(tokens=req.tokens)
            nodes, hit = m.nodes, m.hit_tokens
        limit = req.input_length - 1
        kv = min(hit, limit)
        if cache.policy.free_states:
            return kv, kv, 0
        usable = 0
        for node in reversed(nodes):
            if node.payload is not None and node.end <= limit:
                usable = node.end
                break
        if hit <= usable:
            return kv, usable, 0
        bs, n_full = self.block, req.input_length // self.block
        m = len(nodes)
        branch = 0 < m < n_full and len(nodes[-1].children) >= 1  # its next block would be a second child
        ends = [bs * (j + 1) for j in range(n_full)]
        left = [ends[i] for i in cache.policy.positions(Placement(ends, m, usable, req.input_length, branch))
                if usable < ends[i] <= hit]  # KV cached here (whole blocks, even the prompt's last)
        return kv, usable, max(left, default=0)

    # ----- requests -----------------------------------------------------------
    def fits_alone(self, req) -> bool:
        """Could the request run in an empty pool (its blocks, states and a checkpoint or two)?"""
        mem = self.memory
        pages = -(-(req.input_length + req.output_length + 1 + self._lookahead) // self.block) + 3 * mem.state_pages
        return pages <= mem.pool.n_pages

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
        self._queued_blocks += live.req.input_length // self.block
        self._backlog += live.req.input_length + live.generated

    def _free_own(self, live: Live) -> None:
        pool = self.memory.pool
        for a in live.allocs:
            pool.free(a)
        live.allocs = []
        if live.done >= live.ctx:
            live.cache.finish(live.path, live.marked)
        else:  # preempted mid-prefill: what it did not compute leaves the cache
            live.cache.abandon(live.path, live.done, live.marked)
        live.path, live.cache = [], None
        self._blocked = False

    def _admit(self, live: Live) -> bool:
        mem, req = self.memory, live.req
        cache = mem.cache(req.tenant)
        out, path, usable_node, _ = cache.begin(**prompt_of(req))
        base = path[-1].end if path else 0
        live.ctx = req.input_length + live.generated
        kv_pages = -(-(live.ctx + 1 - base) // self.block)
        full = (req.input_length // self.block) * self.block
        if base < full or not mem.make_room(req.tenant, mem.state_pages + kv_pages):
            cache.abandon(path, 0)  # refused: nothing of it was computed
            return False
        pool = mem.pool
        live.allocs = [pool.allocate("kv", kv_pages)]
        if mem.state_pages:  # a model without KDA layers has no state to hold
            live.allocs.append(pool.allocate("kda_state", mem.state_pages))
        live.cache, live.path, live.base, live.own_tokens = cache, path, base, kv_pages * self.block
        # its prefill starts here
        live.marked = bisect.bisect_right([node.end for node in path], out.usable_hit)
        live.hit, live.kv_hit, live.done = out.usable_hit, out.kv_hit, out.usable_hit
        self._backlog -= out.usable_hit  # its prefill starts at the hit
        live.served += out.usable_hit
        live.computed += live.ctx - out.usable_hit
        live.contexts += live.ctx
        if live.admissions == 0:
            live.first_hit, live.first_kv_hit = out.usable_hit, out.kv_hit
        live.admissions += 1
        self._seq += 1
        live.seq = self._seq
        if self.executor is not None:
            self.executor.admit(live, usable_node)
        return True

    def _preempt_newest(self) -> Live:
        victim = self.running.pop()
        self._leave(victim)
        if victim.done >= victim.ctx:  # decoding: its last token came out when the last step ended (now)
            victim.last_token_s = self.clock
        self._backlog += victim.req.input_length + victim.generated - (victim.ctx - victim.done)
        if self.executor is not None:
            self.executor.drop(victim)
        self._free_own(victim)
        victim.preemptions += 1
        self.preemptions += 1
        victim.done = 0
        self.queue.push_front(victim)
        self._queued_blocks += victim.req.input_length // self.block
        return victim

    def _grow(self, live: Live) -> bool:
        """Room for one more token of a decoding request; False if it was preempted itself."""
        mem = self.memory
        while live.base + live.own_tokens < live.req.input_length + live.generated + 1 + self._lookahead:
            if mem.make_room(live.req.tenant, 1):
                live.allocs.append(mem.pool.allocate("kv", 1))
                live.own_tokens += self.block
            elif self._preempt_newest() is live:
                return False
        return True

    def _finish(self, live: Live) -> None:
        self.running.remove(live)
        self._leave(live)
        if self.executor is not None:
            self.executor.finish(live)
        self._free_own(live)
        r = live.req
        self.finished.append(Finished(r.request_id, r.tenant, self.index, live.arrival_s, live.first_token_s,
                                      self.clock, r.input_length, r.output_length, live.first_hit,
                                      live.first_kv_hit, live.served, live.computed, live.preemptions,
                                      live.restarts, live.generated, live.contexts))

    # ----- time ---------------------------------------------------------------
    def _record_busy(self, start: float, dt: float) -> None:
        w, busy = self.bucket_s, self.busy
        while dt > 0:
            b = int(start // w)
            if (b + 1) * w <= start:  # floor division rounded an edge down (0.06 // 0.02 == 2.0)
                b += 1
            part = min(dt, (b + 1) * w - start)
            busy[b] = busy.get(b, 0.0) + part
            start += part
            dt -= part

    def _admit_from_queue(self) -> None:
        """Admit queued requests while the batch, the token budget and the pool allow."""
        running, queue, prefilling = self.running, self.queue, self._prefilling
        pending = sum(live.ctx - live.done for live in prefilling)
        while len(queue) and len(running) < self.max_batch and pending < self.budget:
            live = queue.peek()
            if not self._admit(live):
                self._blocked = True
                break
            assert queue.pop() is live
            self._queued_blocks -= live.req.input_length // self.block
            queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)  # after the pop: it reorders
            self._run(live)
            pending += live.ctx - live.done

    def _run(self, live: Live) -> None:
        """An admitted request runs: it prefills, or decodes at once if its whole context is here
        (handed over by a prefill instance, :mod:`kimilab.engine.disagg`)."""
        self.running.append(live)
        if live.done < live.ctx:
            self._prefilling.append(live)
        else:
            self._anchor(live)

    def _step(self, until: float) -> bool:
        """Run one step (or a run of identical decode steps); False if there was nothing to run."""
        running, queue = self.running, self.queue
        if not self._blocked:
            self._admit_from_queue()
        if not running:
            if not len(queue):
                return False
            for cache in self.memory.all_caches():  # idle, and the head still does not fit: its own
                cache.evict_all()  # path's checkpoints pin memory; start it from an empty cache
            live = queue.pop()
            self._queued_blocks -= live.req.input_length // self.block
            if self._admit(live):
                queue.charge(live.req.tenant, prompt_tokens=live.ctx - live.hit)
                self._run(live)
            else:
                self.refused.append(live)
                self._backlog -= live.req.input_length + live.generated
            self._blocked = False
            return True
        G = self._G
        for live in self._due(self._grow_heap, G):  # decoders whose next token needs a page
            if live.decoding_now:  # not preempted by an older one's growth in this loop
                self._sync(live)
                if self._grow(live):
                    self._push_grow(live)
        n_dec = self._n_dec
        budget = self.budget - n_dec * (1 + self._lookahead)  # a verify takes its drafts from the budget too
        chunks = []
        for live in self._prefilling:
            if budget <= 0:
                break
            c = min(live.ctx - live.done, budget)
            chunks.append((live, c))
            budget -= c
        ctx = self._ctx_base + n_dec * G
        pieces = [(c, live.done) for live, c in chunks]
        jump = not chunks and (self._blocked or not len(queue))  # nothing changes until an event
        k, dt, kept = self._plan(n_dec, ctx, pieces, jump, until)
        if self.memory.host is not None and (load := self.memory.take_link_seconds()):
            if k > 1:  # host-tier loads since the last step: one step, which waits for them (or overlaps them)
                k, dt, kept = self._plan(n_dec, ctx, pieces, False, until)
            dt = self.memory.step_seconds(dt, load)
        if self.executor is not None:  # real tensors: k decode steps token by token, and the chunks
            self.executor.run([live for live in running if live.decoding_now], chunks, k, kept)
        start = self.clock
        self.clock += k * dt
        self._record_busy(start, k * dt)
        self.n_steps += k
        if self.steps is not None:
            self.steps.append((start, dt, k, n_dec, sum(c for _, c in chunks)))
        if n_dec:  # steps run back to back while anything decodes: each decoder's gap is the step
            self.gaps.add_run(start, dt, k, n_dec)
        made = k if kept is None else sum(kept)  # tokens each decoder made in the run
        self._G = G = G + made
        done = self._due(self._done_heap, G + 1)  # decoders that made their last token (perhaps fewer than made)
        if self._fair:  # each decoder was served its tokens
            for tenant, n in self._dec_tenants.items():
                if n:
                    queue.charge(tenant, output_tokens=made * n)
            for live in done:  # a speculative step may yield more than a finishing decoder needed
                queue.charge(live.req.tenant, output_tokens=live.req.output_length - live.gen0 - G + live.g0)
        for live, c in chunks:
            live.done += c
            self._backlog -= c
            live.marked = live.cache.mark_computed(live.path, live.done, live.marked)  # others may start from here now
            if live.done >= live.ctx:
                if live.generated < live.req.output_length:  # the prefill's last logits: one token
                    self._token_after_prefill(live)
                if live.generated >= live.req.output_length:
                    done.append(live)
                else:
                    self._anchor(live)
        if chunks:
            self._prefilling = [live for live in self._prefilling if live.done < live.ctx]
        done.sort(key=lambda live: live.seq)
        for live in done:
            if live.first_token_s is None:  # asked for no tokens: done when its prefill is
                live.first_token_s = self.clock
            self._finish(live)
        return True

    def _token_after_prefill(self, live: Live) -> None:
        """A (re-)prefill's last logits give ``live`` a token now: its first, or, after a preemption or a
        failure, one whose gap since the last streamed token is recorded."""
        live.generated += 1
        if live.first_token_s is None:
            live.first_token_s = self.clock
        else:
            self.gaps.add(self.clock, self.clock - live.last_token_s)
        live.last_token_s = self.clock

    def advance(self, until: float, *, stop_on_finish: bool = False) -> None:
        """Run steps that start before ``until`` (the last may end after it); idle time is skipped.
        ``stop_on_finish``: return after the first step in which a request finished."""
        done = len(self.finished)
        while self.alive and self.clock < until:
            if not self._step(until):
                if until != math.inf:
                    self.clock = until
                return
            if stop_on_finish and len(self.finished) > done:
                return

    def drain(self) -> None:
        """Run until nothing is left."""
        self.advance(math.inf)

    def fail(self) -> list[Live]:
        """The instance dies: its pool, cache and running requests are lost; returns them to re-route."""
        for live in self.running:
            self._leave(live)
            if live.done >= live.ctx:  # decoding: its last token came out when the last step ended
                live.last_token_s = self.clock
        lost = self.running + self.queue.clear()
        self.running = []
        self._queued_blocks = self._backlog = 0
        for live in lost:
            if self.executor is not None:
                self.executor.drop(live)
            live.lose()
        self.alive = False
        self.close()
        return lost

    def close(self) -> None:
        """Done with this engine: free its pool and caches now (``InstanceMemory.close``); results stay."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def check_no_leak(self) -> None:
        """After the last request: nothing pinned, every used page belongs to a cache."""
        assert not self.running and not len(self.queue)
        self.memory.check_no_leak()
