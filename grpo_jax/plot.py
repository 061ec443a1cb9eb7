"""`grpo-jax plot RUN_DIR`: PNGs of reward, KL, completion lengths, staleness and throughput."""

from __future__ import annotations

import pathlib

import numpy as np

from grpo_jax.metrics import read_metrics

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

    rows = read_metrics(run_dir)
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
    return written
