"""The communicator the context-parallel code talks through, with two backends.

The math (``kimilab.cp.kda``) sees only ``rank``, ``size``, ``allgather``, ``send``,
``recv`` and ``sendrecv``. :class:`LocalComm` runs P ranks as threads of one process (what
tests and the book use: no MPI needed, and it counts bytes and messages); :class:`MPIComm`
wraps ``mpi4py`` so the same code runs as P operating-system processes under ``mpiexec``.

Both backends give ``send`` the same meaning: it never waits for the receiver (a local
mailbox; a non-blocking MPI send completed later), so a ring where every rank sends before
it receives cannot deadlock, whatever the message size. (A blocking MPI send of a large
message waits until the peer receives it: past MPICH's eager limit, a ring of them hangs.)
Every call that waits -- a receive, a collective, finishing the sends -- has a timeout, so
a rank that never arrives is a one-line error, not a hang.

Two byte counts: ``bytes_sent`` is the arrays' payload (what the cost formulas count);
:class:`MPIComm` also counts ``wire_bytes_sent``, the lengths of the pickled buffers it
actually hands to MPI, so a test can hold the formulas against what really went out.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
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

    def sendrecv(self, obj, dest: int, source: int):
        """Send ``obj`` to ``dest`` and receive from ``source`` (a ring step): safe in any order,
        since ``send`` never waits for its receiver."""
        self.send(obj, dest)
        return self.recv(source)

    def flush(self) -> None:
        """Wait (with the timeout) until every message this rank sent has been delivered."""


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
    """This process's rank in ``MPI.COMM_WORLD`` (mpi4py).

    Sends are non-blocking (``isend``) and finished by later calls; receives poll, so
    every wait can time out. Call :meth:`flush` (or any collective) before the rank ends.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        super().__init__()
        from mpi4py import MPI

        self._MPI, self._c, self.timeout = MPI, MPI.COMM_WORLD, timeout
        self.rank, self.size = self._c.Get_rank(), self._c.Get_size()
        self._pending: list = []  # (request, dest, buffer) of sends not yet delivered
        self.wire_bytes_sent = 0  # bytes of the buffers handed to MPI (pickled objects, size headers)

    def _poll(self, done, what: str) -> None:
        """Sleep-poll until ``done()``, finishing sends meanwhile; TimeoutError naming ``what``."""
        deadline, nap = time.monotonic() + self.timeout, 1e-5
        while not done():
            self._progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: {what} within {self.timeout} s")
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)  # a long wait (another rank's one-rank reference) polls rarely

    def _progress(self) -> None:
        self._pending = [(req, dest, buf) for req, dest, buf in self._pending if not req.Test()]

    def _sleepy_barrier(self) -> None:
        """A barrier that sleeps while it waits (MPI's spins, stealing a core from ranks still working)
        and times out instead of hanging."""
        req = self._c.Ibarrier()
        self._poll(req.Test, "other ranks did not arrive")

    def flush(self) -> None:
        if self._pending:
            self._poll(lambda: not self._pending,
                       "rank(s) " + ", ".join(sorted({str(d) for _, d, _ in self._pending})) + " did not receive")

    def allgather(self, obj) -> list:
        """Every rank's ``obj``: the pickled buffers' sizes (8 bytes each), then the buffers
        (``Allgatherv``). This rank's buffer reaches P - 1 others: that is what it counts."""
        MPI = self._MPI
        buf = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._count(obj, self.size - 1)
        self.wire_bytes_sent += (len(buf) + 8) * (self.size - 1)
        self.flush()
        self._sleepy_barrier()  # everyone is here: the all-gather itself will not wait long
        sizes = np.zeros(self.size, np.int64)
        self._c.Allgather([np.array([len(buf)], np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        everyone = bytearray(int(sizes.sum()))
        self._c.Allgatherv([buf, MPI.BYTE], [everyone, (sizes, offsets), MPI.BYTE])
        view = memoryview(everyone)
        return [pickle.loads(view[o:o + n]) for o, n in zip(offsets, sizes)]

    def send(self, obj, dest: int) -> None:
        buf = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._count(obj, 1)
        self.wire_bytes_sent += len(buf)
        self._pending.append((self._c.Isend([buf, self._MPI.BYTE], dest=dest, tag=7), dest, buf))

    def recv(self, source: int):
        status = self._MPI.Status()
        self._poll(lambda: self._c.Iprobe(source=source, tag=7, status=status), f"nothing from rank {source}")
        buf = bytearray(status.Get_count(self._MPI.BYTE))
        self._c.Recv([buf, self._MPI.BYTE], source=source, tag=7)
        return pickle.loads(buf)

    def barrier(self) -> None:
        self.flush()
        self._sleepy_barrier()

    def wtime(self) -> float:
        return self._MPI.Wtime()

    @staticmethod
    def abort(code: int) -> None:
        """End this rank now, without MPI_Finalize (which could wait forever on a peer that never
        answers); mpiexec then ends the job's other ranks. Print the reason first."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
