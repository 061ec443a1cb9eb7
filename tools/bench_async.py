"""Asynchronous vs synchronous GRPO: the same number of steps with max_staleness 0 and with the default
bound, in one run, on the default CPU config.

    python tools/bench_async.py [--steps 60] [--warmup 5] [key=value overrides ...]

Prints the wall time of each (after the warm-up steps, which include compilation), their ratio, and the
learner's idle fraction (time spent waiting for groups / wall time).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_jax.config import Config  # noqa: E402
from grpo_jax.config_io import load_config  # noqa: E402
from grpo_jax.trainer import Trainer  # noqa: E402


def run(overrides: list[str], steps: int, warmup: int, run_dir: pathlib.Path) -> dict:
    config = load_config(Config, REPO / "configs" / "tiny_cpu.yaml",
                         [f"trainer.max_steps={steps + warmup}", "trainer.progress=false",
                          "trainer.tensorboard=false", f"run_dir={run_dir}", *overrides])
    history = Trainer(config).train()
    timed = history[warmup:]
    wall = timed[-1]["time/elapsed_s"] - history[warmup - 1]["time/elapsed_s"]
    waited = sum(m["time/wait_s"] for m in timed)
    return {"max_staleness": config.grpo.max_staleness, "wall_s": wall, "idle": waited / wall,
            "reward": timed[-1]["reward/mean"], "staleness": sum(m["staleness/mean"] for m in timed) / len(timed),
            "total_s": history[-1]["time/elapsed_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    default_bound = load_config(Config, REPO / "configs" / "tiny_cpu.yaml", args.overrides).grpo.max_staleness
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(args.overrides + ["grpo.max_staleness=0"], args.steps, args.warmup, pathlib.Path(tmp) / "sync")
        async_ = run(args.overrides + [f"grpo.max_staleness={default_bound}"], args.steps, args.warmup,
                     pathlib.Path(tmp) / "async")
    for name, r in (("sync ", sync), ("async", async_)):
        print(f"{name} max_staleness={r['max_staleness']}: {args.steps} steps in {r['wall_s']:.1f}s "
              f"({r['wall_s'] / args.steps * 1000:.0f} ms/step), learner idle {r['idle']:.0%}, "
              f"mean staleness {r['staleness']:.2f}, final reward {r['reward']:.3f} "
              f"(with compilation: {r['total_s']:.1f}s)")
    print(f"async/sync wall time: {async_['wall_s'] / sync['wall_s']:.2f} "
          f"(speed-up {sync['wall_s'] / async_['wall_s']:.2f}x)")


if __name__ == "__main__":
    main()
