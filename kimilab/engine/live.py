"""A request inside an engine, and what it measured when it finished."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Live", "Finished"]


@dataclass(eq=False)
class Live:
    """A request being served. ``generated`` survives preemption and instance failure
    (those tokens were already streamed); everything else is per admission."""

    req: object
    arrival_s: float
    generated: int = 0
    ctx: int = 0  # tokens to hold at this admission: prompt + generated
    done: int = 0  # of ctx, computed or served from the cache
    hit: int = 0  # usable hit at this admission
    kv_hit: int = 0
    base: int = 0  # tokens covered by cached full blocks on the pinned path
    path: list = field(default_factory=list)
    cache: object = None
    marked: int = 0  # nodes of ``path`` its prefill has passed (their checkpoints are computed)
    allocs: list = field(default_factory=list)  # the request's own pages (state + KV past ``base``)
    own_tokens: int = 0  # KV capacity of its own pages, from ``base``
    seq: int = 0
    admissions: int = 0
    first_token_s: float | None = None
    last_token_s: float = 0.0  # when its latest token came out (kept current when it stops decoding)
    first_hit: int = -1  # usable hit at the first admission
    first_kv_hit: int = 0
    served: int = 0  # sum over admissions of hits
    computed: int = 0  # sum over admissions of ctx - hit
    contexts: int = 0  # sum over admissions of ctx (= served + computed)
    preemptions: int = 0
    restarts: int = 0  # instance failures it survived
    instance: int = -1
    # on the engine's decode clock G while decoding: generated = gen0 + G - g0 (kimilab.engine.engine)
    decoding_now: bool = False
    g0: int = 0
    gen0: int = 0
    epoch: int = 0  # bumped when it starts or stops decoding: older heap entries are stale
    # handed over by a prefill instance (kimilab.engine.disagg): its next admission takes the KV it
    # brings instead of prefilling; ``payload`` is what an executor handed over with it (tensors)
    handed_over: bool = False
    payload: object = None

    @property
    def decoding(self) -> bool:
        return self.done >= self.ctx

    def lose(self) -> None:
        """Its instance failed: pages, cache path and progress are gone; it starts again elsewhere."""
        self.allocs, self.path, self.cache, self.done = [], [], None, 0
        self.restarts += 1

    @property
    def tokens(self) -> int:
        """Tokens it holds now: the context so far."""
        return self.done if self.done < self.ctx else self.req.input_length + self.generated


@dataclass(frozen=True)
class Finished:
    """One finished request (simulated seconds)."""

    request_id: int
    tenant: str
    instance: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    input_length: int
    output_length: int
    usable_hit: int  # at its first admission
    kv_hit: int
    served: int  # cached tokens over all its admissions
    computed: int  # prefilled tokens over all its admissions
    preemptions: int
    restarts: int
    generated: int  # tokens it made (== output_length)
    contexts: int  # tokens its prefills covered over all admissions (served + computed)

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot(self) -> float:
        n = self.output_length - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else 0.0
