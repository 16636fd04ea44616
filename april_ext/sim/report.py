"""Tables and PNG plots of simulated runs (one configuration in several modes)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import numpy as np

from april_ext.persistence import atomic_write_json
from april_ext.plots import save_figure
from april_ext.sim.runner import SimResult, gain
from april_ext.sim.turns import TurnModel

_COLUMNS = (
    ("mode", "{}"), ("tok/s", "{:,.0f}"), ("gain", "{}"), ("useful tok/s", "{:,.0f}"), ("bound", "{:,.0f}"),
    ("eff", "{:.2f}"), ("ceil eff", "{:.2f}"), ("bubble", "{:.2f}"),
    ("partial", "{:.2f}"), ("offpol", "{:.2f}"), ("stale<=", "{:.0f}"), ("reprefill", "{:.3f}"), ("kvcopy", "{:.3f}"),
    ("step s", "{:.1f}"), ("tail", "{:.2f}"), ("rank corr", "{:.2f}"), ("cont/step", "{:.0f}"), ("len ratio", "{:.2f}"),
    ("W1 first->last", "{}"),
)
_AGENTIC_COLUMNS = (("tools/step", "{:,.0f}"), ("envpre", "{:.3f}"))
"""Added to the table of agentic runs: tool calls per step, share of replica time prefilling observations."""


def summary_rows(results: dict[str, SimResult]) -> list[dict[str, Any]]:
    """One row per mode: the run-level figures of SimResult.summary plus the gain over the baseline."""
    rows = []
    for mode, result in results.items():
        s = result.summary
        rows.append({
            "mode": mode, "tok/s": s["tokens_per_s"],
            "gain": f"{gain(results, mode):+.1%}" if "baseline" in results else "-",
            "useful tok/s": s["useful_tokens_per_s"],
            "bound": s["bound_tokens_per_s"], "eff": s["efficiency"], "ceil eff": s["ceiling_efficiency"],
            "bubble": s["bubble_fraction"], "partial": s["partial_token_ratio"],
            "offpol": s["offpolicy_token_ratio"], "stale<=": s["max_staleness"],
            "reprefill": s["re_prefill_time_fraction"], "kvcopy": s["kv_copy_time_fraction"], "step s": s["rollout_s"],
            "tail": s["tail_latency"], "rank corr": s["prediction_rank_corr"], "cont/step": s["continuations_per_step"],
            "len ratio": s["length_mean_ratio"],
            "W1 first->last": f"{s['first_step_length_w1_rel']:.2f}->{s['last_step_length_w1_rel']:.2f}",
            "tools/step": s["tool_calls_per_step"], "envpre": s["env_prefill_time_fraction"],
        })
    return rows


def format_table(rows: list[dict[str, Any]], agentic: bool = False) -> str:
    """A fixed-width text table of summary_rows (with the tool columns when ``agentic``)."""
    columns = _COLUMNS + _AGENTIC_COLUMNS if agentic else _COLUMNS
    cells = [[name for name, _ in columns]]
    for row in rows:
        cells.append([fmt.format(row[name]) for name, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(results: dict[str, SimResult]) -> str:
    """The configuration line, the bound and the table."""
    first = next(iter(results.values()))
    c = first.config
    cluster = c.cluster_config()
    lengths = c.length_model()
    name = getattr(lengths, "name", type(lengths).__name__)
    engine = (f"mixed chunk {cluster.cost.chunked_prefill_size}" if cluster.cost.mixed_chunk
              else "separate prefill")
    head = (f"cluster {cluster.name} {cluster.num_engines} engines x {cluster.gpus_per_engine} GPU ({engine}) | "
            f"lengths {name} | {c.algorithm} | N={c.rollout_batch_size} x n={c.n_samples_per_prompt}, "
            f"N'={first.scheduler.over_sampling_batch_size}, cap {c.max_response_len} | {c.steps} steps "
            f"(summary over steps {c.warmup_steps}..)\n"
            f"bound: the best schedule of each mode's own work (eff: without re-prefill, ceil eff: with it); "
            f"steady-state rate {first.bound.tokens_per_s:,.0f} tok/s (B_sat {first.bound.mean_batch:.1f} per engine)"
            f", natural mean length {first.natural_mean:,.0f}")
    if isinstance(lengths, TurnModel):
        head += "\n" + describe_turns(lengths)
    return head + "\n" + format_table(summary_rows(results), agentic=isinstance(lengths, TurnModel))


def describe_turns(model: TurnModel) -> str:
    """The agentic model's figures and what the bound assumes about tool waits."""
    return (f"agentic {model.name}: turns median {model.median_turns:g} (cap {model.max_turns}), model turn median "
            f"{model.turn_tokens_median:,.0f} tokens, tool latency median {model.tool_median_s:g} s / p99 "
            f"{model.tool_p99_s:g} s, observation median {model.observation_median:,.0f} env tokens (prefilled, not "
            f"trained); the bound counts the observations' prefill and assumes the engines never idle while tools "
            f"run (other samples fill the wait)")


def write_json(results: dict[str, SimResult], path: str) -> None:
    """Every step report of every mode, with the summaries, as JSON."""
    out = {}
    for mode, r in results.items():
        out[mode] = {"summary": r.summary, "bound": asdict(r.bound), "natural_mean": r.natural_mean,
                     "wall_seconds": r.wall_seconds, "steps": [asdict(s) for s in r.steps]}
    atomic_write_json(path, out, indent=1)


def write_plots(results: dict[str, SimResult], out_dir: str, natural: np.ndarray | None = None) -> list[str]:
    """PNG plots: throughput and efficiency per step, partial / off-policy ratios, staleness, lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, r in results.items():
        steps = [s.step for s in r.steps]
        axes[0].plot(steps, [s.tokens_per_s for s in r.steps], marker="o", label=mode)
        axes[1].plot(steps, [s.efficiency for s in r.steps], marker="o", label=mode)
        axes[2].plot(steps, [s.bubble_fraction for s in r.steps], marker="o", label=mode)
    bound = next(iter(results.values())).bound.tokens_per_s
    axes[0].axhline(bound, color="gray", ls="--", label="steady-state rate")
    for ax, title in zip(axes, ("rollout throughput (tokens/s)", "efficiency vs the bound of the step's work", "bubble fraction")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    save(fig, "throughput.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (mode, r) in enumerate(results.items()):
        steps = [s.step for s in r.steps]
        axes[0].plot(steps, [s.partial_token_ratio for s in r.steps], marker="o", label=f"{mode} partial")
        axes[0].plot(steps, [s.offpolicy_token_ratio for s in r.steps], ls=":", label=f"{mode} off-policy")
        hist = np.zeros(max(len(s.staleness_histogram) for s in r.steps))
        for s in r.steps:
            hist[:len(s.staleness_histogram)] += s.staleness_histogram
        axes[1].bar(np.arange(hist.size) + 0.25 * i, hist / hist.sum(), width=0.25,
                    label=mode)
    axes[0].set_title("token ratios per step")
    axes[1].set_title("staleness of trained samples (versions)")
    for ax in axes:
        ax.legend(fontsize=8)
    save(fig, "partial_offpolicy.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    cap = next(iter(results.values())).config.max_response_len
    bins = np.linspace(0, cap, 41)
    if natural is not None:
        axes[0].hist(natural, bins=bins, density=True, histtype="step", color="black", lw=2, label="natural")
    for mode, r in results.items():
        trained = np.concatenate([np.asarray(s.response_lens) for s in r.steps])
        axes[0].hist(trained, bins=bins, density=True, histtype="step", label=mode)
        axes[1].plot([s.step for s in r.steps], [s.length_w1_rel for s in r.steps], marker="o", label=mode)
    axes[0].set_title("trained response lengths (all steps)")
    axes[1].set_title("length bias per step (W1 / natural mean)")
    for ax in axes:
        ax.legend(fontsize=8)
    save(fig, "lengths.png")
    return paths


__all__ = ["describe", "format_table", "summary_rows", "write_json", "write_plots"]
