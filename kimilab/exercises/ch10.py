"""Chapter 10's checked exercises: one decode step, a reserved share, a fleet run, goodput per instance."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("10.1", "one decode step", rtol=1e-6,
          hint="costs.decode_step_seconds(kimi_linear_48b, 8192, 64): seconds, on the default deployment.")
def _():
    return costs.decode_step_seconds(kimi_linear_48b, costs.DEFAULT_DEPLOYMENT, 8192, 64)


@exercise("10.2", "a tenant's reserved pages",
          hint="pool pages = capacity_tokens // 512; each of the 2 tenants reserves 0.5 / 2 of them (int()).")
def _():
    return int(0.25 * (1_000_000 // 512))


@exercise("10.3", "least-loaded's usable hit", rtol=1e-9,
          hint="a request-count router on 4 instances over the trace's first 1,000 requests at its own rate; "
               "each pool is the deployment's whole cache budget (costs.capacity_tokens).")
def _():
    from kimilab.fleet import run_fleet
    from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

    dep = costs.DEFAULT_DEPLOYMENT
    reqs = load_trace(DATA / MOONCAKE_CONVERSATION)[:1000]
    return run_fleet(reqs, kimi_linear_48b, deployment=dep, instances=4, router="least-loaded",
                     capacity_tokens=costs.capacity_tokens(kimi_linear_48b, dep)).usable_hit_rate()


@exercise("10.6", "goodput per instance", rtol=1e-6,
          hint="the trace's own rate is its requests over its span in seconds; scale it, then share it out.")
def _():
    from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

    trace = load_trace(DATA / MOONCAKE_CONVERSATION)
    return 12.5 * len(trace) / (trace[-1].arrival_ms / 1e3) / 8
