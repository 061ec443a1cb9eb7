"""The `grpo-jax` command line.

Errors a user can fix (grpo_jax.errors.UserError: bad config, checkpoint, data, prompt file, run directory)
print one line and exit with the error's exit_code (2); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import time

from grpo_jax import json_text
from grpo_jax.errors import CheckpointError, ConfigError, UsageError, UserError
from grpo_jax.platform import choose_platform

EXIT_USER_ERROR = UserError.exit_code


def read_prompts(path: str) -> list[str]:
    """One prompt per line (blank lines skipped), or a .jsonl file with a "prompt" field per row."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise UsageError(f"prompt file {file} does not exist")
    data = file.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is not part of the first prompt
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UsageError(f"{file}:{line}: not UTF-8 text (byte offset {e.start}); save the file as UTF-8") from None
    prompts = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if file.suffix == ".jsonl":
            try:  # a row nested thousands deep, or with a 5000-digit number, is one line too
                row = json_text.loads(line, allow_nan=True)
            except json_text.JSONTextError as e:
                raise UsageError(f"{file}:{line_number}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise UsageError(f"{file}:{line_number}: expected an object with a non-empty string 'prompt'")
            prompts.append(row["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise UsageError(f"prompt file {file} holds no prompts")
    return prompts


def cmd_init_model(args) -> None:
    """Build a model from a config's `model` section with random weights and save it in HF layout."""
    from grpo_jax.config_io import load_config
    from grpo_jax.data.tokenizer import load_tokenizer
    from grpo_jax.model.hf import save_hf_model
    from grpo_jax.model.transformer import count_params, create_model
    from grpo_jax.run.config import Config

    config = load_config(Config, args.config, args.overrides)
    tokenizer = load_tokenizer(config.tokenizer, config.model_path)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size}: must be at least the tokenizer's "
                          f"vocabulary size {tokenizer.vocab_size}")
    model = create_model(config.model, seed=config.seed)
    save_hf_model(model, args.out, tokenizer=tokenizer)
    print(f"wrote a random {count_params(model):,}-parameter {config.model.architecture} model to {args.out}")


def cmd_generate(args) -> None:
    import jax

    from grpo_jax.model.hf import load_hf_model
    from grpo_jax.rollout.sampler import Sampler, SamplerConfig

    sampler_config = SamplerConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   max_new_tokens=args.max_new_tokens, max_prompt_len=args.max_prompt_len)
    problems = sampler_config.validate()
    if problems:
        raise UsageError("; ".join(problems))
    if args.batch_size <= 0:
        raise UsageError(f"--batch-size={args.batch_size}: must be positive")
    texts = read_prompts(args.prompts)
    model, tokenizer = load_hf_model(args.model, dtype=args.dtype)
    if tokenizer is None:
        raise CheckpointError(f"{args.model}: no tokenizer.json, so prompts cannot be tokenized")
    vocab = model.config.vocab_size
    if args.top_k > vocab:
        raise UsageError(f"--top-k={args.top_k}: more than the vocabulary of {args.model} ({vocab} tokens); use at "
                         f"most {vocab}, or 0 (off)")
    if args.chat:
        texts_in = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
        texts_in = texts
    prompts = [tokenizer.encode_prompt(t, chat=args.chat) for t in texts_in]  # as training encodes them
    for i, ids in enumerate(prompts):
        if len(ids) > args.max_prompt_len:
            raise UsageError(f"prompt {i} is {len(ids)} tokens long, over the limit --max-prompt-len="
                             f"{args.max_prompt_len}")
        if not ids:
            raise UsageError(f"prompt {i} encodes to no tokens")
    sampler = Sampler(model, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, config=sampler_config)
    # One key per prompt, from the seed and the prompt's index: results do not depend on batching.
    base = jax.random.key(args.seed)
    out = open(args.output, "w", encoding="utf-8") if args.output else None
    generated = 0
    start = time.perf_counter()
    try:
        for first in range(0, len(prompts), args.batch_size):
            chunk = prompts[first:first + args.batch_size]
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jax.numpy.arange(first, first + len(chunk)))
            result = sampler.generate(chunk, keys)
            for row in range(len(chunk)):
                index = first + row
                length = int(result.lengths[row])
                ids = [int(t) for t in result.tokens[row, :length]]
                completion = tokenizer.decode(ids)
                generated += length
                print(f"### {index}: {texts[index]}\n{completion}\n", flush=True)
                if out:
                    out.write(json.dumps({
                        "prompt": texts[index], "completion": completion, "completion_ids": ids,
                        "logprobs": [float(x) for x in result.logprobs[row, :length]],
                        "finish_reason": result.finish_reasons[row]}) + "\n")
    finally:
        if out:
            out.close()
    elapsed = time.perf_counter() - start
    print(f"generated {generated} tokens for {len(prompts)} prompts in {elapsed:.1f}s "
          f"({generated / max(elapsed, 1e-9):.0f} tokens/s, compilation included)", file=sys.stderr)


def cmd_import_gguf(args) -> None:
    """Write a Hugging Face checkpoint directory from a GGUF file (grpo_jax.model.gguf_import)."""
    from grpo_jax.model.gguf_import import import_gguf

    result = import_gguf(args.file, args.outdir)
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(result.source_types.items()))
    print(f"wrote a {result.parameters:,}-parameter {result.architecture} model to {result.out_dir} (tensors {types}, "
          f"dequantized to bfloat16) in {result.seconds:.1f}s; use it as model_path={result.out_dir}")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a line is logged. logging.StreamHandler() keeps the stream it
    was made with: main() called again in one process with stderr redirected (contextlib.redirect_stderr, a
    notebook cell, a test's capture) would write to the first stderr, closed by then, and print 'Logging error'
    with a traceback instead of the line."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass  # StreamHandler.__init__ and setStream assign it: the current sys.stderr is always used


def show_trainer_log() -> None:
    """grpo_jax's own INFO lines (resume, data exhausted, ...) on stderr; other libraries stay at their level."""
    log = logging.getLogger("grpo_jax")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def cmd_train(args) -> int:
    """Train; resumes from the newest good checkpoint in the run directory. Exit 0 when done,
    EXIT_PREEMPTED (75) after a SIGTERM/SIGINT once its checkpoint is committed."""
    from grpo_jax.config_io import load_config
    from grpo_jax.run.config import Config
    from grpo_jax.run.trainer import EXIT_PREEMPTED, Trainer

    config = load_config(Config, args.config, args.overrides)
    run_dir = args.run_dir or config.run_dir
    show_trainer_log()
    import faulthandler
    import signal
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    except (OSError, ValueError):
        pass  # stderr is not a real file (e.g. captured by a test runner): no stack dumps, nothing else changes
    from grpo_jax.parallel.distributed import PeerLost, initialize
    initialize(config.distributed)  # several processes (a TPU pod, or the multi-process tests)
    try:
        trainer = Trainer(config, run_dir)
        history = trainer.train()
    except PeerLost as e:
        # The trainer has closed what it opened. JAX's exit would wait at a shutdown barrier the lost process can
        # never reach (distributed.shutdown_timeout_s), then abort with pages of log: leave now, in one line.
        print_error(e)
        sys.stdout.flush()
        os._exit(e.exit_code)
    if trainer.preempted:
        print(f"preempted after step {trainer.version}; checkpoint saved in {run_dir}: run the same command to "
              "resume", file=sys.stderr)
        return EXIT_PREEMPTED
    if history:
        last = history[-1]
        print(f"trained {last['step']} steps in {last['time/elapsed_s']:.0f}s; final reward/mean "
              f"{last['reward/mean']:.3f}; run directory {run_dir}")
    return 0


def cmd_eval(args) -> None:
    """Evaluate a saved model on the config's held-out prompts (its eval section, grpo_jax.run.evaluation): one
    JSON line per prompt to --output (else stdout), then one summary line on stdout."""
    from grpo_jax.algorithm.rewards import RewardSuite
    from grpo_jax.config_io import load_config
    from grpo_jax.data.tokenizer import load_tokenizer
    from grpo_jax.model.hf import load_hf_model
    from grpo_jax.rollout.sampler import Sampler
    from grpo_jax.run.config import Config
    from grpo_jax.run.evaluation import Evaluator, eval_problems, held_out_records
    from grpo_jax.run.metrics import json_line

    config = load_config(Config, args.config, args.overrides)
    problems = eval_problems(config)  # whatever eval.every_steps says: this command evaluates
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
    tokenizer = load_tokenizer(config.tokenizer, args.model)  # tokenizer "": the model directory's own
    records = held_out_records(config, tokenizer)  # data problems are reported before the model is read
    model, _ = load_hf_model(args.model, dtype=config.model.dtype)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"tokenizer={config.tokenizer!r}: {tokenizer.vocab_size} tokens, more than the vocab_size "
                          f"{model.config.vocab_size} of {args.model}/config.json")
    if config.sampler.top_k > model.config.vocab_size:  # Config.validate knew only the config's model
        raise ConfigError(f"sampler.top_k={config.sampler.top_k}: more than the vocabulary of {args.model} "
                          f"({model.config.vocab_size} tokens); set at most {model.config.vocab_size}, or 0 (off)")
    sampler = Sampler(model, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, config=config.sampler)
    rewards = RewardSuite(config.rewards, timeout_s=config.trainer.reward_timeout_s)
    evaluator = Evaluator(config, tokenizer, records, rewards,
                          batch_rows=config.grpo.prompts_per_step * config.grpo.group_size)
    # Opened before evaluating: a path that cannot be written is refused before the work, not after it.
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        sampler.close()
        rewards.close()
        raise UsageError(f"--output={args.output}: cannot be written ({e.strerror}); name a file in an existing, "
                         "writable directory") from None
    start = time.perf_counter()
    try:
        try:
            result = evaluator.evaluate(sampler)
        finally:
            sampler.close()
            rewards.close()  # worker processes of process-isolated rewards
        for prompt in result.prompts:
            out.write(json_line(prompt))
    finally:
        if args.output:
            out.close()
    print(json_line({"model": str(args.model), **result.summary, "eval/seconds": time.perf_counter() - start}),
          end="", flush=True)


def cmd_plot(args) -> None:
    from grpo_jax.run.plot import plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from e
    for path in written:
        print(path)


def cmd_audit(args) -> int:
    from grpo_jax.state.ledger import audit

    run_dir = pathlib.Path(args.run_dir)
    if not (run_dir / "events.jsonl").is_file() and not list(run_dir.glob("events.process*.jsonl")):
        raise UsageError(f"{args.run_dir} holds no ledger (events.jsonl, or events.process*.jsonl from several "
                         "processes): is it a grpo_jax run directory?")
    report = audit(args.run_dir)
    print(report.summary())
    return 0 if report.ok else 1


def cmd_compile(args) -> None:
    """Compile every program of a run for a TPU topology (no TPU needed) and report memory and time; exits
    with DoesNotFit's code when a program does not fit. With --fit, search layouts instead (planning.fit)."""
    if args.fit_limit is not None and not args.fit:
        raise UsageError(f"--fit-limit {args.fit_limit}: only with --fit (it bounds the layouts --fit compiles)")
    if args.fit_limit is not None and args.fit_limit < 1:
        raise UsageError(f"--fit-limit {args.fit_limit}: must be at least 1 (layouts compiled)")
    # Compiling for a described topology needs no accelerator (libtpu describes it on any platform): never take
    # this machine's TPU or GPU from a run. An explicit JAX_PLATFORMS is kept.
    choose_platform("cpu")
    if args.fit:
        return compile_fit(args)
    from grpo_jax.config_io import load_config
    from grpo_jax.planning.compile import compile_run
    from grpo_jax.planning.report import check_fits, format_report
    from grpo_jax.run.config import Config

    config = load_config(Config, args.config, args.overrides)
    report = compile_run(config, args.topology, args.chips_per_host, config_path=args.config)
    print(format_report(report), flush=True)
    check_fits(report)


def compile_fit(args) -> None:
    """grpo-jax compile --fit: one line per layout compiled, then those that fit, fastest first, each with its
    overrides; NothingFits (exit 2) when none does."""
    from grpo_jax.planning.fit import DEFAULT_LIMIT, NothingFits, fit, format_fit, nothing_fits_message

    limit = args.fit_limit or DEFAULT_LIMIT
    search = fit(args.config, args.overrides, args.topology, args.chips_per_host, limit,
                 progress=lambda line: print(line, flush=True))
    if not any(attempt.fits for attempt in search.attempts):
        raise NothingFits(nothing_fits_message(search, args.topology))
    print(format_fit(search.attempts, args.topology), flush=True)


def cmd_config(args) -> None:
    """grpo-jax config --describe [SECTION]: every config key (or one section's) with its type, default, allowed
    values and help, as config_io.describe_text writes them."""
    from grpo_jax.config_io import describe_config, describe_text
    from grpo_jax.run.config import Config

    sections = describe_config(Config)
    if args.describe:
        chosen = [s for s in sections if s.name == args.describe or s.name.startswith(args.describe + ".")]
        if not chosen:
            names = ", ".join(s.name for s in sections if s.name)
            raise UsageError(f"--describe {args.describe}: no such config section; the sections are {names} "
                             "(or no SECTION for every key)")
        sections = chosen
    print(describe_text(sections), end="")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-jax", description="Asynchronous GRPO in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init-model", help="write a randomly initialised model (HF layout) from a config")
    init.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    init.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=4")
    init.add_argument("--out", required=True, help="directory to write config.json, model.safetensors, tokenizer")
    init.set_defaults(func=cmd_init_model)

    gen = sub.add_parser("generate", help="sample completions for a file of prompts")
    gen.add_argument("--model", required=True, help="a Hugging Face model directory")
    gen.add_argument("--prompts", required=True, help="text file, one prompt per line (or .jsonl with 'prompt')")
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--batch-size", type=int, default=64)
    gen.add_argument("--max-prompt-len", type=int, default=1024)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--output", help="write one JSON object per prompt to this .jsonl file")
    gen.set_defaults(func=cmd_generate)

    imp = sub.add_parser("import-gguf", help="write a Hugging Face checkpoint directory (bfloat16 safetensors, "
                         "config.json, tokenizer) from a llama.cpp GGUF file")
    imp.add_argument("file", help="a .gguf file (architecture llama, qwen2 or qwen3; byte-level BPE tokenizer)")
    imp.add_argument("outdir", help="the checkpoint directory to write (must not exist, or be empty)")
    imp.set_defaults(func=cmd_import_gguf)

    train = sub.add_parser("train", help="train with asynchronous GRPO")
    train.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-6")
    train.add_argument("--run-dir", help="where metrics, ledger and checkpoints go (default: run_dir of the config)")
    train.set_defaults(func=cmd_train)

    plot = sub.add_parser("plot", help="write PNGs of a run's metrics")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="folder for the PNGs (default RUN_DIR/plots)")
    plot.set_defaults(func=cmd_plot)

    ev = sub.add_parser("eval", help="evaluate a saved model on the config's held-out prompts (eval section)")
    ev.add_argument("config", help="YAML config whose data, eval and rewards sections say what to evaluate on")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.split=test eval.samples=16")
    ev.add_argument("--model", required=True, help="a Hugging Face model directory, e.g. RUN_DIR/final_model")
    ev.add_argument("--output", help="write the per-prompt results (JSONL) here instead of stdout")
    ev.set_defaults(func=cmd_eval)

    aud = sub.add_parser("audit", help="check the prompt ledger: every prompt trained once or dropped")
    aud.add_argument("run_dir")
    aud.set_defaults(func=cmd_audit)

    comp = sub.add_parser("compile", help="compile every program of a run for a TPU topology, without a TPU, and "
                          "report per-device memory, cost and a projected step time")
    comp.add_argument("config", help="YAML config, e.g. configs/gsm8k_qwen2_5.yaml")
    comp.add_argument("overrides", nargs="*",
                      help="dotted overrides, e.g. model_path=configs/shapes/Qwen2.5-7B-Instruct")
    comp.add_argument("--topology", required=True, help="a TPU slice: v5e:2x4, v5p:2x2x2, v4:2x2x4, v6e:2x4, ...")
    comp.add_argument("--chips-per-host", default="", help="e.g. 2x2 (default: libtpu's 4 chips per host, except "
                      "v5e/v6e slices of up to 8 chips, which are one host)")
    comp.add_argument("--fit", action="store_true", help="search layouts (device split, meshes, micro-batch, "
                      "engine slots, remat) and list those that fit, fastest first, with their overrides; settings "
                      "given as overrides are held fixed")
    comp.add_argument("--fit-limit", type=int, default=None, metavar="N",
                      help="with --fit: compile at most N layouts (default 12), those estimated to fit first")
    comp.set_defaults(func=cmd_compile)

    conf = sub.add_parser("config", help="describe the config keys: type, default, allowed values and help")
    conf.add_argument("--describe", nargs="?", const="", required=True, metavar="SECTION",
                      help="print every key, or one section's (e.g. sampler, trainer.wandb)")
    conf.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    choose_platform()  # before JAX starts: no libtpu start-up errors on a machine without a TPU (grpo_jax.platform)
    parser = build_parser()
    # Overrides may also follow options (`train CONFIG --run-dir D optim.lr=1e-6`): argparse leaves those
    # unparsed, so collect key=value leftovers into the overrides and refuse anything else.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args) or 0
    except UserError as e:
        print_error(e)
        return e.exit_code


def print_error(e: UserError) -> None:
    message = " ".join(line.strip() for line in str(e).splitlines())  # one line, even for YAML's messages
    print(f"grpo-jax: error: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
