"""The top-level run config: one dataclass per section, loaded by config_io from configs/*.yaml."""

from __future__ import annotations

import dataclasses

from grpo_jax.algorithm.advantages import GRPOConfig
from grpo_jax.algorithm.learner import OptimConfig
from grpo_jax.algorithm.losses import LossConfig
from grpo_jax.config_io import config_key
from grpo_jax.data.pipeline import DataConfig
from grpo_jax.envs.environment import EnvConfig
from grpo_jax.model.lora import LoraConfig
from grpo_jax.model.transformer import ModelConfig
from grpo_jax.parallel.distributed import DistributedConfig
from grpo_jax.parallel.sharding import MeshLayout
from grpo_jax.rollout.sampler import SamplerConfig
from grpo_jax.run.evaluation import EvalConfig, eval_problems
from grpo_jax.run.wandb_logger import WandbConfig
from grpo_jax.state.checkpoint import CheckpointConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    max_steps: int = config_key(100, "Learner steps the run trains.")
    buffer_capacity: int = config_key(0, "Groups the replay buffer holds; 0: prompts_per_step * (max_staleness + 2).")
    group_timeout_s: float = config_key(600.0, "The learner stops with an error if a step's groups take longer.")
    # JAX's heartbeat only ends the wait for a dead process; normal skew is seconds, and a process may legitimately
    # lag up to group_timeout_s.
    collective_timeout_s: float = config_key(0.0, "Several processes: the longest an agreement between them waits "
                                                  "for one that is alive but stuck; then the waiting processes exit "
                                                  "with 4 and one line. 0: 3 x group_timeout_s.")
    reward_timeout_s: float = config_key(10.0, "Per handout: samples not scored by then fail (the others keep their "
                                               "scores).")
    # A reward that fails on every sample (a bug, a verifier that is down) then ends the run with its error instead
    # of dropping every prompt of every epoch.
    reward_error_handouts: int = config_key(10, "Stop the run once this many handouts (grpo.prompts_per_step prompts "
                                                "each, per process) in a row gave no group to train because the "
                                                "rewards failed (every group dropped as reward_error). 0: never stop "
                                                "for that.")
    progress: bool = config_key(True, "A progress bar of the learner steps (tqdm, on stderr).")
    tensorboard: bool = config_key(True, "TensorBoard event files in RUN_DIR/tb/, beside metrics.jsonl.")
    save_final_model: bool = config_key(True, "RUN_DIR/final_model in Hugging Face layout when the run ends.")
    export_dtype: str = config_key("", "dtype of final_model's weights: '' as the weights came in (model_path's "
                                       "checkpoint dtype, else model.param_dtype), or float32 / bfloat16.")
    check_replicas: bool = config_key(False, "Several processes: after every step, hash each host's copy of the "
                                             "weights and stop if they differ (costs a host copy and hash of the "
                                             "parameters per step; for tests and first runs on a new cluster).")
    wandb: WandbConfig = config_key(help="Weights & Biases, beside metrics.jsonl and TensorBoard; off unless mode is "
                                         "online or offline.", default_factory=WandbConfig)

    def collective_timeout(self) -> float:
        return self.collective_timeout_s or 3 * self.group_timeout_s

    def validate(self) -> list[str]:
        problems = []
        if self.max_steps < 1:
            problems.append(f"max_steps={self.max_steps}: must be >= 1")
        if self.buffer_capacity < 0:
            problems.append(f"buffer_capacity={self.buffer_capacity}: must be >= 0 (0 = automatic)")
        for key in ("group_timeout_s", "reward_timeout_s"):
            if not getattr(self, key) > 0:
                problems.append(f"{key}={getattr(self, key)}: must be > 0")
        if not self.collective_timeout_s >= 0:
            problems.append(f"collective_timeout_s={self.collective_timeout_s}: must be >= 0 (0: 3 x group_timeout_s)")
        if self.reward_error_handouts < 0:
            problems.append(f"reward_error_handouts={self.reward_error_handouts}: must be >= 0 (0: never stop the run "
                            "for failing rewards)")
        if self.export_dtype not in ("", "float32", "bfloat16"):
            problems.append(f"export_dtype={self.export_dtype!r}: allowed '' (as the weights came in), float32, "
                            "bfloat16")
        return problems


def _default_rewards() -> list:
    return [{"name": "synthetic_digits", "weight": 1.0}]


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = config_key(help="Architecture of a model built from scratch; with model_path only dtype, "
                                         "param_dtype and remat apply (the architecture comes from its config.json).",
                                    default_factory=ModelConfig)
    model_path: str = config_key("", "A Hugging Face directory (config.json + safetensors + tokenizer.json) to start "
                                     "from.")
    tokenizer: str = config_key("", "'byte' or 'synthetic' (char-level over the synthetic tasks' symbols) are built "
                                    "locally; otherwise a directory holding tokenizer.json. Empty: the tokenizer of "
                                    "model_path.")
    sampler: SamplerConfig = config_key(help="How the actor samples completions (the static sampler or the "
                                             "continuous engine).", default_factory=SamplerConfig)
    data: DataConfig = config_key(help="The training prompts: their source, fields, format and order.",
                                  default_factory=DataConfig)
    rewards: list = config_key(help="Weighted reward terms: [{name, weight, kwargs, label, samples_per_call}]; a name "
                                    "from grpo_jax.algorithm.rewards.REWARDS, or a factory of your own by import path "
                                    "'package.module:factory'.", default_factory=_default_rewards)
    env: EnvConfig | None = config_key(None, "A multi-turn environment (grpo_jax.envs): its episodes replace single "
                                             "completions, its reward() the rewards section (which must then be "
                                             "empty). None: single-turn prompts scored by `rewards`.")
    grpo: GRPOConfig = config_key(help="Groups, steps, staleness and how advantages are computed.",
                                  default_factory=GRPOConfig)
    loss: LossConfig = config_key(help="The policy loss: clipping, aggregation, KL, off-policy correction and entropy.",
                                  default_factory=LossConfig)
    optim: OptimConfig = config_key(help="Learning rate, schedule, AdamW, clipping, and how the learner splits a "
                                         "step's batch into mini- and micro-batches.", default_factory=OptimConfig)
    lora: LoraConfig = config_key(help="LoRA adapters on a frozen base (rank 0: off, every weight trains).",
                                  default_factory=LoraConfig)
    trainer: TrainerConfig = config_key(help="The run: its length, timeouts, logging and what it writes at the end.",
                                        default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = config_key(help="When checkpoints are saved and kept, and what a resume restores.",
                                              default_factory=CheckpointConfig)
    eval: EvalConfig = config_key(help="Evaluation on held-out prompts during training (every_steps > 0) and by "
                                       "`grpo-jax eval`.", default_factory=EvalConfig)
    mesh: MeshLayout = config_key(help="How devices split between the actor (sampling) and the learner (updates), "
                                       "and each one's mesh.", default_factory=MeshLayout)
    distributed: DistributedConfig = config_key(help="Several processes (a TPU pod, several hosts): how they find "
                                                     "each other and how long they wait.",
                                                default_factory=DistributedConfig)
    seed: int = config_key(0, "Seed of a model built from scratch, of the LoRA adapters and their dropout, and of the "
                                 "sampling keys.")
    run_dir: str = config_key("runs/default", "Where metrics, the ledger and checkpoints go (grpo-jax train "
                                              "--run-dir overrides it).")

    def validate(self) -> list[str]:
        from grpo_jax.algorithm.rewards import RewardNameError, RewardSpec, get_reward
        from grpo_jax.sandbox import Sandbox

        problems = []
        if not self.model_path and self.tokenizer == "":
            problems.append("tokenizer='': set tokenizer ('byte', 'synthetic' or a directory) when no "
                            "model_path is given")
        if self.seed < 0:
            problems.append(f"seed={self.seed}: must be >= 0")
        if not self.run_dir:
            problems.append("run_dir='': must name a directory")
        if not self.rewards and self.env is None:
            problems.append("rewards=[]: need at least one reward term")
        if self.env is not None:
            problems += self.env_problems()
        for i, spec in enumerate(self.rewards):
            try:
                parsed = RewardSpec.parse(spec)
                get_reward(parsed.name, **parsed.kwargs)
            except RewardNameError as e:
                problems.append(f"rewards[{i}].name={e.name!r}: {e.reason}")
                continue
            except (ValueError, TypeError) as e:
                problems.append(f"rewards[{i}]={spec!r}: {e}")
                continue
            # A program that runs to its sandbox's limit must end before the scoring it is part of does, or it
            # fails its sample as a timed-out reward instead of scoring 0.
            program_s = parsed.kwargs.get("timeout_s", Sandbox.timeout_s)
            if parsed.name == "python_output" and program_s >= self.trainer.reward_timeout_s:
                problems.append(f"rewards[{i}].kwargs.timeout_s={program_s}: must be below "
                                f"trainer.reward_timeout_s={self.trainer.reward_timeout_s}, which bounds the scoring "
                                "of a whole handout; lower it, or raise trainer.reward_timeout_s")
        if self.loss.aggregation == "seq_mean_token_sum_norm" and self.loss.max_completion_len <= 0:
            problems.append("loss.max_completion_len=0: aggregation seq_mean_token_sum_norm needs the constant "
                            f"normaliser (usually sampler.max_new_tokens={self.sampler.max_new_tokens})")
        vocab, where = self.vocab_size()
        if vocab is not None and self.sampler.top_k > vocab:
            problems.append(f"sampler.top_k={self.sampler.top_k}: more than the model's vocabulary of {vocab} tokens "
                            f"({where}); set at most {vocab}, or 0 (off)")
        if self.sampler.temperature == 0:
            problems.append("sampler.temperature=0: greedy sampling gives every completion of a group the same "
                            "tokens, so the group's advantages are 0 and training learns nothing; set "
                            "sampler.temperature > 0 (e.g. 1.0). Evaluation is separate: its pass@1 is greedy "
                            "anyway and eval.temperature sets its sampled completions")
        if self.eval.every_steps:
            problems += eval_problems(self)
        micro, mini = self.optim.micro_batch_size, self.optim.mini_batches
        rows = self.grpo.prompts_per_step * self.grpo.group_size
        if rows % mini:
            problems.append(f"optim.mini_batches={mini}: must divide grpo.prompts_per_step * grpo.group_size = "
                            f"{rows} (each update trains an equal share of the rows)")
        elif micro and not self.optim.packing and (rows // mini) % micro:
            # (Packed rows are as many as a step needs, rounded up to what splits: run.plan.packed_row_sizes.)
            problems.append(f"optim.micro_batch_size={micro}: must divide the rows of one mini-batch, "
                            f"prompts_per_step * group_size / mini_batches = {rows // mini} (optim.packing=false)")
        return problems

    def env_problems(self) -> list[str]:
        """What a run with an environment (env section) needs of the rest of the config, as 'key=value: fix'."""
        problems = []
        if self.rewards:
            problems.append(f"rewards={self.rewards!r}: with an env section the environment's reward() scores each "
                            "episode; set rewards: [] (score inside the environment)")
        if not self.optim.packing:
            problems.append("optim.packing=false: an episode's segments are trained as packed sequences; set "
                            "optim.packing=true with an env section")
        if self.eval.every_steps:
            problems.append(f"eval.every_steps={self.eval.every_steps}: evaluation during training runs single-turn "
                            "prompts, not episodes; set eval.every_steps=0 with an env section")
        if self.model.replays_routing:
            problems.append("model.routing_replay=true: not recorded for episodes; set model.routing_replay=false")
        if self.sampler.kv_cache != "ring":
            problems.append(f"sampler.kv_cache={self.sampler.kv_cache!r}: episodes run on the continuation engine, "
                            "whose rows keep a KV cache of their own; set sampler.kv_cache=ring with an env section")
        if self.sampler.slots and self.sampler.slots < self.grpo.group_size:
            problems.append(f"sampler.slots={self.sampler.slots}: with an env section a group's "
                            f"grpo.group_size={self.grpo.group_size} episodes run together, one slot each; set "
                            f"sampler.slots to at least {self.grpo.group_size}, or 0 (one step's episodes)")
        return problems

    def vocab_size(self) -> tuple[int | None, str]:
        """The model's vocabulary size and where it comes from: model.vocab_size, or model_path's config.json.
        None when that file cannot be read here: loading the model then refuses it in one line, before any
        compile."""
        if not self.model_path:
            return self.model.vocab_size, "model.vocab_size"
        from grpo_jax.errors import UserError
        from grpo_jax.model.hf import checkpoint_config

        where = f"{self.model_path}/config.json"
        try:
            return checkpoint_config(self.model_path).vocab_size, where
        except (UserError, OSError, ValueError):
            return None, where

    def actor_across_hosts_problems(self) -> list[str]:
        """What this config asks of an actor whose mesh spans hosts (sharding.cut_devices) that such an actor
        does not do, as 'key=value: fix' strings. Such an actor is one sampler for every host's prompts, its
        programs run by all hosts together, one batch at a time (actor.Actor's lockstep rounds)."""
        problems = []
        if self.env is not None:
            problems.append("env: episodes run on one actor per host; an actor mesh across hosts cannot run them "
                            "(give each host its own actor devices: mesh.actor_devices)")
        if self.sampler.engine != "static":
            problems.append(f"sampler.engine={self.sampler.engine!r}: an actor mesh across hosts samples with the "
                            "static sampler, one batch of every host's prompts at a time (set sampler.engine=static; "
                            "the continuous engine runs one engine per host)")
        if self.eval.every_steps:
            problems.append(f"eval.every_steps={self.eval.every_steps}: evaluation during training runs on process 0's "
                            "actor alone, which an actor mesh across hosts cannot do (set eval.every_steps=0 and "
                            "run grpo-jax eval on RUN_DIR/final_model)")
        return problems

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what the user wants (logged at the start of a run)."""
        found = []
        if self.loss.off_policy == "none" and self.grpo.max_staleness > 0:
            found.append(f"loss.off_policy=none with grpo.max_staleness={self.grpo.max_staleness}: groups up to "
                         f"{self.grpo.max_staleness} step(s) old are trained with no correction for the policy "
                         "that generated them (use off_policy tis or decoupled)")
        if self.loss.loss_type == "gspo" and self.loss.aggregation == "token_mean":
            found.append("loss.loss_type=gspo with loss.aggregation=token_mean: each sequence's term is weighted by "
                         "its length, which is not GSPO's sequence-level objective (the mean over sequences of the "
                         "clipped sequence ratio times the advantage); set loss.aggregation=seq_mean_token_mean")
        if self.loss.kl_coef > 0 and self.loss.kl_estimator == "k1":
            found.append(f"loss.kl_estimator=k1 with loss.kl_coef={self.loss.kl_coef}: as a loss term k1 = log pi - "
                         "log ref has zero expected gradient (the gradient is the score function, whose mean under "
                         "pi is 0), so the penalty adds only noise; use k3 (the default) or k2")
        return found
