#!/bin/sh
# Writes tests/data/run_a458d4d (tests/test_stored_run.py) with grpo_jax at a458d4d: trains the tiny CPU config and
# stops it by SIGTERM once step 4's checkpoint is committed (it then saves again after the step it is in).
# Run from the project root.
set -e
repo=$(pwd)
old=$(mktemp -d)
out=$(mktemp -d)/run
git archive a458d4d | tar -x -C "$old"
(cd "$old" && XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH="$old" \
  "$repo/.venv/bin/python" -m grpo_jax.cli train configs/tiny_cpu.yaml model.hidden_size=32 \
  model.intermediate_size=64 model.num_layers=1 grpo.group_size=4 grpo.prompts_per_step=4 trainer.progress=false \
  sampler.max_new_tokens=6 grpo.max_staleness=2 trainer.max_steps=200 checkpoint.every_steps=2 \
  checkpoint.keep_last=1 data.synthetic_size=64 "run_dir=$out" > "$out.log" 2>&1) &
pid=$!
while [ ! -e "$out/checkpoints/4/commit_success.txt" ]; do sleep 0.5; done
kill -TERM $pid
wait $pid || true  # 75: preempted, checkpoint saved
rm -rf tests/data/run_a458d4d
mkdir -p tests/data/run_a458d4d
cp -r "$out/checkpoints" "$out/config.yaml" "$out/events.jsonl" "$out/metrics.jsonl" tests/data/run_a458d4d/
