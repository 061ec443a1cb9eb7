"""`grpo-jax plot RUN_DIR`: PNGs of reward, KL, completion lengths, staleness and throughput (from the
learner-step lines of metrics.jsonl), and of the held-out evaluations (eval.png) when the run made any (from
eval.jsonl, or from the evaluation lines of metrics.jsonl when eval.jsonl is missing)."""

from __future__ import annotations

import pathlib

import numpy as np

from grpo_jax.run.metrics import read_metrics

PLOTS = {
    "reward.png": ("Reward", ["reward/mean", "reward/max", "reward/min"]),
    "kl.png": ("KL", ["kl", "approx_kl_old"]),
    "lengths.png": ("Completion length (tokens)", ["length/mean", "length/max"]),
    "throughput.png": ("Throughput", ["tokens_per_s"]),
}


def plot_run(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)  # the learner-step lines: evaluation lines left out
    if not rows:
        raise ValueError(f"{pathlib.Path(run_dir) / 'metrics.jsonl'} has no steps to plot")
    out = pathlib.Path(out_dir or pathlib.Path(run_dir) / "plots")
    out.mkdir(parents=True, exist_ok=True)
    steps = np.array([r["step"] for r in rows])
    written = []
    for name, (title, keys) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            values = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)
            if np.isfinite(values).any():
                ax.plot(steps, values, label=key)
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    # Staleness: how many steps old the trained groups were, pooled over the run.
    fig, ax = plt.subplots(figsize=(6, 3.5))
    pooled = [s for r in rows for s in (r.get("staleness/values") or [])]
    if pooled:
        ax.hist(pooled, bins=np.arange(max(pooled) + 2) - 0.5, rwidth=0.8)
    ax.set_title("Staleness of trained groups (learner steps)")
    ax.set_xlabel("staleness")
    ax.set_ylabel("groups")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=100)
    plt.close(fig)
    written.append(out / "staleness.png")
    evaluations = read_evaluations(run_dir)
    if evaluations:
        written.append(plot_evaluations(evaluations, out / "eval.png", plt))
    return written


def read_evaluations(run_dir: str | pathlib.Path) -> list[dict]:
    """The run's evaluations, each with "step" = the weight version evaluated: the rows of eval.jsonl, or,
    without that file, the evaluation lines of metrics.jsonl (whose "step" is the learner step they were
    written at, their "eval/weight_version" the version)."""
    if (pathlib.Path(run_dir) / "eval.jsonl").is_file():
        return read_metrics(run_dir, "eval.jsonl")
    return [{**{k: v for k, v in row.items() if k not in ("kind", "eval/weight_version")},
             "step": row["eval/weight_version"]} for row in read_metrics(run_dir, kind="eval")]


def plot_evaluations(rows: list[dict], path: pathlib.Path, plt) -> pathlib.Path:
    """Correctness (pass@1, mean@k, pass@k) and reward on the held-out prompts, by weight version evaluated."""
    rows = sorted(rows, key=lambda r: r["step"])
    steps = np.array([r["step"] for r in rows])
    n, k = (rows[-1].get("eval/samples"), rows[-1].get("eval/k")) if rows else (None, None)
    panels = [("Held-out correctness", [("eval/pass@1", "pass@1 (greedy)"), ("eval/mean@k", f"mean@k ({n} samples)"),
                                        ("eval/pass@k", f"pass@{k}")]),
              ("Held-out reward", [("eval/reward/greedy", "greedy"), ("eval/reward/mean", "sampled (mean)")])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (title, keys) in zip(axes, panels):
        for key, label in keys:
            values = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)
            if np.isfinite(values).any():
                ax.plot(steps, values, marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("weight version (learner steps)")
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
