"""Orchestration: the whole Config, the run description (meshes, shardings, program shapes) shared with
`grpo-jax compile`, the trainer, evaluation during training, metrics and their loggers."""
