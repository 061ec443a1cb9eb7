"""Warm start from a Hugging Face checkpoint, end to end: train the synthetic task from scratch and export
final_model/ in bfloat16 with its char-level tokenizer, then `grpo-jax train model_path=...` from it. The
loaded bfloat16 weights train as float32 master weights, final_model/ holds exactly the learner's parameters,
and the reward goes on rising from where the first run left it."""

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax.cli import main
from grpo_jax.config_io import ConfigError, load_config
from grpo_jax.data.tasks import SYNTHETIC_ALPHABET
from grpo_jax.data.tokenizer import Tokenizer
from grpo_jax.model.hf import load_hf_model, save_hf_model
from grpo_jax.model.safetensors_io import SafetensorsFile
from grpo_jax.model.transformer import create_model, param_dict
from grpo_jax.run.config import Config
from grpo_jax.run.metrics import read_metrics
from grpo_jax.run.trainer import load_policy

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
# Synchronous, so each run is deterministic; every run here shares this architecture (the warm starts
# would otherwise be refused: with model_path the architecture comes from config.json). One sampler batch
# shape (min_batch_bucket) instead of three saves compilations.
SETTINGS = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "grpo.group_size=8",
            "grpo.prompts_per_step=16", "grpo.max_staleness=0", "sampler.max_new_tokens=6",
            "sampler.min_batch_bucket=64", "optim.warmup_steps=0", "optim.decay_steps=0",
            "trainer.progress=false", "trainer.tensorboard=false"]
STEPS = 20  # per learning run: the reward rises by about 0.2 in each on this setting
WINDOW = 5  # steps averaged for an early or late reward


def rewards(run_dir: pathlib.Path) -> list[float]:
    return [row["reward/mean"] for row in read_metrics(run_dir)]  # the learner-step lines of metrics.jsonl


def saved_params(run_dir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    """The learner's parameters in checkpoint `step`, as host arrays named as param_dict names them."""
    path = run_dir / "checkpoints" / str(step) / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            checkpointer.metadata(path).item_metadata.tree)
    params = checkpointer.restore(path, restore_args=as_numpy)["params"]
    # Each parameter is saved as {"value": array} under its module path.
    return {".".join(str(k.key) for k in keys[:-1]): leaf
            for keys, leaf in jax.tree_util.tree_leaves_with_path(params)}


def half_bfloat16_spacing(values: np.ndarray) -> np.ndarray:
    """Half the gap between bfloat16 neighbours at each (bfloat16) value: a smaller change rounds away in
    bfloat16. Zero at zero, where bfloat16 resolves any change this test makes."""
    _, exponent = np.frexp(values)  # |value| in [2**(exponent-1), 2**exponent); 8 significant bits
    return np.where(values == 0, 0.0, np.ldexp(1.0, exponent - 9))


def test_warm_start_from_an_exported_bfloat16_checkpoint(tmp_path):
    # 1. From scratch: final_model/ in bfloat16, with the synthetic char-level tokenizer.
    scratch = tmp_path / "scratch"
    assert main(["train", TINY, *SETTINGS, "optim.lr=3e-3", f"trainer.max_steps={STEPS}",
                 "trainer.export_dtype=bfloat16", "--run-dir", str(scratch)]) == 0
    export = scratch / "final_model"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype.name for t in SafetensorsFile(export / "model.safetensors").tensors.values()} == {"bfloat16"}
    synthetic, saved = Tokenizer.char_level(SYNTHETIC_ALPHABET), Tokenizer.from_dir(export)
    text = "reverse: 381=\n0+9"
    assert saved.encode(text) == synthetic.encode(text) and saved.decode(synthetic.encode(text)) == text
    assert (saved.eos_ids, saved.pad_id, saved.vocab_size) == (synthetic.eos_ids, synthetic.pad_id,
                                                               synthetic.vocab_size)
    start = {k: np.asarray(v, np.float32) for k, v in param_dict(load_hf_model(export)[0]).items()}

    # 2. One step at the GSM8K config's lr (1e-6), tokenizer "" (the checkpoint's own). Float32 master
    # weights keep updates far below bfloat16's spacing; bfloat16 ones would round every one of them away.
    one_step = tmp_path / "one_step"
    assert main(["train", TINY, *SETTINGS, f"model_path={export}", "tokenizer=", "optim.lr=1e-6",
                 "trainer.max_steps=1", "--run-dir", str(one_step)]) == 0
    after = saved_params(one_step, 1)
    assert after.keys() == start.keys() and {a.dtype for a in after.values()} == {np.dtype(np.float32)}
    kept, total = 0, 0
    for name, before in start.items():
        change = np.abs(after[name] - before)
        kept += int(np.sum((change > 0) & (change < half_bfloat16_spacing(before))))
        total += before.size
    assert kept > total // 2, f"only {kept} of {total} parameters kept an update below bfloat16's spacing"
    # final_model/ comes back in the dtype the checkpoint came in.
    assert json.loads((one_step / "final_model" / "config.json").read_text())["dtype"] == "bfloat16"

    # 3. Training on from the export: the reward starts near where the first run left it and goes on rising.
    warm = tmp_path / "warm"
    assert main(["train", TINY, *SETTINGS, f"model_path={export}", "tokenizer=", "optim.lr=3e-3",
                 f"trainer.max_steps={STEPS}", "trainer.export_dtype=float32", "--run-dir", str(warm)]) == 0
    first, then = rewards(scratch), rewards(warm)
    scratch_early, warm_early, warm_late = (np.mean(first[:WINDOW]), np.mean(then[:WINDOW]),
                                            np.mean(then[-WINDOW:]))
    print(f"mean reward: scratch {scratch_early:.3f} -> {np.mean(first[-WINDOW:]):.3f}, "
          f"warm start {warm_early:.3f} -> {warm_late:.3f}")
    assert warm_early > scratch_early + 0.05, (first, then)
    assert warm_late > warm_early + 0.1, then
    # final_model/ is exactly the learner's last parameters (the checkpoint saved at the end).
    final, _ = load_hf_model(warm / "final_model")
    last = saved_params(warm, STEPS)
    for name, value in param_dict(final).items():
        np.testing.assert_array_equal(np.asarray(value), last[name], err_msg=name)


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A random model of tiny_cpu's architecture with SETTINGS, saved in bfloat16 with the synthetic tokenizer."""
    config = load_config(Config, TINY, SETTINGS)
    path = tmp_path_factory.mktemp("bf16_checkpoint")
    save_hf_model(create_model(config.model), path, tokenizer=Tokenizer.char_level(SYNTHETIC_ALPHABET),
                  dtype="bfloat16")
    return path


def test_model_section_settings_apply_to_a_checkpoint(bfloat16_checkpoint):
    config = load_config(Config, TINY, SETTINGS + [f"model_path={bfloat16_checkpoint}", "tokenizer=",
                                                   "model.dtype=bfloat16", "model.remat=true"])
    model = load_policy(config, Tokenizer.from_dir(bfloat16_checkpoint))
    assert (model.config.dtype, model.config.param_dtype, model.config.remat) == ("bfloat16", "float32", True)
    assert {np.asarray(v).dtype for v in param_dict(model).values()} == {np.dtype(np.float32)}
    assert model.embed[...].astype(ml_dtypes.bfloat16).astype(np.float32).tolist() == \
        np.asarray(model.embed[...]).tolist()  # the checkpoint's bfloat16 values, widened


def test_architecture_keys_that_contradict_the_checkpoint_are_refused(bfloat16_checkpoint):
    config = load_config(Config, TINY, SETTINGS + [f"model_path={bfloat16_checkpoint}", "tokenizer=",
                                                   "model.hidden_size=96", "model.num_layers=3"])
    with pytest.raises(ConfigError, match=r"^model\.hidden_size=96 \(config\.json: 64\), model\.num_layers=3 "
                                          r"\(config\.json: 2\): with model_path the architecture comes from .*"
                                          r"config\.json; remove these keys"):
        load_policy(config, Tokenizer.from_dir(bfloat16_checkpoint))


def test_export_dtype_is_checked_with_the_config():
    assert load_config(Config, TINY, ["trainer.export_dtype=bfloat16"]).trainer.export_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"trainer\.export_dtype='float16': allowed '' \(as the weights came in\), "
                                          r"float32, bfloat16"):
        load_config(Config, TINY, ["trainer.export_dtype=float16"])
