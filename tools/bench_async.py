"""Asynchronous vs synchronous GRPO: the same number of steps with max_staleness 0 and with the default
bound, in one run, on the default CPU config.

    python tools/bench_async.py [--steps 60] [--warmup 5] [key=value overrides ...]

Prints the wall time of each (after the warm-up steps, which include compilation), their ratio, and the
learner's idle fraction (time spent waiting for groups / wall time).

    python tools/bench_async.py --device-wait 0.2 [--steps 30] [key=value overrides ...]

Device-like waits: the orchestration alone, as it would run with the actor and the learner on separate
accelerators. The continuous engine's device calls (a decode chunk, an admission) and the learner's update
become sleeps (which release the GIL, as a wait on a device does), so that on this machine's two cores the
two sides do not compete for compute; everything else is the real trainer: the actor thread and its engine
bookkeeping, rewards, advantages, the replay buffer and its admission rule, the learner loop, batch packing,
weight syncs and in-flight updates. Each learner step sleeps --device-wait seconds, and the actor's chunks
sleep so that one step's groups (all of exactly sampler.max_new_tokens tokens) also take --device-wait
seconds. Ideal overlap finishes in the time of one side; the run reports the overlap
(busier side's time / wall time) for async with in-flight updates on and off, and for sync as a reference.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from grpo_jax.config_io import load_config  # noqa: E402
from grpo_jax.rollout.engine import Engine  # noqa: E402
from grpo_jax.run.config import Config  # noqa: E402
from grpo_jax.run.trainer import Trainer  # noqa: E402

QUIET = ["trainer.progress=false", "trainer.tensorboard=false"]
# Device-like mode: every sample is exactly max_new_tokens long and one step's samples fill the slots once, in
# chunk_steps-step chunks; no checkpoints or export (their disk time is not orchestration).
DEVICE_WAIT = ["sampler.engine=continuous", "sampler.max_new_tokens=32", "sampler.chunk_steps=8",
               "checkpoint.every_steps=0", "checkpoint.save_at_end=false", "trainer.save_final_model=false"]


def run(overrides: list[str], steps: int, warmup: int, run_dir: pathlib.Path, device_wait: float = 0.0) -> dict:
    config = load_config(Config, REPO / "configs" / "tiny_cpu.yaml",
                         [f"trainer.max_steps={steps + warmup}", *QUIET, f"run_dir={run_dir}", *overrides])
    trainer = Trainer(config)
    if device_wait:
        simulate_devices(trainer, device_wait)
    history = trainer.train()
    timed = history[warmup:]
    wall = timed[-1]["time/elapsed_s"] - history[warmup - 1]["time/elapsed_s"]
    waited = sum(m["time/wait_s"] for m in timed)
    return {"max_staleness": config.grpo.max_staleness, "wall_s": wall, "idle": waited / wall,
            "reward": timed[-1]["reward/mean"], "staleness": sum(m["staleness/mean"] for m in timed) / len(timed),
            "total_s": history[-1]["time/elapsed_s"],
            "spread": max(m.get("rollout/version_spread_max", 0) for m in timed)}


class _WaitBank:
    """A bank's slots as host counters: what the engine's bookkeeping reads back after a chunk."""

    def __init__(self, slots: int):
        self.generated = np.zeros(slots, np.int32)
        self.limit = np.ones(slots, np.int32)
        self.done = np.ones(slots, bool)

    def take(self, index: np.ndarray) -> _WaitBank:
        out = _WaitBank(len(index))
        keep = index >= 0
        out.generated[keep], out.limit[keep], out.done[keep] = (self.generated[index[keep]], self.limit[index[keep]],
                                                                self.done[index[keep]])
        return out


def simulate_devices(trainer: Trainer, seconds_per_step: float) -> None:
    """Replace the engine's device programs and the learner's update with sleeps (see the module docstring)."""
    engine = trainer.sampler
    assert isinstance(engine, Engine), "the device-wait mode measures the continuous engine"
    cfg = trainer.config
    samples_per_step = trainer.local_prompts * cfg.grpo.group_size
    chunks_per_step = math.ceil(samples_per_step / engine.num_slots) * math.ceil(
        (cfg.sampler.max_new_tokens - 1) / cfg.sampler.chunk_steps)
    chunk_seconds = seconds_per_step / chunks_per_step  # a boundary's banks run their chunks concurrently
    filler = next(t for t in range(1, 1000) if t not in engine.eos_ids)
    eos = engine.eos_ids[0]

    def admit(params, head, adapters, bank, tokens, mask, slot, source, keys, limit, temperature, top_p, **static):
        used = slot < len(bank.done)
        bank.generated[slot[used]], bank.limit[slot[used]] = 1, cfg.sampler.max_new_tokens
        bank.done[slot[used]] = False
        return bank, np.full(len(slot), filler, np.int32), np.full(len(slot), -1.0, np.float32)

    def chunk(params, head, adapters, bank, temperature, top_p, *, steps, **static):
        time.sleep(chunk_seconds)
        new = np.where(bank.done, 0, np.minimum(steps, bank.limit - bank.generated))
        tokens = np.full((len(bank.done), steps), filler, np.int32)
        ends = bank.generated + new == bank.limit  # the last token is an eos: every sample stops at the limit
        tokens[ends, np.maximum(new[ends] - 1, 0)] = eos
        bank.generated += new
        bank.done |= bank.generated >= bank.limit
        return bank, tokens, np.full(tokens.shape, -1.0, np.float32), int(new.max(initial=0))

    engine._admit, engine._chunk = admit, chunk
    engine._resize = lambda bank, index: bank.take(np.asarray(index))
    for bank in engine._banks:
        bank.state = _WaitBank(len(bank.occupants))

    learner = trainer.learner
    updates = cfg.optim.mini_batches * cfg.optim.epochs

    def learner_step(batch):
        time.sleep(seconds_per_step)
        learner.steps_done += 1
        return {"loss": 0.0, "tis/mismatch_kl": 0.0}, np.ones(updates, bool)

    learner.step = learner_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device-wait", type=float, default=0.0,
                        help="seconds of device-like wait per learner step on each side (see the module docstring)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    default_bound = load_config(Config, REPO / "configs" / "tiny_cpu.yaml", args.overrides).grpo.max_staleness
    if args.device_wait:
        device_wait(args, default_bound)
        return
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


def device_wait(args, default_bound: int) -> None:
    busier = args.steps * args.device_wait
    print(f"device-like waits: {args.device_wait * 1000:.0f} ms per step on each side, {args.steps} timed steps: "
          f"the busier side alone takes {busier:.1f} s; load average before: {os.getloadavg()[0]:.2f}")
    runs = [("async, in-flight updates on ", [f"grpo.max_staleness={default_bound}", "sampler.inflight_updates=true"]),
            ("async, in-flight updates off", [f"grpo.max_staleness={default_bound}", "sampler.inflight_updates=false"]),
            ("sync (max_staleness=0)      ", ["grpo.max_staleness=0"])]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(runs):
            r = run(DEVICE_WAIT + args.overrides + extra, args.steps, args.warmup, pathlib.Path(tmp) / str(i),
                    device_wait=args.device_wait)
            results.append(r)
            print(f"{name}: {r['wall_s']:.2f} s = {r['wall_s'] / busier:.3f}x the busier side, overlap "
                  f"{busier / r['wall_s']:.1%}, learner idle {r['idle']:.0%}, mean staleness {r['staleness']:.2f}, "
                  f"max version spread in a group {r['spread']} (load average {os.getloadavg()[0]:.2f})")
    print(f"overlap: in-flight on {busier / results[0]['wall_s']:.1%}, off {busier / results[1]['wall_s']:.1%} "
          f"(target >= 90%: within 1.1x the busier side)")


if __name__ == "__main__":
    main()
