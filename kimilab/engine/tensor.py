"""The engine's second mode: the same scheduling loop, run on the reduced model's real tensors.

:class:`Engine` decides; an *executor* carries the decisions out. Passing
``executor=TensorExecutor(model)`` makes every prefill chunk the scheduler grants
a real ``Model.prefill`` on that request's own :class:`~kimilab.model.HybridCache`
and every decode a real ``Model.decode`` (greedy), so each request's tokens
equal ``Model.generate`` run alone on its prompt -- the exactness twin of
batching, chunked prefill, prefix reuse and preemption. The decisions and the
simulated times are the accounting engine's, unchanged: a fast-forwarded run of
k decode-only steps (nothing is admitted, grows or finishes inside it) is run
here as k real decode steps per request, token by token.

What decides and what holds the tensors:

* **Hits are decided by the accounting cache** (:class:`~kimilab.prefix.HybridPrefixCache`
  on the engine's page pool, keyed by the prompt's token blocks): a request
  admitted with usable hit ``h`` resumes at the checkpoint node ending at ``h``.
* **The tensors live in a side store** keyed by that accounting checkpoint
  (``node.payload``): a copy of a HybridCache (KV of every global layer for the
  first ``node.end`` tokens, plus every KDA and conv state at ``node.end``). A
  request's prefill is cut at every checkpoint position on its pinned path that
  the store lacks, and a copy is stored there. An entry is valid while its node
  is alive and still carries that checkpoint object, so when the accounting
  cache evicts a checkpoint, its tensors are unreachable (and pruned). The
  store's bytes are *not* the pool's pages: the pool's accounting (one page per
  KV block, shared; checkpoint pages) is what the scheduler sees.
* The accounting cache admits a checkpoint when a request *begins*, before its
  prefill has reached it; the engine marks it computed when a prefill passes its
  position, takes it back if the request is refused or preempted first
  (``HybridPrefixCache.abandon``), and admission starts only from computed ones.
  So every usable hit has a stored snapshot, and a hit without one is an error
  here (the two caches would disagree), not something quietly recomputed.

Under a host tier or a shared store (:mod:`kimilab.prefix.host`) a checkpoint's snapshot goes
with its copy: written to the host, it is kept on the host's node; loaded back, it is stored
again for the checkpoint the load admits. A store shared by several engines shares the snapshots.

One executor serves one Engine; re-routing a failed instance's requests to
another instance's executor is not supported (their streamed tokens stay here).

A preempted request loses its cache; on re-admission it restarts from its usable
hit and prefills its prompt *plus the tokens it already streamed* (the
scheduler's ``ctx``), whose last logits give its next token. Decodes run one
request at a time (``Model.decode`` is per request; stacking requests would
change the matmuls' rounding), so this mode is about exactness, not speed.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kimilab.engine.engine import Engine
from kimilab.engine.live import Live
from kimilab.model import HybridCache, Model
from kimilab.prefix import make_policy
from kimilab.prefix.host import TieredPrefixCache
from kimilab.speculative import greedy_accept, make_rollback, verify
from kimilab.speculative.loop import _scratch_pool

__all__ = ["Executor", "TensorExecutor", "serve", "submit"]


class Executor:
    """The hooks :class:`Engine` calls when it has one; this base does nothing (an engine
    with it is the accounting engine, which a test holds equal to one without)."""

    engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        """Called once by the engine's constructor."""
        if self.engine is not None:
            raise ValueError(f"executor: already bound to instance {self.engine.index}; one executor per Engine")
        self.engine = engine

    def check(self, req) -> None:
        """Raise ValueError if ``req`` cannot be served (called by ``submit``)."""

    def admit(self, live: Live, usable_node) -> None:
        """``live`` was admitted: ``live.path`` is pinned, ``live.hit`` is where its prefill starts."""

    def run(self, decoders: list[Live], chunks: list[tuple[Live, int]], k: int, kept: list[int] | None = None) -> None:
        """One step (before the engine counts it): each ``(live, c)`` prefills ``c`` tokens from
        ``live.done``; each decoder makes ``k`` tokens (``k > 1`` only when there are no chunks), or
        with speculation runs ``k`` verify steps keeping ``kept[i]`` tokens in step i (fewer if it
        finishes)."""

    def drop(self, live: Live) -> None:
        """``live`` lost its memory (preempted, or its instance failed)."""

    def hand_off(self, live: Live) -> object:
        """``live``'s prefill is done here and it moves to a decode instance: what goes with it."""

    def receive(self, live: Live, payload: object) -> None:
        """``live`` was admitted with the context a prefill instance handed over (``payload``)."""

    def finish(self, live: Live) -> None:
        """``live`` made its last token."""


class TensorExecutor(Executor):
    """Runs an engine's decisions on ``model`` (greedy); ``tokens[request_id]`` is what each request made.

    Counters: ``store_hit_tokens`` (hit tokens resumed from a stored snapshot),
    ``chunk_log`` (``(request_id, start, n_tokens)`` of every prefill chunk run).
    """

    def __init__(self, model: Model):
        if not isinstance(model, Model):
            raise ValueError(f"model: expected a kimilab.model.Model, got {type(model).__name__}")
        self.model = model
        self.tokens: dict[int, list[int]] = {}  # request id -> tokens made so far (streamed)
        self._caches: dict[Live, HybridCache] = {}  # running requests' caches (made at their first chunk)
        self._store: dict[object, tuple[object, HybridCache]] = {}  # checkpoint -> (node, snapshot)
        self._start: dict[Live, object] = {}  # admitted, no cache yet -> its usable node (or None)
        self._spec: dict[Live, tuple] = {}  # decoding speculatively -> (rollback strategy, greedy reference, start)
        self.store_hit_tokens = 0
        self.chunk_log: list[tuple[int, int, int]] = []

    # ----- hooks ----------------------------------------------------------------
    def bind(self, engine: Engine) -> None:
        if engine.config != self.model.config:
            raise ValueError(f"config: the engine runs {engine.config.name!r}, the model is "
                             f"{self.model.config.name!r}; build the Engine with model.config")
        if make_policy(engine.policy).free_states:
            raise ValueError(f"policy={engine.policy!r} keeps no states, so a hybrid model cannot resume "
                             "from its hits; use every-block, align, ends, ends+branch, dual or no-states")
        super().bind(engine)
        for cache in engine.memory.all_caches():
            if isinstance(cache, TieredPrefixCache):  # snapshots travel with the checkpoints' host copies
                cache.state_tensors = self._snapshot
                cache.load_state = self._loaded

    def check(self, req) -> None:
        if getattr(req, "tokens", None) is None:
            raise ValueError(f"req.tokens: request {getattr(req, 'request_id', '?')} has no token ids; tensor mode "
                             "runs the model on them (build the Request with tokens=...)")
        toks = req.tokens
        vocab = self.model.config.vocab_size
        if toks.size == 0:
            raise ValueError(f"req.tokens: request {req.request_id} has an empty prompt")
        if toks.max() >= vocab:
            raise ValueError(f"req.tokens: request {req.request_id} has id {int(toks.max())} outside the "
                             f"vocabulary 0..{vocab - 1} (config.vocab_size)")
        if req.request_id in self.tokens:
            raise ValueError(f"req.request_id={req.request_id}: already submitted here (outputs are keyed by it)")
        self.tokens[req.request_id] = []

    def admit(self, live: Live, usable_node) -> None:
        self._prune()
        self._start[live] = usable_node

    def drop(self, live: Live) -> None:
        self._caches.pop(live, None)
        self._start.pop(live, None)
        spec = self._spec.pop(live, None)
        if spec is not None:
            spec[0].close()

    def hand_off(self, live: Live) -> tuple:
        """Its cache (the prompt's KV and states) and the token its prefill made."""
        return self._caches.pop(live), list(self.tokens[live.req.request_id])

    def receive(self, live: Live, payload: tuple) -> None:
        cache, made = payload
        assert cache.seq_len == live.req.input_length + len(made) - 1, (cache.seq_len, len(made))
        self._start.pop(live, None)
        self._caches[live], self.tokens[live.req.request_id] = cache, list(made)

    def finish(self, live: Live) -> None:
        made = self.tokens[live.req.request_id]
        assert len(made) == live.req.output_length, (live.req.request_id, len(made), live.req.output_length)
        spec = self._spec.get(live)
        if spec is not None:  # the strategy's last word: the cache ends as plain decoding leaves it
            spec[0].finish(self._caches[live])
        self.drop(live)

    # ----- speculative decoding ------------------------------------------------------
    def _speculate(self, live: Live, cache: HybridCache, made: list[int], kept: list[int]) -> None:
        """Verify steps on ``live``'s real cache with the engine's rollback strategy: draft k tokens,
        verify them in one forward, keep the agreed ones and the target's own token, roll back.

        The drafts are an instrument (as :class:`~kimilab.speculative.ControlledDrafter` is): the
        target's greedy continuation, computed once per admission, with the draft after the
        ``kept[i] - 1`` the engine drew made wrong. The tokens kept are the verify's own argmax, so
        they equal greedy decoding only if the verify and the rollback are exact; that each step
        keeps exactly what the engine drew is asserted."""
        spec = self.engine.spec
        k, vocab, want = spec.spec.k, self.model.config.vocab_size, live.req.output_length
        entry = self._spec.get(live)
        if entry is None:
            pool, _ = _scratch_pool(self.model, cache, spec.strategy, k)
            strategy = make_rollback(spec.strategy, self.model, pool, k, owner=f"spec-{live.req.request_id}")
            reference = self.model.generate(list(self.context(live)[:live.req.input_length]) + made,
                                            want - len(made) + k)
            entry = self._spec[live] = (strategy, reference, len(made))
        strategy, reference, start = entry
        for m in kept:
            if len(made) >= want:
                break
            at = len(made) - start
            drafts = [int(t) for t in reference[at:at + k]]
            if m <= k:  # the (m)th draft is rejected: make it wrong
                drafts[m - 1] = (drafts[m - 1] + 1) % vocab
            window = [made[-1]] + drafts
            logits, captures, view = verify(self.model, window, strategy.current(cache))
            strategy.save(view, captures)
            j, bonus = greedy_accept(drafts, logits)
            if j != m - 1:
                raise AssertionError(f"request {live.req.request_id}: the verify kept {j} drafts, the engine drew "
                                     f"{m - 1} (a rollback left a wrong state)")
            new = (drafts[:j] + [bonus])[:want - len(made)]
            strategy.restore(cache, list(range(len(new))))
            made += new

    def run(self, decoders: list[Live], chunks: list[tuple[Live, int]], k: int, kept: list[int] | None = None) -> None:
        model = self.model
        for live in decoders:  # each absorbs its last token and reads the next, k times
            cache, made = self._caches[live], self.tokens[live.req.request_id]
            if kept is not None:  # speculative: k verify steps, each keeping what the engine drew
                self._speculate(live, cache, made, kept)
                continue
            assert cache.seq_len == live.req.input_length + len(made) - 1
            for _ in range(k):
                made.append(int(np.argmax(model.decode(made[-1], cache))))
        for live, c in chunks:  # in running order: an older request's snapshot is ready for a newer one
            cache = self._caches.get(live)
            if cache is None:
                cache = self._begin(live)
            assert cache.seq_len == live.done, (cache.seq_len, live.done)
            self.chunk_log.append((live.req.request_id, live.done, c))
            logits = self._absorb(live, cache, live.done, live.done + c)
            made = self.tokens[live.req.request_id]
            if live.done + c >= live.ctx and len(made) < live.req.output_length:
                made.append(int(np.argmax(logits[-1])))  # the prefill's last logits: one token

    # ----- caches and the snapshot store -------------------------------------------
    def context(self, live: Live) -> np.ndarray:
        """The tokens ``live`` holds at this admission: its prompt, then what it already streamed."""
        made = self.tokens[live.req.request_id][: live.ctx - live.req.input_length]
        return np.concatenate([live.req.tokens.astype(np.int64), np.asarray(made, dtype=np.int64)])

    def _snapshot(self, node) -> HybridCache | None:
        ck = node.payload
        entry = self._store.get(ck) if ck is not None else None
        return entry[1] if entry is not None and entry[0] is node and node.alive else None

    def _absorb(self, live: Live, cache: HybridCache, start: int, stop: int) -> np.ndarray:
        """Prefill ``context[start:stop]`` into ``cache``, stopping to store a snapshot at every
        checkpoint of ``live.path`` in (start, stop] the store lacks; the last piece's logits."""
        ctx = self.context(live)
        cuts = sorted({node.end for node in live.path
                       if node.payload is not None and start < node.end <= stop and self._snapshot(node) is None})
        ends = {node.end: node for node in live.path}
        logits = None
        for cut in cuts + [stop]:
            if cut > start:
                logits = self.model.prefill(ctx[start:cut], cache)
                start = cut
            node = ends.get(cut)
            if node is not None and node.payload is not None and self._snapshot(node) is None:
                self._store[node.payload] = (node, cache.clone())
        return logits

    def _begin(self, live: Live) -> HybridCache:
        """The request's cache at its usable hit: a copy of the stored snapshot there."""
        node = self._start.pop(live)
        h = live.hit
        if h == 0:
            cache = self.model.new_cache()
        else:
            assert node is not None and node.end == h, (h, node)
            snap = self._snapshot(node)
            if snap is None:
                raise AssertionError(f"request {live.req.request_id}: usable hit {h} on a checkpoint no "
                                     f"prefill stored (the accounting cache counts a state never computed)")
            self.store_hit_tokens += h
            cache = snap.clone()
        self._caches[live] = cache
        return cache

    def _loaded(self, node, snapshot: HybridCache | None) -> None:
        """A host tier loaded a checkpoint back at ``node``: its snapshot is this checkpoint's now."""
        if snapshot is not None:
            self._store[node.payload] = (node, snapshot)

    def _prune(self) -> None:
        """Forget snapshots whose checkpoint the accounting cache has evicted."""
        dead = [ck for ck, (node, _) in self._store.items() if not node.alive or node.payload is not ck]
        for ck in dead:
            del self._store[ck]

    def outputs(self) -> dict[int, list[int]]:
        """Each finished request's generated token ids."""
        return {f.request_id: list(self.tokens[f.request_id]) for f in self.engine.finished}


def serve(model: Model, requests: Iterable, *, executor: Executor | None = None,
          capacity_tokens: int | None = None, **engine_kw) -> tuple[Engine, dict[int, list[int]]]:
    """Serve ``requests`` (with ``tokens``) at their arrival times on one tensor-mode Engine, to the end.

    Returns the engine (its ``finished``, ``preemptions``, ``executor``) and each finished
    request's token ids. ``engine_kw`` go to :class:`Engine` (block_size, token_budget, ...).
    """
    executor = TensorExecutor(model) if executor is None else executor
    engine = Engine(model.config, capacity_tokens=capacity_tokens, executor=executor, **engine_kw)
    submit(engine, requests)
    engine.drain()
    return engine, executor.outputs() if isinstance(executor, TensorExecutor) else {}


def submit(engine: Engine, requests: Iterable) -> None:
    """Advance ``engine`` to each request's arrival (in arrival order) and submit it there."""
    for req in sorted(requests, key=lambda r: (r.arrival_ms, r.request_id)):
        t = req.arrival_ms / 1000.0
        if t > engine.clock:
            engine.advance(t)
        engine.submit(Live(req, t))
