"""The compile command's report: the step projection (roofline times, MFU), the table, and the one-line
refusal of a layout that does not fit."""

from __future__ import annotations

import dataclasses

from grpo_jax.algorithm.lengths import ExpectedLengths
from grpo_jax.errors import UserError
from grpo_jax.model.transformer import ModelConfig
from grpo_jax.planning.programs import Program, Transfer, refusal_excess
from grpo_jax.planning.topology import Topology
from grpo_jax.planning.units import count_text, size_text, time_text
from grpo_jax.run.config import Config
from grpo_jax.run.plan import RunPlan


class DoesNotFit(UserError):
    """A program needs more memory per device than the chip has (or the compiler refused it)."""

    exit_code = 4


@dataclasses.dataclass(frozen=True)
class StepProjection:
    learner_seconds: float  # learner step + weight sync (the learner thread waits for both)
    actor_seconds: float  # sampling one step's groups (every host at once)
    overlapped: bool  # actor and learner on disjoint devices with max_staleness >= 1
    seconds: float
    tokens: int  # prompt + completion tokens per step (padded buckets: every completion at max_new_tokens)
    model_flops: float  # per step, all chips: 6N per trained token, 2N per forward token, attention included; the
    # learner's at the expected sequence lengths (optim.expected_*_len): real tokens only
    mfu: float


@dataclasses.dataclass(frozen=True)
class Report:
    config_path: str
    topology: Topology
    model: ModelConfig
    param_count: int
    layout: str
    programs: tuple[Program, ...]
    transfers: tuple[Transfer, ...]
    step: StepProjection | None  # None when a program does not fit
    # Every completion at max_new_tokens, where the expected lengths (optim.expected_*_len) make `step` differ.
    worst_step: StepProjection | None = None

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)


def model_flops_per_step(config: Config, model: ModelConfig, param_count: int,
                         lengths: ExpectedLengths | None = None) -> float:
    """Useful FLOPs of one GRPO step, all hosts: 2 per weight per token forward (6 with the backward), plus
    attention (4 x heads x head_dim per token per key attended, in each layer; a sliding-window layer attends at
    most its window). The learner's over real tokens only: sequences of `lengths` (RunPlan.expected_lengths,
    averaged per sequence over its completions, since attention grows faster than the length; None: every
    sequence at the bucket lengths, the worst case), whatever the layout computes around them (padding, or
    packed rows' masked attention); the sampler's at the bucket lengths, or at `lengths` where the continuous
    engine projects them. Remat's recomputation and replicated work are not useful FLOPs. With LoRA the base's
    weights get no gradient: 4 per weight per trained token (forward and input gradient); the adapters' few
    FLOPs are not counted."""
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    prompt = min(config.data.max_prompt_len, config.sampler.max_prompt_len)
    new = config.sampler.max_new_tokens
    optim = config.optim
    buckets = ExpectedLengths.at_buckets(prompt, new)
    lengths = buckets if lengths is None else lengths.clipped(prompt, new)
    head = model.hidden_size * model.vocab_size
    # The embedding lookup does no matmul; a token goes through its experts only (active parameters).
    body = param_count - head * (1 if model.tie_embeddings else 2) - model.inactive_expert_params
    attention = 4 * model.num_heads * model.resolved_head_dim  # per layer, per token, per key

    def forward(tokens: int, scored: int, keys: float) -> float:
        return 2 * body * tokens + attention * tokens * model.keys_over_layers(keys) + 2 * head * scored

    def learner_row(p: int, c: int) -> float:
        length = p + c - 1
        return forward(length, c, length / 2)

    def frozen_gradients(p: int, c: int) -> float:  # what LoRA's frozen base does not compute
        return 2 * body * (p + c - 1) + 2 * head * c

    def sampled(p: int, c: int) -> float:
        return forward(p, 1, p / 2) + (c - 1) * forward(1, 1, p + c / 2)

    extra_forwards = (optim.updates_per_step > 1) + config.loss.needs_reference
    learner = rows * lengths.mean_of(learner_row) * (3 * optim.epochs + extra_forwards)
    if config.lora.enabled:
        learner -= rows * optim.epochs * lengths.mean_of(frozen_gradients)
    engine_projects = config.sampler.engine == "continuous" and config.env is None
    sampler = rows * (lengths if engine_projects else buckets).mean_of(sampled)
    return learner + sampler


def project_step(plan: RunPlan, param_count: int, topology: Topology, programs: list[Program],
                 transfers: list[Transfer], worst: bool = False) -> StepProjection | None:
    """The step time the chips could not beat on this layout, from the programs' rooflines, and its MFU, at the
    expected lengths (optim.expected_*_len), or with worst: every completion at max_new_tokens (the programs'
    worst_cost / worst_calls); None when a program has no time estimate."""
    config = plan.config
    if any(p.cost is None for p in programs):
        return None

    def cost(p: Program):
        return (p.worst_cost or p.cost) if worst else p.cost

    def calls(p: Program) -> int:
        return p.worst_calls if worst and p.worst_calls is not None else p.calls_per_step

    learner = next(p for p in programs if p.name == "learner step")
    stages = sum(p.cost.seconds for p in programs if p.name == "weight sync stage")
    learner_seconds = cost(learner).seconds + stages + sum(t.seconds for t in transfers)
    actor_seconds = sum(cost(p).seconds * calls(p) for p in programs if p.actor)
    overlapped = not plan.shared and config.grpo.max_staleness > 0
    seconds = max(learner_seconds, actor_seconds) if overlapped else learner_seconds + actor_seconds
    tokens = plan.rows * (plan.prompt_bucket + plan.completion_bucket)
    flops = model_flops_per_step(config, plan.model, param_count, None if worst else plan.expected_lengths)
    mfu = flops / (seconds * len(topology.devices) * topology.peak_flops)
    return StepProjection(learner_seconds, actor_seconds, overlapped, seconds, tokens, flops, mfu)


def describe_layout(plan: RunPlan) -> str:
    def axes(mesh) -> str:
        return ", ".join(f"{name} {size}" for name, size in mesh.shape.items())

    if plan.actor_spans_hosts:
        actor = (f"actor (one across all {plan.processes} hosts, every host's prompts): {plan.actor_mesh.size} "
                 f"device(s), {plan.actor_devices_per_host} per host")
    else:
        actor = "actor (every host): " + ("the learner's devices" if plan.shared else
                                          f"{plan.actor_mesh.size} device(s)")
    return (f"{actor}, {{{axes(plan.actor_mesh)}}}; learner: {plan.learner_mesh.size} "
            f"device(s) over {plan.processes} host(s), {{{axes(plan.learner_mesh)}}}")


def format_report(report: Report) -> str:
    t, m = report.topology, report.model
    width = max([20, *(len(p.name) + 2 for p in report.programs)])  # the program column: 20, or the longest name
    hosts = f"{t.processes} host{'s' if t.processes > 1 else ''}"
    lines = [
        f"{report.config_path or 'config'} on {t.name}: {len(t.devices)} {t.chip.name} devices, {hosts}; per device "
        f"{size_text(t.hbm_bytes)}iB HBM, {t.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{t.hbm_bandwidth / 1e9:.0f} GB/s HBM, {t.ici_bandwidth / 1e9:.0f} GB/s ICI in",
        f"model: {m.architecture}, {count_text(report.param_count)} parameters, {m.num_layers} layers, weights "
        f"{m.param_dtype}, compute {m.dtype}, remat {str(m.remat).lower()}",
        report.layout,
        "",
        "per device (bytes in K/M/G/T of 2^10/2^20/2^30/2^40): memory (args + out - alias + temp + code + held = "
        "total), FLOPs and HBM bytes per call",
        f"{'program':<{width}}{'devices':>8}{'args':>7}{'out':>7}{'alias':>7}{'temp':>7}{'code':>7}{'held':>7}"
        f"{'total':>7}{'HBM':>7}{'fits':>6}{'FLOPs':>8}{'bytes':>8}{'roofline':>11}{'calls':>6}{'compile':>9}",
    ]
    for p in report.programs:
        mem, cost = p.memory, p.cost
        fits = "no" if p.total is None or p.total > t.hbm_bytes else "yes"
        lines.append(
            f"{p.name:<{width}}{p.devices:>8}{size_text(mem and mem.arguments):>7}{size_text(mem and mem.outputs):>7}"
            f"{size_text(mem and mem.aliased):>7}{size_text(mem and mem.temporaries):>7}"
            f"{size_text(mem and mem.code):>7}{size_text(p.held):>7}{size_text(p.total):>7}{size_text(t.hbm_bytes):>7}"
            f"{fits:>6}{count_text(cost and cost.flops):>8}{size_text(cost and cost.bytes):>8}"
            f"{time_text(cost and cost.seconds):>11}{p.calls_per_step:>6}{p.compile_seconds:>8.1f}s")
    for p in report.programs:
        if p.held:
            lines.append(f"  {p.name}: held = {p.held_what}")
        if p.refusal:
            lines.append(f"  {p.name}: refused by the compiler: {p.refusal}")
        if p.cost_note:
            lines.append(f"  {p.name}: no time estimate: {p.cost_note}")
        for note in p.notes:
            lines.append(f"  {p.name}: {note}")
        if p.breakdown is not None:
            lines += where_the_bytes_go(p, t)
    for x in report.transfers:
        lines.append(f"{x.name}: {size_text(x.bytes_per_device)}iB into each actor device, "
                     f"{time_text(x.seconds)} ({x.how}; a transfer, not a compiled program)")
    s = report.step
    lines.append("")
    if s is None:
        lines.append("projected step: none (a program does not fit, or has no time estimate)")
    else:
        mode = "overlapped: disjoint devices, max_staleness >= 1" if s.overlapped else "one after the other"
        lines.append(f"projected step: {time_text(s.seconds)} (learner + weight sync {time_text(s.learner_seconds)}, "
                     f"actor {time_text(s.actor_seconds)}; {mode}); {s.tokens / s.seconds:,.0f} tokens/s "
                     f"({s.tokens:,} prompt + completion tokens per step at the bucket lengths); "
                     f"MFU {100 * s.mfu:.1f}% ({count_text(s.model_flops)} model FLOPs per step)")
        w = report.worst_step
        if w is not None:
            lines[-1] = lines[-1].replace("projected step:", "projected step at the expected lengths:", 1)
            lines.append(f"projected step, every completion at max_new_tokens: {time_text(w.seconds)} (learner + "
                         f"weight sync {time_text(w.learner_seconds)}, actor {time_text(w.actor_seconds)}); "
                         f"MFU {100 * w.mfu:.1f}% ({count_text(w.model_flops)} model FLOPs per step)")
    lines.append("roofline = max(FLOPs / peak, bytes / HBM bandwidth) per loop body, times its trip count (decode: "
                 "every row to max_new_tokens; the learner step: over the whole step, its loops counted); "
                 "collectives and host work are not counted: a lower bound")
    return "\n".join(lines)


def where_the_bytes_go(program: Program, topology: Topology, parts: int = 8) -> list[str]:
    """The program's FLOPs-bound and bytes-bound times, and its largest parts by bytes (named scope of the model
    code, and the kind of instruction: hlo_cost.Breakdown)."""
    b = program.breakdown
    lines = [f"  {program.name}: FLOPs-bound {time_text(b.flops / topology.peak_flops)} "
             f"({count_text(b.flops)}FLOP at peak), bytes-bound {time_text(b.bytes / topology.hbm_bandwidth)} "
             f"({size_text(b.bytes)}iB at HBM bandwidth) per device; where the bytes go (named scope, kind):"]
    shown = 0.0
    for (scope, kind), part in b.largest(parts):
        shown += part.bytes
        lines.append(f"    {scope + ', ' + kind:<32}{size_text(part.bytes):>8}iB {100 * part.bytes / b.bytes:5.1f}%"
                     f"{count_text(part.flops):>9}FLOP")
    if b.bytes - shown > 0:
        lines.append(f"    {'the rest':<32}{size_text(b.bytes - shown):>8}iB {100 * (b.bytes - shown) / b.bytes:5.1f}%")
    return lines


def check_fits(report: Report) -> None:
    """DoesNotFit, one line: each program that does not fit, by how much, and the settings that would help."""
    t = report.topology
    problems = []
    for p in report.programs:
        if p.memory is None:
            excess = refusal_excess(p.refusal)
            problems.append(f"{p.name} refused by the compiler{', ' + excess if excess else ''} ({p.refusal}); "
                            "try " + ", ".join(p.hints))
        elif p.total > t.hbm_bytes:
            problems.append(f"{p.name} needs {size_text(p.total)}iB per device, "
                            f"{size_text(p.total - t.hbm_bytes)}iB over the {size_text(t.hbm_bytes)}iB of a "
                            f"{t.chip.name} device; try " + ", ".join(p.hints))
    if problems:
        raise DoesNotFit(f"does not fit on {t.name}: " + "; ".join(problems))
