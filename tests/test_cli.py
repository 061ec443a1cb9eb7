"""The grpo-jax command line as a user runs it: the README's main job, and one-line errors for bad input."""

import contextlib
import io
import json
import logging
import pathlib

import pytest

from grpo_jax.cli import EXIT_USER_ERROR, main, show_trainer_log

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.vocab_size=260",
         "tokenizer=byte"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "model"
    assert main(["init-model", TINY, *SMALL, "--out", str(out)]) == 0
    return out


def test_init_model_then_generate_writes_jsonl(model_dir, tmp_path, capsys):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n\nreverse: 123=\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "5",
                 "--output", str(out), "--seed", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["hello", "reverse: 123="]
    for row in rows:
        assert set(row) >= {"prompt", "completion", "completion_ids", "logprobs", "finish_reason"}
        assert 1 <= len(row["completion_ids"]) == len(row["logprobs"]) <= 5
        assert all(lp <= 0 for lp in row["logprobs"])
    assert "### 0: hello" in capsys.readouterr().out
    # Greedy is deterministic and does not depend on the seed.
    greedy = []
    for seed in ("1", "2"):
        path = tmp_path / f"greedy{seed}.jsonl"
        main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "5",
              "--temperature", "0", "--seed", seed, "--output", str(path)])
        greedy.append([json.loads(line)["completion_ids"] for line in path.read_text().splitlines()])
    assert greedy[0] == greedy[1]


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompts", "missing.txt", "--max-new-tokens", "4"], "prompt file missing.txt does not exist"),
    (["generate", "--prompts", "{prompts}", "--max-new-tokens", "4", "--max-prompt-len", "3"],
     "prompt 0 is 5 tokens long, over the limit --max-prompt-len=3"),
    (["generate", "--prompts", "{prompts}", "--max-new-tokens", "4", "--top-p", "1.5"], "top_p=1.5"),
    # issue 36 item 13: lax.top_k's own error before
    (["generate", "--prompts", "{prompts}", "--max-new-tokens", "4", "--top-k", "261"],
     "--top-k=261: more than the vocabulary of {model} (260 tokens); use at most 260, or 0 (off)"),
    (["eval", TINY, "model.vocab_size=300", "tokenizer=byte", "sampler.top_k=280", "data.synthetic_size=40",
      "data.synthetic_max_digits=2", "data.synthetic_min_digits=2", "eval.synthetic_size=200", "eval.num_prompts=2"],
     "sampler.top_k=280: more than the vocabulary of {model} (260 tokens); set at most 260, or 0 (off)"),
])
def test_generate_bad_input_is_one_clear_line(model_dir, tmp_path, capsys, args, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = [a.replace("{prompts}", str(prompts)) for a in args]
    message = message.replace("{model}", str(model_dir))
    assert main([args[0], "--model", str(model_dir), *args[1:]]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_missing_model_and_bad_config_are_refused(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompts", str(prompts),
                 "--max-new-tokens", "2"]) == EXIT_USER_ERROR
    assert "nope: not a directory" in capsys.readouterr().err
    assert main(["train", TINY, "optim.learning_rate=1"]) == EXIT_USER_ERROR
    assert "unknown config key 'optim.learning_rate'" in capsys.readouterr().err
    assert main(["init-model", TINY, "model.vocab_size=10", "tokenizer=byte", "--out", str(tmp_path / "m")]) \
        == EXIT_USER_ERROR
    assert "model.vocab_size=10" in capsys.readouterr().err


def test_audit_exit_code_follows_the_ledger(tmp_path, capsys):
    from grpo_jax.state.ledger import Ledger

    ledger = Ledger(tmp_path)
    ledger.train(1, [0, 1], [5, 6], [0, 0], [0, 0])
    ledger.drop(2, 7, 0, "bad_row")
    ledger.checkpoint(1, 3)
    ledger.close()
    assert main(["audit", str(tmp_path)]) == 0
    ledger = Ledger(tmp_path, resumed_from={"step": 1, "run": 0, "seq": 3})
    ledger.train(2, [1, 3], [6, 8], [0, 0], [1, 1])  # ordinal 1 trained a second time
    ledger.checkpoint(2, 4)
    ledger.close()
    assert main(["audit", str(tmp_path)]) == 1
    assert "trained twice" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "none")]) == EXIT_USER_ERROR


def test_overrides_may_follow_options(capsys):
    assert main(["train", TINY, "--run-dir", "/nonexistent/never", "optim.learning_rate=1"]) == EXIT_USER_ERROR
    assert "unknown config key 'optim.learning_rate'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", TINY, "--run-dir", "x", "--bogus"])


def test_the_readme_init_model_command_works_with_the_shipped_config(tmp_path, capsys):
    """`grpo-jax init-model configs/tiny_cpu.yaml --out DIR`, the config unchanged (tokenizer: synthetic)."""
    from grpo_jax.data.tokenizer import load_tokenizer
    from grpo_jax.model.hf import load_hf_model

    out = tmp_path / "m"
    assert main(["init-model", TINY, "--out", str(out)]) == 0, capsys.readouterr().err
    model, tokenizer = load_hf_model(out)
    assert model.config.vocab_size == 32
    synthetic = load_tokenizer("synthetic")  # the trainer's tokenizer for this config, saved beside the model
    assert tokenizer.vocab_size == synthetic.vocab_size
    assert tokenizer.encode("copy: 12=") == synthetic.encode("copy: 12=")


def test_a_prompt_file_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"hello\ncaf\xe9\n")
    code = main(["generate", "--model", str(tmp_path / "unused"), "--prompts", str(prompts), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER_ERROR and err == [f"grpo-jax: error: {prompts}:2: not UTF-8 text (byte offset 9); save "
                                               "the file as UTF-8"], err


def test_the_trainer_log_follows_stderr_when_main_runs_again_with_stderr_redirected():
    # main() called twice in one process, each time with its own stderr (as a notebook or a test does): the log
    # lines go to the current one, not to the first, closed by then.
    log = logging.getLogger("grpo_jax")
    handlers = list(log.handlers)
    log.handlers.clear()
    try:
        first = io.StringIO()
        with contextlib.redirect_stderr(first):
            show_trainer_log()
            log.info("one")
        first.close()
        second = io.StringIO()
        with contextlib.redirect_stderr(second):
            show_trainer_log()
            log.info("two")
        assert second.getvalue().rstrip().endswith("INFO grpo_jax: two")
        assert "Logging error" not in second.getvalue()
    finally:
        log.handlers[:] = handlers


@pytest.mark.parametrize("line, says", [
    ('{"prompt": ' + "[" * 2000 + "]" * 2000 + "}", "nested 2001 deep"),
    ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "digits"),
    ('{"prompt": "a",}', "not valid JSON"),
    ('["a"]', "expected an object with a non-empty string 'prompt'")])
def test_generate_prompt_files_refuse_each_bad_row_in_one_line_naming_it(tmp_path, line, says):
    from grpo_jax.cli import read_prompts
    from grpo_jax.errors import UsageError

    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "What is 2 + 2?", "score": NaN}\n' + line + "\n")
    with pytest.raises(UsageError) as refused:
        read_prompts(str(file))
    message = str(refused.value)
    assert message.startswith(f"{file}:2: ") and says in message and "\n" not in message, message
    file.write_text('{"prompt": "What is 2 + 2?", "score": NaN}\n\n{"prompt": "And 3 + 3?"}\n')
    assert read_prompts(str(file)) == ["What is 2 + 2?", "And 3 + 3?"]
