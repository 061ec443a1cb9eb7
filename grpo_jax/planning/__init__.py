"""`grpo-jax compile`: lay a run out on a TPU topology from the same run description as the trainer,
compile every program for it, and report memory, cost and a roofline step time."""
