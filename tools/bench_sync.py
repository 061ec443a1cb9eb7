"""Weight sync time and bytes on CPU: the learner's parameters onto the actor's layout, old path vs new.

    python tools/bench_sync.py [--repeats 5] [--actor tensor|fsdp] [--dtype float32|bfloat16]

One process, 8 simulated CPU devices: 4 learner devices (mesh.learner fsdp=4) and 4 actor devices (mesh.actor
tensor=4 by default: a different tiling, the case that needs a reshard; --actor fsdp: the same tiling). For
each model (the tiny config, configs/tiny_cpu.yaml; the benchmark shape of tools/bench_train.py: vocab 8192,
hidden 768, MLP 2048, 4 layers, 12/4 heads) and each path, the median wall time of --repeats syncs (after one
warm-up), the bytes that land on the actor (logical size in the dtype sent) and the largest buffer any device
(or the host) held on the way:

  old device_put   jax.device_put(params, actor shardings): the path of one process before. Across device sets
                   with a different tiling JAX assembles the whole array on the host first (largest = whole leaf).
  old gather       what several processes did: a jitted gather of every leaf onto every learner device, then
                   device_put of one device's replica (largest = whole model on every learner device).
  new              weight_sync.WeightSync: each actor shard assembled on its device from slices of the learner's.
  new, 2 hosts     the same with the 4 learner devices and the 4 actor devices each taken as 2 hosts (an actor
                   across the hosts): step 1, the jitted reshard that gives each host the blocks its actor devices
                   need spread over its 2 learner devices, is then a real program, run per group of leaves (the
                   largest-buffer figure stages all groups at once: an upper bound).
  ... bf16         model.dtype bfloat16 over float32 master weights: cast in the jitted step (bytes halved).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.model.transformer import ModelConfig, count_params, create_model  # noqa: E402
from grpo_jax.parallel.sharding import MeshConfig, make_mesh, shard_module, state_shardings  # noqa: E402
from grpo_jax.rollout.weight_sync import WeightSync  # noqa: E402

TINY = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                   tie_embeddings=True, max_position_embeddings=64)
BENCH = ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_layers=4, num_heads=12,
                    num_kv_heads=4)


def timed(fn, repeats: int):
    out = jax.block_until_ready(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        del out
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def largest_shard(tree) -> int:
    return max(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--actor", default="tensor", choices=["tensor", "fsdp"])
    args = p.parse_args()
    devices = jax.devices()
    actor_mesh = make_mesh(MeshConfig(fsdp=4, tensor=1) if args.actor == "fsdp" else MeshConfig(fsdp=1, tensor=4),
                           devices[:4])
    learner_mesh = make_mesh(MeshConfig(fsdp=4), devices[4:])
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices: learner fsdp=4 on 4, actor {args.actor}=4 on 4; "
          f"median of {args.repeats}", flush=True)
    for name, config in [("tiny", TINY), ("bench", BENCH)]:
        model = shard_module(create_model(config), learner_mesh)
        _, params = nnx.split(model)
        shardings = state_shardings(params, actor_mesh)
        total = sum(x.nbytes for x in jax.tree.leaves(params))
        biggest = max(x.nbytes for x in jax.tree.leaves(params))
        print(f"\n{name}: {count_params(model) / 1e6:.2f} M parameters, {total / 2**20:.1f} MiB float32 "
              f"(largest leaf {biggest / 2**20:.1f} MiB)")
        gather = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(learner_mesh,
                                                                                      jax.sharding.PartitionSpec()))
        paths = [
            ("old device_put", lambda: jax.device_put(params, shardings), biggest),
            ("old gather", lambda: jax.device_put(jax.tree.map(lambda x: x.addressable_data(0), gather(params)),
                                                  shardings), total),
            ("new", lambda: WeightSync()(params, shardings), None),
            ("new, 2 hosts", lambda: WeightSync(hosts=2)(params, shardings), None),
            ("new bf16", lambda: WeightSync(jnp.bfloat16)(params, shardings), None),
            ("new bf16, 2 hosts", lambda: WeightSync(jnp.bfloat16, hosts=2)(params, shardings), None),
        ]
        syncs = {}
        for label, _, _ in paths:
            if label.startswith("new"):
                syncs[label] = WeightSync(jnp.bfloat16 if "bf16" in label else None,
                                          hosts=2 if "hosts" in label else None)
        for label, fn, held in paths:
            if label in syncs:
                fn = (lambda s: lambda: s(params, shardings))(syncs[label])
            seconds, out = timed(fn, args.repeats)
            sent = sum(x.nbytes for x in jax.tree.leaves(out))
            for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(out)):
                assert np.array_equal(np.asarray(want.astype(got.dtype)), np.asarray(got)), label
            if held is None:  # the new path: the actor's shards, and step 1's per-device buffers when it runs
                sync = syncs[label]
                staged = sync.stage(params, shardings)  # all groups at once: an upper bound
                held = max(largest_shard(out), largest_shard(staged))
            print(f"  {label:18s} {seconds * 1e3:8.1f} ms  {sent / 2**20:7.2f} MiB sent  "
                  f"largest buffer on one device/host {held / 2**20:7.2f} MiB", flush=True)
            del out


if __name__ == "__main__":
    main()
