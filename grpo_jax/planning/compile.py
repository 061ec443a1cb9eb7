"""Ahead-of-time compilation for a TPU topology, without a TPU: `grpo-jax compile CONFIG --topology NAME`.

The run is laid out on the topology by the run description the trainer uses (run.plan.RunPlan: the same
device cut, meshes, shardings and programs, over abstract arrays), and every program a run executes is
compiled for it (the modules beside this one):

- topology.py: the slice's devices, described by libtpu without a TPU, and its chip figures;
- programs.py: compile_one, and the learner step and the weight sync (its stages on several hosts; the copy
  onto the actor's devices, a transfer counted at the ICI figure);
- actor_programs.py: the continuous engine's programs, or the static sampler's generate, and evaluation's; with
  an env section, the continuation engine's (multi-turn episodes);
- compile_cache.py: what each program's compile found, kept on disk, so that no program is compiled twice;
- report.py: the step projection (rooflines: max(FLOPs / peak, bytes / HBM bandwidth) per device and loop
  body, times its trip count; collectives and host work are not counted, so a lower bound), the table, and
  the refusal of a layout that does not fit.

libtpu aborts the process on some layouts (a failed internal check), so compile_run compiles in one child
process and turns its death by a signal into a one-line CompilerCrash naming the program being compiled. The
child records each program as it starts and ends (programs.compile_one); the parent prints those as progress
lines on stderr while it waits (show_progress): the label, the time since the command started, the program's
compile time and the child's peak host memory so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import TextIO

import jax
import numpy as np
from jax.experimental.compilation_cache.compilation_cache import reset_cache as reset_compilation_cache

from grpo_jax.errors import UserError
from grpo_jax.model.transformer import DTYPES
from grpo_jax.planning import programs
from grpo_jax.planning.actor_programs import (
    continuation_programs,
    continuation_setup,
    engine_programs,
    engine_setup,
    eval_program,
    sampler_program,
)
from grpo_jax.planning.programs import learner_program, sync_parts
from grpo_jax.planning.report import Report, describe_layout, project_step
from grpo_jax.planning.topology import tpu_topology
from grpo_jax.planning.units import size_text
from grpo_jax.run.config import Config
from grpo_jax.run.plan import RunPlan, shard_bytes


class CompilerCrash(UserError):
    """libtpu's compiler killed the compiling process (a signal, e.g. SIGABRT on a failed internal check): a
    compiler bug on this layout, not a memory verdict."""

    exit_code = 5


class CompileFailure(UserError):
    """The compiling process ended on an exception while tracing, lowering or compiling a program: a bug (of
    grpo_jax's, JAX's or the compiler's) on this config or layout, reported in one line with where the whole
    output was kept."""

    exit_code = 5


PROGRESS_POLL_S = 0.5  # how often the parent looks for new progress lines while the child compiles
PROGRESS_PREFIX = "grpo-jax compile: "  # every progress line starts so (and no error line does)


def compile_run(config: Config, topology_name: str, chips_per_host: str = "", config_path: str = "", *,
                isolate: bool = True, progress: TextIO | None = None) -> Report:
    """Lay `config` out on the topology as the trainer would and compile every program of a run.

    isolate: compile in a child process (one for the whole run), so that libtpu killing it (it aborts on some
    layouts: a failed internal check, SIGABRT) becomes a CompilerCrash naming the program being compiled
    instead of the end of this process. The child sends back the report; its output is kept from the
    terminal (it is quoted when it fails). Meanwhile a line per program as it starts and as it ends goes to
    `progress` (default: sys.stderr; see show_progress)."""
    if not isolate:
        return _compile_run(config, topology_name, chips_per_host, config_path)
    progress = sys.stderr if progress is None else progress
    started = time.monotonic()
    # Described here first (libtpu describes a slice without compiling anything, which is what crashes): a bad
    # topology name is one line before any child starts, and the child's report, whose described devices do not
    # pickle, gets these.
    topology = tpu_topology(topology_name, chips_per_host)
    with tempfile.TemporaryDirectory(prefix="grpo-jax-compile-") as tmp:
        work = pathlib.Path(tmp)
        (work / "args.pkl").write_bytes(pickle.dumps((config, topology_name, chips_per_host, config_path)))
        shown = 0
        with open(work / "output", "wb") as output:
            child = subprocess.Popen([sys.executable, "-c",
                                      "from grpo_jax.planning.compile import _child_main; _child_main()", str(work)],
                                     stdin=subprocess.DEVNULL, stdout=output, stderr=output)
            try:
                code = None
                while code is None:
                    try:
                        code = child.wait(timeout=PROGRESS_POLL_S)
                    except subprocess.TimeoutExpired:
                        pass
                    shown = show_progress(read_progress(work / "progress"), shown, started, progress)
            except BaseException:  # interrupted: take the child down with us
                child.kill()
                child.wait()
                raise
        result = work / "result.pkl"
        if code == 0 and result.exists():
            kind, value = pickle.loads(result.read_bytes())
            if kind == "error":
                raise value
            return dataclasses.replace(value, topology=topology)
        events = read_progress(work / "progress")
        program = next((e.label for e in reversed(events) if e.event == "start"), "")
        peak = max((e.peak_bytes for e in events), default=0)
        text = (work / "output").read_text(errors="replace")
    if code < 0:
        raise CompilerCrash(crash_message(program, -code, text, peak))
    raise CompileFailure(failure_message(program, code, text))


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """One line of the child's progress file (programs._record_progress)."""

    event: str  # "start", "end", or "cached" (an end without a compile: compile_cache.py)
    label: str  # the program, or the loop body compiled alone for its cost
    seconds: float  # at its end: the program's compile time (cached: that of the compile it was cached from)
    peak_bytes: int  # the child's peak host memory (resident set) so far


def read_progress(path: pathlib.Path) -> list[ProgressEvent]:
    """The child's progress events so far: its complete lines (a line being written has no newline yet)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]
    events = []
    for line in lines:
        event, label, seconds, peak = line.split("\t")
        events.append(ProgressEvent(event, label, float(seconds), int(peak)))
    return events


def show_progress(events: list[ProgressEvent], shown: int, started: float, stream: TextIO) -> int:
    """Print the events past the first `shown` to `stream`, one line each, and return how many are shown now:
    e.g. `grpo-jax compile:   41.2 s  learner step: compiled in 27.8 s; host memory peak 3.41GiB` (seconds since
    the command started; the compiling process's peak resident memory so far), or `... learner step: from the
    compile cache (compiled before in 27.8 s); ...` for a program compiled before (compile_cache.py)."""
    for e in events[shown:]:
        what = {"start": "compiling", "end": f"compiled in {e.seconds:.1f} s",
                "cached": f"from the compile cache (compiled before in {e.seconds:.1f} s)"}[e.event]
        stream.write(f"{PROGRESS_PREFIX}{time.monotonic() - started:7.1f} s  {e.label}: {what}; "
                     f"host memory peak {size_text(e.peak_bytes)}iB\n")
    stream.flush()
    return len(events)


def failure_message(program: str, code: int, output: str) -> str:
    """One line: the program being compiled, the exception the compiling process ended on (its last line, cut),
    and the file its whole output is written to."""
    fd, log = tempfile.mkstemp(prefix="grpo-jax-compile-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(output)
    raised = next((line for line in reversed(output.splitlines())
                   if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line)), f"exit code {code}")
    raised = " ".join(raised.split())
    raised = raised if len(raised) <= 300 else raised[:297] + "..."
    return (f"{program or 'the first program'}: compiling it failed with {raised}; a bug on this config or layout "
            f"(of grpo_jax, JAX or the compiler), not a memory verdict: the compiling process's output is in {log}")


def crash_message(program: str, signum: int, output: str, peak_bytes: int = 0) -> str:
    """One line: the program whose compile killed the process, the signal, libtpu's failed check if it printed
    one, that this is a compiler bug (not a memory verdict), and the layouts to try instead. peak_bytes: the
    process's peak host memory as last recorded (0: unknown), quoted when it was killed."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    check = next((" ".join(line[line.find("Check failed"):].split())[:200] for line in output.splitlines()
                  if "Check failed" in line), "")
    where = program or "the first program"
    if signum == signal.SIGKILL:
        reached = f", after reaching {size_text(peak_bytes)}iB" if peak_bytes else ""
        return (f"{where}: the compiling process was killed (SIGKILL) while compiling it{reached}, most likely by "
                "the system for want of host memory (not a verdict on the TPU's memory): compile on a machine with "
                "more RAM")
    base = where.split(" (")[0]
    if base.startswith(("learner", "weight sync")):
        layouts = ("another learner layout (mesh.learner.fsdp / mesh.learner.tensor / mesh.learner.data), or "
                   "mesh.actor_devices=0 (the actor on the learner's devices, which changes the learner's mesh)")
    else:
        layouts = "another actor layout (mesh.actor.tensor, mesh.actor_devices, or mesh.actor_devices=0)"
    return (f"{where}: libtpu's compiler crashed while compiling it ({name}{': ' + check if check else ''}); a bug in "
            f"the TPU compiler on this layout, not a memory verdict: try {layouts}")


def _child_main() -> None:
    """The compiling child of compile_run: argv[1] is its work directory (args.pkl in; progress, result.pkl out)."""
    work = pathlib.Path(sys.argv[1])
    programs.PROGRESS = work / "progress"
    config, topology_name, chips_per_host, config_path = pickle.loads((work / "args.pkl").read_bytes())
    try:
        report = _compile_run(config, topology_name, chips_per_host, config_path)
        result = ("report", dataclasses.replace(report, topology=None))  # its devices do not pickle
    except UserError as e:
        result = ("error", e)
    (work / "result.pkl").write_bytes(pickle.dumps(result))


@contextlib.contextmanager
def without_jax_cache():
    """JAX's persistent compilation cache off meanwhile: it cannot load executables compiled for a described
    topology (there is no TPU client), it would only write entries and warn. JAX decides once per process whether
    it uses the cache, so turning it off takes a reset too (and one after, for the process's own compiles)."""
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_compilation_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        reset_compilation_cache()


def _compile_run(config: Config, topology_name: str, chips_per_host: str = "", config_path: str = "") -> Report:
    topology = tpu_topology(topology_name, chips_per_host)
    # Laid out as the trainer lays a run out: host 0's actor devices stand for every host's (an actor per host).
    plan = RunPlan.build(config, topology.devices, process_word="host")
    model = plan.model
    _, actor_weights = plan.actor_params()
    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(actor_weights))
    # What the other side keeps on shared devices (mesh.actor_devices=0): the actor's weights and head, and the
    # continuous or continuation engine's state.
    head_bytes = model.vocab_size * model.hidden_size * np.dtype(DTYPES[model.dtype]).itemsize
    actor_bytes = shard_bytes(actor_weights) + head_bytes // plan.actor_mesh.shape["tensor"]
    actor_what = "the actor's copy of the weights"
    setup, continuation = None, None
    if config.env is not None:  # episodes on the continuation engine, whatever sampler.engine says
        continuation = continuation_setup(plan)
        actor_bytes += continuation.state_bytes
        actor_what += " and its continuation engine's rows"
    elif config.sampler.engine == "continuous":
        setup = engine_setup(plan)
        actor_bytes += setup.state_bytes
        actor_what += " and its engine's slot state"
    with without_jax_cache():
        learner, learner_state = learner_program(plan, topology, actor_bytes, actor_what)
        if continuation is not None:
            actor = continuation_programs(plan, topology, continuation, sum(learner_state.values()))
        elif setup is not None:
            actor = engine_programs(plan, topology, setup, sum(learner_state.values()))
        else:
            actor = [sampler_program(plan, topology, sum(learner_state.values()))]
        if config.eval.every_steps:
            chunk = next((p for p in actor if p.name == "engine chunk"), None)
            actor.append(eval_program(plan, topology, sum(learner_state.values()), chunk))
        stage, transfers = sync_parts(plan, topology, learner_state, actor_bytes, actor_what)
    compiled = [learner, *actor, *stage]
    step = project_step(plan, param_count, topology, compiled, transfers)
    worst = None
    if any(p.worst_cost is not None or p.worst_calls is not None for p in compiled):
        worst = project_step(plan, param_count, topology, compiled, transfers, worst=True)
    return Report(config_path, topology, model, param_count, describe_layout(plan), tuple(compiled),
                  tuple(transfers), step, worst)
