"""Who is admitted next: first come first served, or per-tenant fair (virtual token counters).

:class:`FifoQueue` is arrival order. :class:`FairQueue` follows VTC (Sheng et al.,
OSDI'24): each tenant has a counter of the service it received (prompt tokens
weighted ``w_in``, generated tokens ``w_out``); the next request comes from the
backlogged tenant with the smallest counter, and a tenant that returns from idle
is lifted to the smallest counter among the backlogged ones, so idling banks no
credit. Both queues put preempted requests back at the head of their tenant.
"""

from __future__ import annotations

from collections import deque

__all__ = ["FifoQueue", "FairQueue"]


class FifoQueue:
    """Waiting requests in arrival order."""

    def __init__(self):
        self._q: deque = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)

    def push(self, live) -> None:
        self._q.append(live)

    def push_front(self, live) -> None:
        self._q.appendleft(live)

    def peek(self):
        return self._q[0] if self._q else None

    def pop(self):
        return self._q.popleft()

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Arrival order ignores service received."""

    def clear(self) -> list:
        out = list(self._q)
        self._q.clear()
        return out


class FairQueue:
    """Per-tenant queues served by smallest virtual token counter (VTC)."""

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        self.w_in, self.w_out = w_in, w_out
        self.queues: dict[str, deque] = {}
        self.counter: dict[str, float] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        for q in self.queues.values():
            yield from q

    def _backlogged(self):
        return [t for t, q in self.queues.items() if q]

    def _enter(self, tenant: str) -> deque:
        q = self.queues.setdefault(tenant, deque())
        if not q:  # returning from idle: no banked credit
            active = [self.counter[t] for t in self._backlogged()]
            floor = min(active) if active else max(self.counter.values(), default=0.0)
            self.counter[tenant] = max(self.counter.get(tenant, 0.0), floor)
        return q

    def push(self, live) -> None:
        self._enter(live.req.tenant).append(live)
        self._n += 1

    def push_front(self, live) -> None:
        self._enter(live.req.tenant).appendleft(live)
        self._n += 1

    def _head_tenant(self):
        best = None
        for t, q in self.queues.items():  # insertion order breaks ties: deterministic
            if q and (best is None or self.counter[t] < self.counter[best]):
                best = t
        return best

    def peek(self):
        t = self._head_tenant()
        return None if t is None else self.queues[t][0]

    def pop(self):
        t = self._head_tenant()
        self._n -= 1
        return self.queues[t].popleft()

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Count service a tenant received."""
        self.counter[tenant] = self.counter.get(tenant, 0.0) + self.w_in * prompt_tokens + self.w_out * output_tokens

    def clear(self) -> list:
        out = list(self)
        for q in self.queues.values():
            q.clear()
        self._n = 0
        return out
