"""The communicator the context-parallel code talks through, with two backends.

The math (``kimilab.cp.kda``) sees only ``rank``, ``size``, ``allgather``, ``send`` and
``recv``. :class:`LocalComm` runs P ranks as threads of one process (what tests and the
book use: no MPI needed, and it counts bytes and messages); :class:`MPIComm` wraps
``mpi4py`` so the same code runs as P operating-system processes under ``mpiexec``.
Every blocking call has a timeout, so a rank that never arrives is an error, not a hang.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from kimilab.validate import check_int

__all__ = ["Comm", "LocalComm", "MPIComm", "run_local", "payload_bytes", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0  # seconds any blocking call may wait before it raises


def payload_bytes(obj) -> int:
    """Bytes of the arrays in ``obj`` (nested tuples/lists/dicts); scalars and None count 8 / 0."""
    if obj is None:
        return 0
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(payload_bytes(x) for x in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(payload_bytes(x) for x in obj)
    return 8


class Comm:
    """What a rank may do: learn its place, all-gather, send and receive. Counts what it sends."""

    rank: int
    size: int

    def __init__(self):
        self.bytes_sent = 0
        self.messages_sent = 0

    def _count(self, obj, messages: int) -> None:
        self.bytes_sent += payload_bytes(obj) * messages
        self.messages_sent += messages

    def allgather(self, obj) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def send(self, obj, dest: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def recv(self, source: int):  # pragma: no cover - interface
        raise NotImplementedError


class _Group:
    """Shared state of P local ranks: a gather board, a barrier, one mailbox per (src, dst)."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.board = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}


class LocalComm(Comm):
    """One of P ranks simulated by threads of this process (see :func:`run_local`)."""

    def __init__(self, group: _Group, rank: int):
        super().__init__()
        self._g, self.rank, self.size = group, rank, group.size

    def _wait(self):
        try:
            self._g.barrier.wait()
        except threading.BrokenBarrierError:
            raise TimeoutError(f"rank {self.rank}: other ranks did not arrive within {self._g.timeout} s") from None

    def allgather(self, obj) -> list:
        self._count(obj, self.size - 1)  # what a direct all-gather sends: one copy to every other rank
        self._wait()
        self._g.board[self.rank] = obj
        self._wait()
        out = list(self._g.board)
        self._wait()
        return out

    def send(self, obj, dest: int) -> None:
        self._count(obj, 1)
        self._g.boxes[(self.rank, dest)].put(obj)

    def recv(self, source: int):
        try:
            return self._g.boxes[(source, self.rank)].get(timeout=self._g.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank}: nothing from rank {source} within {self._g.timeout} s") from None


def run_local(size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` thread ranks; returns (results, comms) in rank order.

    An exception on any rank is re-raised here (the first by rank); the barrier is broken
    so the other ranks stop waiting instead of hanging.
    """
    size = check_int("ranks", size, 1)
    group = _Group(size, timeout)
    comms = [LocalComm(group, r) for r in range(size)]
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(comms[r], *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc
            group.barrier.abort()

    if size == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
    real = [e for e in errors if e is not None and not isinstance(e, TimeoutError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results, comms


class MPIComm(Comm):
    """This process's rank in ``MPI.COMM_WORLD`` (mpi4py); recv polls so it can time out."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        from mpi4py import MPI

        self._MPI, self._c, self.timeout = MPI, MPI.COMM_WORLD, timeout
        self.rank, self.size = self._c.Get_rank(), self._c.Get_size()

    def _sleepy_barrier(self) -> None:
        """A barrier that sleeps while it waits (MPI's spins, stealing a core from ranks still working)
        and times out instead of hanging."""
        req, deadline, nap = self._c.Ibarrier(), time.monotonic() + self.timeout, 1e-5
        while not req.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: other ranks did not arrive within {self.timeout} s")
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)  # a long wait (another rank's one-rank reference) polls rarely

    def allgather(self, obj) -> list:
        self._count(obj, self.size - 1)
        self._sleepy_barrier()  # everyone is here: the all-gather itself will not wait long
        return self._c.allgather(obj)

    def send(self, obj, dest: int) -> None:
        self._count(obj, 1)
        self._c.send(obj, dest=dest, tag=7)

    def recv(self, source: int):
        deadline = time.monotonic() + self.timeout
        while not self._c.Iprobe(source=source, tag=7):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: nothing from rank {source} within {self.timeout} s")
            time.sleep(1e-4)
        return self._c.recv(source=source, tag=7)

    def barrier(self) -> None:
        self._sleepy_barrier()

    def wtime(self) -> float:
        return self._MPI.Wtime()
