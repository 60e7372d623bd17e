"""Chapter 10's checked exercises: one decode step, a reserved share, a fleet run, goodput per instance."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("10.1", "one decode step", rtol=1e-6,
          hint=("A decode step reads the weights and every request's cache; on the roofline the larger of "
                 "compute and memory time wins.",
                "Price one step of 64 requests at 8,192 tokens each on the chapter's default deployment."))
def _():
    return costs.decode_step_seconds(kimi_linear_48b, costs.DEFAULT_DEPLOYMENT, 8192, 64)


@exercise("10.2", "a tenant's reserved pages",
          hint=("A quota reserves a fraction of one instance's pool pages for a tenant.",
                "Convert the capacity to pages (512-token blocks), take the share each tenant reserves, round"
                 " down."))
def _():
    return int(0.25 * (1_000_000 // 512))


@exercise("10.3", "least-loaded's usable hit", rtol=1e-9,
          hint=("A load-only router ignores where a conversation's prefix is cached.",
                "Run 4 instances, each pool the deployment's whole cache budget, over the first 1,000 requests of "
                "the real trace at its own rate with the request-count router; read the usable hit rate."))
def _():
    from kimilab.fleet import run_fleet
    from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

    dep = costs.DEFAULT_DEPLOYMENT
    reqs = load_trace(DATA / MOONCAKE_CONVERSATION)[:1000]
    return run_fleet(reqs, kimi_linear_48b, deployment=dep, instances=4, router="least-loaded",
                     capacity_tokens=costs.capacity_tokens(kimi_linear_48b, dep)).usable_hit_rate()


@exercise("10.6", "goodput per instance", rtol=1e-6,
          hint=("Goodput is a rate of requests served within the SLO, shared by the instances that serve it.",
                "The trace's own rate is its requests over its span in seconds; scale it, then share it out."))
def _():
    from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

    trace = load_trace(DATA / MOONCAKE_CONVERSATION)
    return 12.5 * len(trace) / (trace[-1].arrival_ms / 1e3) / 8
