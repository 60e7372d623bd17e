"""Prefill/decode disaggregation: instances that only prefill, instances that only decode.

A *prefill instance* (:class:`PrefillEngine`) runs each request's prompt and its first token,
as any engine does, then hands the request over: its prompt's KV (every global-attention layer)
and, for a hybrid, its KDA and conv states at the prompt's end leave over ``link`` to a *decode
instance* (:class:`DecodeEngine`), which admits it with that context already in place and
decodes the rest. The prompt's blocks stay in the prefill instance's prefix cache, so prefix
caching happens where prefills run, as in Mooncake and SGLang's PD mode.

What a request pays for moving: ``link.latency_s`` plus its bytes over ``link.bandwidth``
(:func:`transfer_bytes`, one device's share: every device of the instance sends its shard over
its own NIC at once). The first token reaches the user from the decode instance, after the
transfer (SGLang's decode server receives the prefill's token with the KV and streams from
there), so time to first token includes the move and any wait for the decode instance's memory.
A request that asks for at most one token finishes on the prefill instance.

Left out, and said where it matters: the decode instance does not reserve pages before the
prefill runs (SGLang pre-allocates them, which holds prefills back when decode memory is
full: here prefills run ahead and requests wait at the decode instance instead), and the
prefill instance frees the request's own pages when it hands it over, not when the bytes
have left. A request preempted on a decode instance is recomputed there from its prompt.
"""

from __future__ import annotations

from dataclasses import replace

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, checkpoint_bytes, kv_bytes_per_token
from kimilab.engine.engine import Engine
from kimilab.engine.live import Live
from kimilab.prefix.offload import CLUSTER_RDMA, Tier
from kimilab.validate import check_int

__all__ = ["PrefillEngine", "DecodeEngine", "transfer_bytes"]


def transfer_bytes(config: ModelConfig, deployment: Deployment, n_tokens: int) -> int:
    """Bytes one device sends to hand over a prompt of ``n_tokens``: its KV and one set of states."""
    n = check_int("n_tokens", n_tokens, 0, unit="tokens")
    states = checkpoint_bytes(config, deployment) if config.kda_layers else 0
    return n * kv_bytes_per_token(config, deployment) + states


class PrefillEngine(Engine):
    """An engine that prefills and hands each request over when its first token is made.

    ``handoffs`` collects ``(time the context has arrived, live)`` for the fleet to route to a
    decode instance; ``sent_bytes`` and ``link_seconds`` add up what left, per device."""

    def __init__(self, config: ModelConfig, *, deployment: Deployment, link: Tier = CLUSTER_RDMA, **kw):
        super().__init__(config, deployment=deployment, **kw)
        if not isinstance(link, Tier):
            raise ValueError(f"link: expected a kimilab.prefix.offload.Tier, got {type(link).__name__}")
        self.link = link
        self.handoffs: list[tuple[float, Live]] = []
        self.handed_over = self.sent_bytes = 0
        self.link_seconds = 0.0
        self._whole: dict[int, object] = {}  # request id -> the request as asked (output_length and all)

    def submit(self, live: Live) -> None:
        req = live.req
        if req.output_length > 1:  # here it makes its first token only
            self._whole[req.request_id] = req
            live.req = replace(req, output_length=1)
        super().submit(live)
        if self.refused and self.refused[-1] is live:
            live.req = self._whole.pop(req.request_id, req)

    def _finish(self, live: Live) -> None:
        whole = self._whole.pop(live.req.request_id, None)
        payload = None
        if whole is not None and self.executor is not None:
            payload = self.executor.hand_off(live)
        super()._finish(live)
        if whole is None:  # it asked for at most one token: done here
            return
        self.finished.pop()  # not finished: it moves on
        nbytes = transfer_bytes(self.config, self.deployment, whole.input_length)
        dt = self.link.latency_s + nbytes / self.link.bandwidth
        self.handed_over += 1
        self.sent_bytes += nbytes
        self.link_seconds += dt
        live.req, live.first_token_s = whole, None  # the user sees its first token from the decode instance
        live.handed_over, live.payload = True, payload
        self.handoffs.append((self.clock + dt, live))

    def take_handoffs(self) -> list[tuple[float, Live]]:
        out, self.handoffs = self.handoffs, []
        return out


class DecodeEngine(Engine):
    """An engine whose requests arrive with their prompt's context handed over: it admits each with
    pages for that context and its states, and streams its first token at once; later admissions
    (after a preemption) prefill here as any engine does."""

    def _admit(self, live: Live) -> bool:
        if not live.handed_over:
            return super()._admit(live)
        mem = self.memory
        live.ctx = live.req.input_length + live.generated
        kv_pages = -(-(live.ctx + 1) // self.block)
        if not mem.make_room(live.req.tenant, mem.state_pages + kv_pages):
            return False
        pool = mem.pool
        live.allocs = [pool.allocate("kv", kv_pages)]
        if mem.state_pages:
            live.allocs.append(pool.allocate("kda_state", mem.state_pages))
        live.cache, live.path, live.base, live.own_tokens = None, [], 0, kv_pages * self.block
        live.marked, live.hit, live.kv_hit, live.done = 0, 0, 0, live.ctx
        self._backlog -= live.ctx
        live.admissions += 1
        self._seq += 1
        live.seq = self._seq
        live.first_token_s = live.last_token_s = self.clock  # the first token reaches the user now
        if self.executor is not None:
            self.executor.receive(live, live.payload)
        live.handed_over, live.payload = False, None
        return True

    def _free_own(self, live: Live) -> None:
        if live.cache is not None:
            return super()._free_own(live)
        for a in live.allocs:  # handed-over pages: no cache path to unpin
            self.memory.pool.free(a)
        live.allocs = []
        self._blocked = False
