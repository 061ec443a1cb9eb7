"""The top-level run config: one dataclass per section, loaded by config_io from configs/*.yaml."""

from __future__ import annotations

import dataclasses

from grpo_jax.model import ModelConfig
from grpo_jax.sampler import SamplerConfig
from grpo_jax.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class Config:
    # Architecture of a model built from scratch; ignored when model_path names a checkpoint.
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    # A Hugging Face directory (config.json + safetensors + tokenizer.json) to start from.
    model_path: str = ""
    # "byte" builds the byte-level tokenizer locally; otherwise a directory holding tokenizer.json.
    # Empty: the tokenizer of model_path.
    tokenizer: str = ""
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    seed: int = 0
    run_dir: str = "runs/default"

    def validate(self) -> list[str]:
        problems = []
        if not self.model_path and self.tokenizer == "":
            problems.append("tokenizer='': set tokenizer ('byte' or a directory) when no model_path is given")
        if self.seed < 0:
            problems.append(f"seed={self.seed}: must be >= 0")
        if not self.run_dir:
            problems.append("run_dir='': must name a directory")
        return problems
