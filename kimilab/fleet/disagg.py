"""A disaggregated fleet: P prefill instances behind the router, D decode instances behind a second one.

Each arrival is routed to a prefill instance (by any router of :mod:`kimilab.fleet.routers`:
the prefix cache lives there). When its prefill has made the first token, the request's
context crosses the link (:mod:`kimilab.engine.disagg`) and, once it has arrived, is routed
to the decode instance with the fewest requests (``decode_router``), which streams its tokens.

Events stay in time order without feedback from decode to prefill: at each arrival the
prefill instances are advanced first; every hand-over they made that has arrived by then is
delivered in arrival order, the decode instances advanced to each; then the decode
instances catch up. Prefill never waits for decode (see :mod:`kimilab.engine.disagg` for what
that leaves out). Instance failures, tenant quotas, DP-attention and host tiers are not
modelled here and are refused.
"""

from __future__ import annotations

import heapq

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.engine import Engine, Live
from kimilab.engine.disagg import DecodeEngine, PrefillEngine
from kimilab.fleet.fleet import Fleet
from kimilab.fleet.routers import make_router
from kimilab.prefix.offload import CLUSTER_RDMA, Tier
from kimilab.validate import check_int

__all__ = ["DisaggregatedFleet"]


class DisaggregatedFleet(Fleet):
    """``prefill`` prefill instances (indices 0..P-1) and ``decode`` decode instances (P..P+D-1), each
    the deployment's, with the hand-over on ``link``. ``executor``: a function that makes each
    engine its executor (tensor mode), or None."""

    def __init__(self, config: ModelConfig, prefill: int, decode: int, router: str, *, deployment: Deployment,
                 capacity_tokens: int | None, link: Tier = CLUSTER_RDMA, decode_router: str = "least-loaded",
                 executor=None, router_options: dict | None = None, **engine_kw):
        self.n_prefill = check_int("prefill", prefill, 1)
        check_int("decode", decode, 1)
        if deployment.attention == "dp" and deployment.n_devices > 1:
            raise ValueError(f"deployment={deployment.name!r}: disaggregation is modelled on tensor-parallel "
                             "instances; expected a deployment without DP-attention")
        for key in ("host_bytes", "store_bytes", "isolation", "quotas"):
            if engine_kw.get(key) not in (None, "none"):
                raise ValueError(f"{key}: not modelled with disaggregation (expected it left out)")
        engine_kw.pop("isolation", None)
        self.link, self._executor = link, executor
        super().__init__(config, self.n_prefill + decode, router, deployment=deployment,
                         capacity_tokens=capacity_tokens, router_options=router_options, **engine_kw)
        self.decode_router = make_router(decode_router)
        self.prefill_instances = self.instances[: self.n_prefill]
        self.decode_instances = self.instances[self.n_prefill:]
        self._inflight: list = []  # (arrival at the decode side, serial, live)
        self._serial = 0

    def _new_engine(self, engine_class: type, config: ModelConfig, **kw) -> Engine:
        if self._executor is not None:
            kw["executor"] = self._executor()
        if kw["index"] < self.n_prefill:
            return PrefillEngine(config, link=self.link, **kw)
        return DecodeEngine(config, **kw)

    # ----- the event loop's hooks (Fleet.run) ------------------------------------------------
    def _route(self, live: Live, t: float) -> None:
        self.router.choose(live.req, self.prefill_instances).submit(live)

    def next_handoff_s(self) -> float:
        """When the next hand-over in flight arrives at the decode side (inf: none in flight)."""
        for e in self.prefill_instances:
            for t, live in e.take_handoffs():
                self._serial += 1
                heapq.heappush(self._inflight, (t, self._serial, live))
        return self._inflight[0][0] if self._inflight else float("inf")

    def deliver_next(self) -> None:
        """Route the next hand-over to arrive to a decode instance (the caller has advanced them to then)."""
        _, _, live = heapq.heappop(self._inflight)
        self.decode_router.choose(live.req, self.decode_instances).submit(live)

    def _deliver(self, until: float) -> None:
        """Route every hand-over that has arrived by ``until``, in arrival order."""
        while (t := self.next_handoff_s()) <= until and self._inflight:
            for d in self.decode_instances:
                if d.clock < t:
                    d.advance(t)
            self.deliver_next()

    def _advance(self, t: float) -> None:
        for e in self.prefill_instances:
            if e.clock < t:
                e.advance(t)
        self._deliver(t)
        for d in self.decode_instances:
            if d.clock < t:
                d.advance(t)

    def _drain(self) -> None:
        for e in self.prefill_instances:
            e.drain()
        self._deliver(float("inf"))
        for d in self.decode_instances:
            d.drain()

    def run(self, requests, *, rate_scale: float = 1.0, fails=(), guard=None):
        if fails:
            raise ValueError(f"fails={list(fails)!r}: instance failures are not modelled with disaggregation; "
                             "expected none")
        return super().run(requests, rate_scale=rate_scale, guard=guard)

    def transfer_summary(self) -> dict:
        """What crossed from prefill to decode, per device: requests, bytes, link seconds."""
        n = sum(e.handed_over for e in self.prefill_instances)
        nbytes = sum(e.sent_bytes for e in self.prefill_instances)
        secs = sum(e.link_seconds for e in self.prefill_instances)
        return {"prefill_instances": self.n_prefill, "decode_instances": len(self.decode_instances),
                "link": self.link.name, "requests": n, "bytes_per_device": nbytes,
                "mean_bytes_per_request": round(nbytes / n, 1) if n else None,
                "link_seconds": round(secs, 6), "in_flight": len(self._inflight)}
