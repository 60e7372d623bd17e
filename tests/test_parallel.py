"""kimilab.parallel: the pool gives the serial answers in order, and the browser runs every job here."""

import concurrent.futures

import pytest

from kimilab import parallel


def _square(x):
    return x * x


def test_pool_results_equal_the_serial_loop_in_order_and_every_job_is_told_once():
    heard = []
    got = parallel.pool_map(_square, range(7), 2, on_done=lambda i, k, r: heard.append((i, k, r)))
    assert got == [x * x for x in range(7)]
    assert sorted(i for i, _, _ in heard) == list(range(7)) and [k for _, k, _ in heard] == list(range(1, 8))
    assert all(r == i * i for i, _, r in heard)


def test_without_processes_every_job_runs_here(monkeypatch):
    """Pyodide (JupyterLite) cannot start a process: same results, no pool touched."""
    def no_pool(*a, **k):
        raise AssertionError("a process pool was started where processes cannot start")

    monkeypatch.setattr(parallel, "CAN_START_PROCESSES", False)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_pool)
    assert parallel.default_workers(10) == 1
    assert parallel.pool_map(_square, [3, 4, 5], 4) == [9, 16, 25]


@pytest.mark.parametrize("jobs,cap", [(0, 2), (1, 2), (10, 2), (10, 4)])
def test_default_workers_is_at_least_one_and_at_most_the_cap_and_the_jobs(jobs, cap):
    n = parallel.default_workers(jobs, cap=cap)
    assert 1 <= n <= max(1, min(cap, jobs))
