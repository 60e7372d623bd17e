"""Part B's record: what its numbers rest on, and the headline table."""

from __future__ import annotations

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.experiment.variants import BASELINE, model_of
from kimilab.fleet.goodput import AGENT_SLO, MOONCAKE_SLO

__all__ = ["assumptions", "scheduler_label", "part_b_table", "PART_B_COLUMNS", "part_b_rows", "part_b_cells", "part_b_notes"]


def assumptions(*, n_requests: int, instances: int, agent_instances: int, agent_duration_s: float, seeds: int,
                price_per_hour: float, rel_tol: float, deployment: costs.Deployment = costs.DEFAULT_DEPLOYMENT) -> dict:
    """What the estimate rests on, printed under the table (``deployment``: the hybrid's)."""
    dep = deployment
    dev = dep.device
    pools = {name: costs.capacity_tokens(model_of(name), d) for name, d in
             (("kimi_linear_48b", dep), ("all_mla_27", dep), ("all_mla_27_fp8kv", dep))}
    return {
        "model": kimi_linear_48b.name, "deployment": dep.describe(), "accelerator": dev.name,
        "accelerators_per_instance": dep.n_devices, "hbm_gb_per_accelerator": dev.hbm_bytes / 1e9,
        "pool_tokens_per_instance": pools, "block_tokens": 512,
        "conversation": {"trace": "mooncake_conversation.jsonl", "requests": n_requests, "instances": instances,
                         "arrivals": "the trace's timestamps divided by the rate scale; in order k > 0 the gaps "
                                     "between consecutive arrivals shuffled (seed k)", "orders": seeds,
                         "slo": MOONCAKE_SLO.describe(), "slo_source": MOONCAKE_SLO.source},
        "agents": {"sessions": "claude_code_sessions.jsonl.gz (80 real Claude Code sessions)",
                   "instances": agent_instances, "window_s": agent_duration_s, "seeds": seeds,
                   "arrivals": "closed loop: each request a recorded think time (capped at 60 s) after the reply "
                               "it waited for; a finished session's slot starts the next one",
                   "slo": AGENT_SLO.describe(),  # its warm-up included
                   "slo_source": AGENT_SLO.source},
        "search_rel_tol": rel_tol, "price_usd_per_accelerator_hour": price_per_hour,
        "notes": ["latencies are simulated seconds from the calibrated step model (chapter 3), not measurements",
                  "goodput: in each order, the highest load within the SLO on a grid search_rel_tol apart, "
                  "scanned upward until two loads in a row miss (pass/fail need not be monotone in the load; an "
                  "overloaded replay stops once the SLO is certainly missed); the table shows the mean over the "
                  "orders, the rows of part_b.json also the min and max",
                  "cost: the fleet sized to that load, every accelerator rented for the load's duration; it scales "
                  "linearly with the price",
                  "DP-attention instances are simulated as one engine per device (kimilab.engine.dp: lock-step "
                  "stalls between devices are left out, which flatters them under skewed load)",
                  "drafting, networking, host overheads and failures are not modelled"],
    }


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


# per instance: chat in requests/s, agents in concurrent sessions; "x": the ratio to the baseline's;
# "$/M": USD per million output tokens; "busy": the fraction of the time the chat instance stepped;
# "sched": the chat row's step token budget (max_batched_tokens, in K) / max_num_seqs
PART_B_COLUMNS = ("variant", "sched", "chat", "chat x", "chat $/M", "busy", "agents", "agents x", "agents $/M")
_PART_B_FORMATS = ("s", ".3f", ".2f", ".2f", ".2f", ".2f", ".2f", ".2f")


def scheduler_label(row: dict) -> str | None:
    """A row's scheduler setting, short: "8K/1024" (step token budget in K tokens / max_num_seqs)."""
    s = row.get("scheduler")
    if not s:
        return None
    b = s["max_batched_tokens"]
    return f"{b // 1024}K/{s['max_num_seqs']}" if b % 1024 == 0 else f"{b}/{s['max_num_seqs']}"


def part_b_rows(result: dict) -> list[tuple]:
    """The headline table as values, one tuple per variant in ``PART_B_COLUMNS`` order (None: no value),
    for a notebook table (``kimilab.notebook.show_table``)."""
    rows = result["rows"]
    conv = {r["variant"]: r for r in rows if r["workload"] == "conversation"}
    agent = {r["variant"]: r for r in rows if r["workload"] == "agents"}
    out = []
    for n in dict.fromkeys(r["variant"] for r in rows):
        c, a = conv.get(n, {}), agent.get(n, {})
        out.append((n, scheduler_label(c or a),  # the baseline is named under the table (x = 1.00)
                    c.get("goodput"), c.get("goodput_ratio"),
                    c.get("usd_per_m_output"), c.get("busy_fraction"), a.get("goodput"), a.get("goodput_ratio"),
                    a.get("usd_per_m_output")))
    return out


def part_b_cells(result: dict) -> list[tuple]:
    """``part_b_rows`` formatted as the markdown table shows them ("-": no value)."""
    return [(name, *(_f(x, f) for x, f in zip(values, _PART_B_FORMATS))) for name, *values in part_b_rows(result)]


def part_b_notes(result: dict) -> list[str]:
    """What the table rests on: one paragraph (workloads, SLOs, deployment, price, baseline), then the notes."""
    cfg = result["config"]
    cv, ag = cfg["conversation"], cfg["agents"]
    head = (f"Conversation: the first {cv['requests']:,} requests of {cv['trace']} on {cv['instances']} "
            f"instances, {cv['slo']} ({cv['slo_source']}). Agents: {ag['sessions']} on {ag['instances']} "
            f"instances, {ag['window_s']:g} s windows x {ag['seeds']} session orders, {ag['slo']}. "
            f"Each instance: {cfg['deployment']}; ${cfg['price_usd_per_accelerator_hour']:g} per "
            f"accelerator-hour. Baseline: {BASELINE}.")
    notes = list(cfg["notes"])
    tuned = sorted({r["workload"] for r in result["rows"] if r.get("tuning")})
    if tuned:
        notes.append("scheduler tuned per variant on " + " and ".join(tuned) + ": every (max_batched_tokens, "
                     "max_num_seqs) of the grid in part_b.json's 'tuning' measured on order 0, each variant then "
                     "measured in every order at its best (column sched: the chat row's setting)")
    return [head] + notes


def part_b_table(result: dict) -> str:
    """Markdown: one row per variant, both workloads side by side, ratios to the strong baseline."""
    lines = ["| variant | sched | chat: req/s per instance | x baseline | $/M out | busy | agents: sessions per "
             "instance | x baseline | $/M out |", "|---|---|---|---|---|---|---|---|---|"]
    for cells in part_b_cells(result):
        lines.append("| " + " | ".join(cells) + " |")
    head, *notes = part_b_notes(result)
    lines += ["", head]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)
