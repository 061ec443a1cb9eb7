"""Groups -> learner batch -> which groups trained: the group -> batch hand-off, host side (NumPy, no device).

    sequences_of(groups, layout)        -> Sequences: this process's learner sequences, computed once per step
    rows_needed(sequences, layout)      -> the rows it needs (what the processes agree on: the most any needs)
    assemble(sequences, layout, rows)   -> TrainBatch, padded (pack_batch) or packed (pack_sequences)
    groups_trained(sequences, layout, applied) -> per group, whether any update over its sequences was applied

BatchLayout (RunPlan.batch_layout) is everything about the run these need: the group size, mini-batches, buckets,
packing, and this process's first sequence number in the step.

The mini-batch rule (mini_batch_of_row) is applied here only: a step's sequence (a segment: its trajectory) numbered
first_sequence + t trains in mini-batch (first_sequence + t) % M in either layout; pack_layout places sequences by
it, and groups_trained maps the learner's applied updates (update u trains mini-batch u % M) back to groups by it.

Rows whose reward failed (pack_batch's `valid`) have loss_mask 0, exactly like padding rows: they add nothing to the
policy loss, the KL, any aggregation denominator or any metric. Completion masks (multi-turn environments): one 0/1
array per completion (1 = sampled), so an environment token is context only. Two layouts of the same sequences
train alike (learner.TrainBatch); the packed one keeps each sequence in its padded row's mini-batch and leaves out
a sequence with no trained token (tests/test_packing.py). The number of packed rows varies with the lengths:
RunPlan.packed_rows rounds it up to one of a few sizes (packed_row_sizes) so that a run compiles a few programs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax.algorithm.learner import TrainBatch
from grpo_jax.errors import TrainerError
from grpo_jax.state.replay_buffer import Group


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How this process lays out a step's groups as learner rows (RunPlan.batch_layout)."""

    group_size: int
    mini_batches: int  # optim.mini_batches
    step_sequences: int  # this process's sequences in a full step of ordinary groups: its prompts x group_size
    first_sequence: int  # the step's number of this process's first sequence: its process index x step_sequences
    prompt_len: int  # the padded layout's prompt bucket
    completion_len: int  # the completion bucket: the trained tokens a row holds
    packing: bool  # optim.packing
    trains_segments: bool  # the batch says which sequences are one trajectory (TrainBatch.trajectories)
    replays_routing: bool  # model.routing_replay with experts: the groups' routing goes into the batch
    pad_id: int

    @property
    def row_length(self) -> int:
        return self.prompt_len + self.completion_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sequences:
    """This process's learner sequences of one step: its groups' (group_sequences' rows, group after group), then
    empty ones up to a whole step (the last step of a finite dataset). Per sequence, n of them."""

    prompts: list  # [prompt length] int32 each (an ordinary group's rows share its prompt array)
    completions: list  # [completion length] int32 each
    behaviour_logprobs: list  # [completion length] float32 each
    advantages: np.ndarray  # [n] float32 (a segment's: its trajectory's)
    valid: np.ndarray  # [n] bool: its reward was scored (False: padding, or a failed sample; trains nothing)
    completion_masks: list | None  # [completion length] float32 0/1 each, when a group is a segment group
    routing: list | None  # [tokens, layers, top_k] int32 each, with routing replay
    trajectories: np.ndarray  # [n] int64: trajectory_numbers, this process's trajectory of each sequence
    per_group: tuple  # how many of the sequences each group has, in order
    prompt_lengths: np.ndarray  # [n] int64 (sequence_lengths)
    completion_lengths: np.ndarray  # [n] int64, 0 for an invalid one
    trained_lengths: np.ndarray  # [n] int64: trained completion tokens
    packed: PackedLayout | None  # pack_layout's placement, with packing

    @property
    def trained_tokens(self) -> int:
        """The tokens (prompt and completion) of the sequences that train something."""
        return int((self.prompt_lengths + self.completion_lengths)[self.trained_lengths > 0].sum())


def sequences_of(groups: list[Group], layout: BatchLayout) -> Sequences:
    """A step's groups as this process's learner sequences (the module docstring). TrainerError, one line, for
    segment groups without packing (their sequences vary in number and length beyond the padded layout's) and for
    routing replay without routing."""
    g = layout.group_size
    per_group = [group_sequences(group, g) for group in groups]  # once per group: every step below reads them
    prompts, completions, logprobs, advantages, masks = group_rows(groups, g, per_group)
    if masks is not None and not layout.packing:
        raise TrainerError("multi-turn environment groups (segments with environment tokens) train only in "
                           "packed rows: set optim.packing=true")
    missing = layout.step_sequences - len(prompts)
    if missing > 0:  # the last step of a finite dataset: pad with sequences that train nothing
        prompts += [prompts[0] if prompts else np.full(1, layout.pad_id, np.int32)] * missing
        completions += [np.zeros(0, np.int32)] * missing
        logprobs += [np.zeros(0, np.float32)] * missing
        advantages = np.concatenate([advantages, np.zeros(missing, np.float32)])
        if masks is not None:
            masks += [np.zeros(0, np.float32)] * missing
    valid = row_validity(groups, g, len(prompts), per_group)
    routing = group_routing(groups, g, len(prompts), per_group) if layout.replays_routing else None
    if layout.replays_routing and routing is None:
        raise TrainerError("routing replay: the groups of this step carry no routing (the actor records it "
                           "only with sampler.engine=continuous); set model.routing_replay=false")
    samples = [group_samples for _, group_samples in per_group]
    trajectories = trajectory_numbers(samples, len(prompts))
    prompt_lengths, completion_lengths, trained_lengths = sequence_lengths(prompts, completions, valid, masks)
    packed = None
    if layout.packing:
        packed = pack_layout(prompt_lengths, completion_lengths, layout.row_length, layout.completion_len,
                             layout.mini_batches, first_sequence=layout.first_sequence,
                             trained_lengths=trained_lengths, trajectories=trajectories)
    return Sequences(prompts=prompts, completions=completions, behaviour_logprobs=logprobs, advantages=advantages,
                     valid=valid, completion_masks=masks, routing=routing, trajectories=trajectories,
                     per_group=tuple(len(s) for s in samples), prompt_lengths=prompt_lengths,
                     completion_lengths=completion_lengths, trained_lengths=trained_lengths, packed=packed)


def rows_needed(sequences: Sequences, layout: BatchLayout) -> int:
    """The learner rows this process's sequences need: packed, pack_layout's count (every process then feeds the
    most any needs, rounded up to one of RunPlan.packed_row_sizes); padded, a whole step's, one per sequence."""
    return sequences.packed.rows if layout.packing else layout.step_sequences


def assemble(sequences: Sequences, layout: BatchLayout, rows: int) -> TrainBatch:
    """This process's part of the step's learner batch (NumPy) in `rows` rows: packed (pack_sequences, with the
    trajectories when the run trains segments) or one sequence per row (pack_batch, rows = step_sequences)."""
    if layout.packing:
        return pack_sequences(sequences.prompts, sequences.completions, sequences.behaviour_logprobs,
                              sequences.advantages, layout.pad_id, layout.row_length, layout.completion_len,
                              layout.mini_batches, first_sequence=layout.first_sequence, layout=sequences.packed,
                              rows=rows, routing=sequences.routing, completion_masks=sequences.completion_masks,
                              trajectories=sequences.trajectories if layout.trains_segments else None)
    if rows != len(sequences.prompts):
        raise ValueError(f"{rows} rows for {len(sequences.prompts)} sequences: the padded layout has one per row")
    return pack_batch(sequences.prompts, sequences.completions, sequences.behaviour_logprobs, sequences.advantages,
                      layout.pad_id, layout.prompt_len, layout.completion_len, valid=sequences.valid,
                      routing=sequences.routing, completion_masks=sequences.completion_masks)


def padding_metrics(sequences: Sequences, layout: BatchLayout, rows: int) -> dict:
    """learner/padding_fraction: the share of the token slots one sequence per row would use that hold no token of a
    trained sequence (padding, rows that train nothing); learner/padding_fraction_packed: the same for the `rows`
    the learner gets (equal without packing); learner/rows: their number (this process's)."""
    one_per_row = max(layout.step_sequences, len(sequences.prompts))  # a step's worth, or more with segments
    return {"learner/padding_fraction": padding_fraction(sequences.trained_tokens, one_per_row, layout.row_length),
            "learner/padding_fraction_packed": padding_fraction(sequences.trained_tokens, rows, layout.row_length),
            "learner/rows": rows}


def groups_trained(sequences: Sequences, layout: BatchLayout, applied: np.ndarray) -> list[bool]:
    """Per group of the step (sequences_of's order): whether at least one update over its sequences was applied.
    applied: [updates] bool, the learner's; update u trains mini-batch u % mini_batches, and sequence i is in
    mini-batch mini_batch_of_row(first_sequence + trajectories[i])."""
    applied_minis = {u % layout.mini_batches for u in np.flatnonzero(applied)}
    trained, start = [], 0
    for count in sequences.per_group:
        numbers = layout.first_sequence + sequences.trajectories[start:start + count]
        trained.append(any(int(m) in applied_minis for m in mini_batch_of_row(numbers, layout.mini_batches)))
        start += count
    return trained


def group_sequences(group: Group, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, samples): which of the group's rows are learner sequences, in order, and the sample (completion, or
    trajectory of a segment group) each belongs to, for its advantage and validity. An ordinary group: its first
    group_size completions, each its own sample. A segment group (Group.segments): every
    segment of its first group_size trajectories. ValueError, naming the group and key, for a segment group
    whose per-segment lists disagree in length."""
    if not group.segmented:
        rows = np.arange(min(group_size, len(group.completions)))
        return rows, rows
    trajectory = np.asarray(group.segments.trajectory, np.int64).reshape(-1)
    per_segment = {"completions": len(group.completions), "behaviour_logprobs": len(group.behaviour_logprobs),
                   "segments.prompts": len(group.segments.prompts), "segments.masks": len(group.segments.masks)}
    for key, n in per_segment.items():
        if n != len(trajectory):
            raise ValueError(f"group of ordinal {group.ordinal}: {key} has {n} entries, segments.trajectory "
                             f"{len(trajectory)} segments; the actor must give one per segment")
    if (trajectory < 0).any():
        raise ValueError(f"group of ordinal {group.ordinal}: segments.trajectory holds a negative "
                         f"trajectory index ({trajectory.min()}); each must be in 0 .. G - 1")
    rows = np.flatnonzero(trajectory < group_size)
    return rows, trajectory[rows]


def group_rows(groups: list[Group], group_size: int, per_group: list | None = None):
    """Flatten groups into learner sequences (group_sequences' rows, group after group): prompts, completions,
    behaviour log-probs (lists of arrays, one per sequence; an ordinary group's prompt array is shared by its
    rows), advantages [sequences] (a segment's is its trajectory's), and completion masks: None when no group is
    a segment group, else one float32 0/1 array per sequence (a segment's mask, Group.segments; all ones for
    an ordinary group's completion), for pack_batch / pack_sequences. No per-token Python. per_group: each group's
    group_sequences, when the caller has them (sequences_of: once per group and step)."""
    per_group = per_group or [group_sequences(group, group_size) for group in groups]
    prompts, completions, logprobs, advantages = [], [], [], []
    masks = [] if any(group.segmented for group in groups) else None
    for group, (rows, samples) in zip(groups, per_group):
        if group.segmented:
            prompts += [np.asarray(group.segments.prompts[i], np.int32) for i in rows]
            masks += [np.asarray(group.segments.masks[i], np.float32) for i in rows]
        else:
            prompts += [np.asarray(group.prompt["prompt_ids"], np.int32)] * len(rows)
            if masks is not None:
                masks += [np.ones(len(group.completions[i]), np.float32) for i in rows]
        completions += [np.asarray(group.completions[i], np.int32) for i in rows]
        logprobs += [np.asarray(group.behaviour_logprobs[i], np.float32) for i in rows]
        advantages.append(np.asarray(group.advantages, np.float32)[samples])
    advantages = np.concatenate(advantages) if groups else np.zeros(0, np.float32)
    return prompts, completions, logprobs, advantages, masks


def group_routing(groups: list[Group], group_size: int, rows: int, per_group: list | None = None) -> list | None:
    """Per row, in group_rows' order, the experts its input tokens went through when sampled (the group's
    Group.routing, one per row of the group); rows past the groups' (padding) route nowhere they are read.
    None without routing. per_group: as group_rows'."""
    if not groups or groups[0].routing is None:
        return None
    per_group = per_group or [group_sequences(group, group_size) for group in groups]
    out = [np.asarray(group.routing[i], np.int32) for group, (rows_of_group, _) in zip(groups, per_group)
           for i in rows_of_group]
    return out + [np.zeros((0, *out[0].shape[1:]), np.int32)] * (rows - len(out))


def row_validity(groups: list[Group], group_size: int, rows: int, per_group: list | None = None) -> np.ndarray:
    """[rows] bool, in group_rows' order: whether each row's reward was scored (its sample's Group.valid: a
    segment takes its trajectory's; all when the group has none). Rows past the groups' (padding) are False. A
    failed row must train nothing, like padding (pack_batch's `valid`): its advantage is 0, but left in the batch
    it would still count in every loss denominator and get the KL gradient. per_group: as group_rows'."""
    per_group = per_group or [group_sequences(group, group_size) for group in groups]
    out = np.zeros(rows, bool)
    start = 0
    for group, (_, samples) in zip(groups, per_group):
        out[start:start + len(samples)] = True if group.valid is None else np.asarray(group.valid, bool)[samples]
        start += len(samples)
    return out


def mini_batch_of_row(row, mini_batches: int):
    """The mini-batch that holds a batch row (learner.split_rows: rows m, m + M, ... are mini-batch m), and so the
    mini-batch of the step's trajectory number `row` in either layout (pack_layout keeps each sequence in the
    mini-batch of its trajectory's padded row). An int or an int array. The one place of the rule: pack_layout
    places sequences by it, groups_trained reads the learner's applied updates by it."""
    return row % mini_batches


def place_rows(rows: list[np.ndarray], width: int, align_right: bool, dtype, fill=0) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows laid into a [len(rows), width] array, each at its start (or end, align_right), and the
    mask of the cells they fill: one boolean-mask assignment, no per-token Python (row-major order of the
    mask's cells is each row's own order). A row longer than `width` raises ValueError naming it."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    if (lengths > width).any():
        row = int(np.argmax(lengths > width))
        raise ValueError(f"row {row}: {lengths[row]} tokens exceed the bucket of {width}")
    mask = np.arange(width) < lengths[:, None]
    if align_right:
        mask = mask[:, ::-1]
    out = np.full((len(rows), width), fill, dtype)
    if lengths.sum():
        out[mask] = np.concatenate([np.asarray(r, dtype).reshape(-1) for r in rows])
    return out, mask


def pack_batch(prompts: list, completions: list, behaviour_logprobs: list, advantages: np.ndarray, pad_id: int,
               prompt_len: int, completion_len: int, valid: np.ndarray | None = None,
               routing: list | None = None, completion_masks: list | None = None,
               trajectories: np.ndarray | None = None) -> TrainBatch:
    """Lay out prompt (left-padded to prompt_len) + completion (right-padded) rows for the learner. Rows are
    sequences of token ids (arrays or lists); behaviour log-probs are cut to their completion's length.
    valid [rows] bool (None: all): False marks a row whose reward failed; it gets loss_mask 0, so it trains
    nothing and counts in no denominator or metric, exactly like a padding row. routing: per row, the experts
    of its input tokens ([prompt + completion - 1, layers, k], GroupResult.routing), or None.
    completion_masks: per row a 0/1 array of its completion's length (1: a sampled token, trained; 0: an
    environment token, context only), or None (every completion token trained). trajectories: per row, the
    trajectory it is a segment of (TrainBatch.trajectories; the caller keeps a trajectory's rows in one mini-batch:
    rows r of one r % mini_batches), or None. Returns NumPy arrays."""
    try:
        prompt_ids, prompt_mask = place_rows(prompts, prompt_len, True, np.int32, pad_id)
        completion_ids, completion_mask = place_rows(completions, completion_len, False, np.int32, pad_id)
    except ValueError as e:
        raise ValueError(f"{e} (prompt / completion buckets {prompt_len} / {completion_len})") from None
    logprobs = [np.asarray(lp, np.float32)[:len(c)] for lp, c in zip(behaviour_logprobs, completions)]
    behaviour_scored, _ = place_rows(logprobs, completion_len, False, np.float32)
    size, length = len(prompts), prompt_len + completion_len
    # Position t scores token t+1: the completion's tokens sit at prompt_len .. prompt_len+n-1, so the scored
    # positions prompt_len-1 .. are the last completion_len of the L - 1.
    loss_mask = np.zeros((size, length - 1), np.float32)
    behaviour = np.zeros((size, length - 1), np.float32)
    loss_mask[:, prompt_len - 1:] = completion_mask
    if completion_masks is not None:
        trained, _ = place_rows(checked_masks(completion_masks, completions), completion_len, False, np.float32)
        loss_mask[:, prompt_len - 1:] *= trained
        behaviour_scored = np.where(trained > 0, behaviour_scored, 0.0)  # never read there: kept 0 like padding
    if valid is not None:
        valid = np.asarray(valid, bool)
        if valid.shape != (size,):
            raise ValueError(f"valid has shape {valid.shape}, expected ({size},): one flag per row")
        loss_mask[~valid] = 0.0
    behaviour[:, prompt_len - 1:] = behaviour_scored
    starts = prompt_len - np.fromiter((len(p) for p in prompts), np.int64, size)
    # Host arrays: the caller places them (the trainer commits them to the learner's batch sharding).
    if trajectories is not None:
        trajectories = np.asarray(trajectories, np.int32)
        if trajectories.shape != (size,):
            raise ValueError(f"trajectories has shape {trajectories.shape}, expected ({size},): one per row")
    return TrainBatch(tokens=np.concatenate([prompt_ids, completion_ids], axis=1),
                      input_mask=np.concatenate([prompt_mask, completion_mask], axis=1),
                      loss_mask=loss_mask, advantages=np.asarray(advantages, np.float32),
                      behaviour_logprobs=behaviour, completion_len=completion_len,
                      routing=None if routing is None else place_routing(routing, starts, length - 1),
                      trajectories=trajectories)


def checked_masks(completion_masks: list, completions: list) -> list[np.ndarray]:
    """completion_masks as float32 arrays, after checking that each is 0/1 and as long as its completion
    (ValueError naming the sequence otherwise)."""
    if len(completion_masks) != len(completions):
        raise ValueError(f"completion_masks: {len(completion_masks)} masks for {len(completions)} completions; "
                         "give one per completion (or None to train every token)")
    out = []
    for i, (mask, completion) in enumerate(zip(completion_masks, completions)):
        mask = np.asarray(mask, np.float32).reshape(-1)
        if len(mask) != len(completion):
            raise ValueError(f"completion_masks[{i}]: {len(mask)} values for a completion of {len(completion)} tokens; "
                             "one per completion token")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"completion_masks[{i}]: values {sorted(set(mask.tolist()) - {0.0, 1.0})}; only 0 "
                             "(environment token) and 1 (sampled token) are allowed")
        out.append(mask)
    return out


def place_routing(routing: list, starts: np.ndarray, positions: int) -> np.ndarray:
    """[rows, positions, layers, k] int32: row i's routing (its input tokens' experts) from position starts[i] on,
    where its first token is; 0 (any expert: no trained token reads it) elsewhere."""
    out = np.zeros((len(routing), positions, *routing_shape(routing)), np.int32)
    for i, (r, start) in enumerate(zip(routing, starts)):
        r = np.asarray(r, np.int32)[:positions - start]
        out[i, start:start + len(r)] = r
    return out


def routing_shape(routing: list) -> tuple[int, int]:
    """(layers with experts, experts per token) of a batch's per-row routing arrays [tokens, layers, k]."""
    shapes = {np.shape(r)[1:] for r in routing}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"routing: rows of shapes {sorted(shapes)}; expected [tokens, layers, experts per token]")
    return next(iter(shapes))


# ------------------------------------------------------------------ packed rows


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where pack_layout put each sequence of a step (NumPy [n] arrays, in the padded layout's row order)."""

    row: np.ndarray  # its packed row (-1: left out, it has no trained token)
    offset: np.ndarray  # the index of its first (prompt) token in that row
    slot: np.ndarray  # its place among the row's sequences (0, 1, ... by offset): its segment label is slot + 1
    rows: int  # rows it needs: mini_batches x the most rows one mini-batch needs


def pack_layout(prompt_lengths, completion_lengths, row_length: int, scored_length: int, mini_batches: int = 1,
                first_sequence: int = 0, trained_lengths=None, trajectories=None) -> PackedLayout:
    """First-fit decreasing of a step's sequences (prompt + completion) into rows of `row_length` tokens of
    which at most `scored_length` are trained (scored) completion tokens. trained_lengths: [n] the trained tokens
    of each completion (at most its length: fewer with completion masks, whose environment tokens take room in
    the row but not in the scored budget); None: every completion token (completion_lengths).

    Mini-batches stay strided by trajectory: sequence i is a segment of this process's trajectory t = trajectories[i]
    (in [0, n); None: t = i, each sequence its own), the step's trajectory first_sequence + t (this process's first
    one is process x its sequences), and trains in mini-batch (first_sequence + t) % M, with every other segment of
    its trajectory (GSPO's ratio and the sequence means need them in one update), as its row would in the padded
    layout (split_rows). Each mini-batch's sequences are packed into rows of their own, and the
    j-th row of mini-batch m is row j x M + m: with a row count that is a multiple of M (every bucket is),
    split_rows hands mini-batch m exactly its sequences. A sequence with no trained token (completion length 0:
    empty, its reward failed, or every token masked) trains nothing and is left out. Longest first (all its
    tokens), each into the first row where it fits, else a new row."""
    prompt = np.asarray(prompt_lengths, np.int64)
    completion = np.asarray(completion_lengths, np.int64)
    trained = completion if trained_lengths is None else np.asarray(trained_lengths, np.int64)
    if trained.shape != completion.shape or (trained > completion).any():
        raise ValueError(f"trained_lengths {trained.tolist()}: one per sequence, each at most its completion's "
                         f"length {completion.tolist()}")
    total = prompt + completion
    too_long = np.flatnonzero((trained > 0) & ((total > row_length) | (trained > scored_length)))
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(f"sequence {i}: {prompt[i]} + {completion[i]} tokens exceed a packed row of {row_length} "
                         f"tokens, {scored_length} of them trained (it trains {trained[i]})")
    unscorable = np.flatnonzero((prompt == 0) & (trained > 0))
    if len(unscorable):  # its first completion token would have no position before it to be scored from
        raise ValueError(f"sequence {int(unscorable[0])}: a completion without a prompt token")
    n = len(total)
    row, offset, slot = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    mini_of = mini_batch_of_row(first_sequence + checked_trajectories(trajectories, n), mini_batches)
    most = 0
    for m in range(mini_batches):
        members = np.flatnonzero((trained > 0) & (mini_of == m))
        order = members[np.argsort(-total[members], kind="stable")]
        free = np.zeros(len(order), np.int64)  # tokens left in each open row
        free_scored = np.zeros(len(order), np.int64)
        held = np.zeros(len(order), np.int64)  # sequences in each open row
        opened = 0
        for i in order:
            fits = (free[:opened] >= total[i]) & (free_scored[:opened] >= trained[i])
            j = int(np.argmax(fits)) if opened and fits.any() else opened
            if j == opened:
                free[j], free_scored[j], opened = row_length, scored_length, opened + 1
            row[i], offset[i], slot[i] = j * mini_batches + m, row_length - free[j], held[j]
            free[j] -= total[i]
            free_scored[j] -= trained[i]
            held[j] += 1
        most = max(most, opened)
    return PackedLayout(row, offset, slot, most * mini_batches)


def pack_sequences(prompts: list, completions: list, behaviour_logprobs: list, advantages: np.ndarray, pad_id: int,
                   row_length: int, scored_length: int, mini_batches: int = 1, valid: np.ndarray | None = None,
                   first_sequence: int = 0, layout: PackedLayout | None = None, rows: int | None = None,
                   routing: list | None = None, completion_masks: list | None = None,
                   trajectories: np.ndarray | None = None) -> TrainBatch:
    """Packed rows (TrainBatch's second layout) of the sequences pack_batch would lay out one per row, with the
    same arguments (prompt and completion rows, behaviour log-probs cut to their completion, advantages [n],
    valid [n], completion_masks). Positions, attention and the losses' per-sequence reductions follow each
    sequence, so the learner trains this batch as it trains pack_batch's. layout: pack_layout's (computed here
    when None, from sequence_lengths: a failed row trains nothing, a masked token takes room in its row but not
    in the scored budget); a given layout must come from the same lengths and trajectories; rows: how many rows
    (>= layout.rows, a multiple of mini_batches; None: layout.rows), the extra ones padding. trajectories: [n] each
    sequence's trajectory in this process (pack_layout's; None: each its own): the batch's trajectories are the
    step's numbers, first_sequence + t, per slot (-1 in an empty one). Returns NumPy arrays."""
    n = len(prompts)
    if valid is not None:
        valid = np.asarray(valid, bool)
        if valid.shape != (n,):
            raise ValueError(f"valid has shape {valid.shape}, expected ({n},): one flag per row")
    masks = None if completion_masks is None else checked_masks(completion_masks, completions)
    if layout is None:
        prompt_lengths, completion_lengths, trained_lengths = sequence_lengths(prompts, completions, valid, masks)
        layout = pack_layout(prompt_lengths, completion_lengths, row_length, scored_length, mini_batches,
                             first_sequence, trained_lengths=trained_lengths, trajectories=trajectories)
    rows = layout.rows if rows is None else rows
    if rows < layout.rows or rows % mini_batches:
        raise ValueError(f"{rows} packed rows: need at least {layout.rows}, a multiple of {mini_batches} mini-batches")
    slots = row_length // 2  # every packed sequence has a prompt token and a trained token
    tokens = np.full((rows, row_length), pad_id, np.int32)
    labels = np.zeros((rows, row_length), np.int32)
    loss_mask = np.zeros((rows, row_length - 1), np.float32)
    behaviour = np.zeros((rows, row_length - 1), np.float32)
    packed_advantages = np.zeros((rows, slots), np.float32)
    advantages = np.asarray(advantages, np.float32)
    packed_trajectories = None
    if trajectories is not None:
        numbers = first_sequence + checked_trajectories(trajectories, n)
        placed = layout.row >= 0
        if len(set(zip(numbers[placed].tolist(), (layout.row[placed] % mini_batches).tolist()))) != len(
                set(numbers[placed].tolist())):
            raise ValueError(f"layout: a trajectory's sequences lie in different mini-batches of {mini_batches}; give "
                             "pack_layout the same trajectories")
        packed_trajectories = np.full((rows, slots), -1, np.int32)
        packed_trajectories[layout.row[placed], layout.slot[placed]] = numbers[placed]
    for i in np.flatnonzero(layout.row >= 0):
        r, start = layout.row[i], layout.offset[i]
        prompt, completion = np.asarray(prompts[i]).reshape(-1), np.asarray(completions[i]).reshape(-1)
        middle, end = start + len(prompt), start + len(prompt) + len(completion)
        tokens[r, start:middle], tokens[r, middle:end] = prompt, completion
        labels[r, start:end] = layout.slot[i] + 1
        # Position t scores token t + 1: the completion's tokens middle .. end-1 are scored at middle-1 .. end-2.
        logprobs = np.asarray(behaviour_logprobs[i], np.float32)[:len(completion)]
        if masks is None:
            loss_mask[r, middle - 1:end - 1] = 1.0
            behaviour[r, middle - 1:end - 1] = logprobs
        else:  # a masked token's behaviour log-prob is never read: kept 0 there, as in pack_batch
            loss_mask[r, middle - 1:end - 1] = masks[i]
            behaviour[r, middle - 1:end - 1] = np.where(masks[i] > 0, logprobs, 0.0)
        packed_advantages[r, layout.slot[i]] = advantages[i]
    # Each row's trained positions in order, then -1 (a stable sort puts the trained ones first). The layout kept
    # each row's trained tokens (masked ones not counted) within scored_length, so none is cut off.
    order = np.argsort(loss_mask == 0, axis=1, kind="stable")[:, :scored_length]
    scored = np.where(np.take_along_axis(loss_mask, order, axis=1) > 0, order, -1).astype(np.int32)
    packed_routing = None
    if routing is not None:  # each sequence's routing where its tokens are in its row
        packed_routing = np.zeros((rows, row_length - 1, *routing_shape(routing)), np.int32)
        for i in np.flatnonzero(layout.row >= 0):
            inputs = np.asarray(routing[i], np.int32)[:len(prompts[i]) + len(completions[i]) - 1]
            packed_routing[layout.row[i], layout.offset[i]:layout.offset[i] + len(inputs)] = inputs
    return TrainBatch(tokens=tokens, input_mask=labels, loss_mask=loss_mask, advantages=packed_advantages,
                      behaviour_logprobs=behaviour, scored_positions=scored, routing=packed_routing,
                      trajectories=packed_trajectories)


def checked_trajectories(trajectories, n: int) -> np.ndarray:
    """[n] int64: each of n sequences' trajectory (None: each its own, 0 .. n-1), checked to be in [0, n) (a
    process's trajectories are at most its sequences, so that process x sequences + t numbers them across
    processes); ValueError naming the first that is not."""
    if trajectories is None:
        return np.arange(n, dtype=np.int64)
    out = np.asarray(trajectories, np.int64).reshape(-1)
    if out.shape != (n,):
        raise ValueError(f"trajectories has {out.size} entries for {n} sequences: one per sequence")
    bad = np.flatnonzero((out < 0) | (out >= n))
    if len(bad):
        raise ValueError(f"trajectories[{bad[0]}] = {out[bad[0]]}: each must be in 0 .. {n - 1} (the sequences)")
    return out


def trajectory_numbers(samples: list[np.ndarray], rows: int) -> np.ndarray:
    """[rows] int64, one per learner sequence of a process's groups laid out group after group (samples: per group,
    the sample each of its sequences belongs to, group_sequences'), then padding: the trajectory it belongs
    to, numbered from 0 in order, a group's samples by their rank (an ordinary group's sequences 0, 1, ..., a segment
    group's segments their trajectory's); each padding sequence its own. An ordinary step's numbers are its sequence
    indices, so its mini-batches are those of one trajectory per sequence."""
    out, start, count = np.zeros(rows, np.int64), 0, 0
    for group_samples in samples:
        ranks = np.unique(np.asarray(group_samples), return_inverse=True)[1].reshape(-1)
        out[start:start + len(ranks)] = count + ranks
        start, count = start + len(ranks), count + (ranks.max() + 1 if len(ranks) else 0)
    out[start:] = count + np.arange(rows - start)
    return out


def sequence_lengths(prompts: list, completions: list, valid: np.ndarray | None = None,
                     completion_masks: list | None = None):
    """([n] prompt lengths, [n] completion lengths, [n] trained completion tokens) for pack_layout (its
    prompt_lengths, completion_lengths and trained_lengths). A row whose reward failed counts 0 completion and 0
    trained tokens (it is left out); completion_masks (pack_batch's) count only their sampled tokens as trained;
    without them every completion token is."""
    prompt = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
    completion = np.fromiter((len(c) for c in completions), np.int64, len(completions))
    if valid is not None:
        completion = np.where(np.asarray(valid, bool), completion, 0)
    if completion_masks is None:
        return prompt, completion, completion.copy()
    sums = np.fromiter((m.sum() for m in checked_masks(completion_masks, completions)), np.int64, len(completions))
    return prompt, completion, np.where(completion > 0, sums, 0)


def packed_row_sizes(max_rows: int, unit: int, buckets: int) -> tuple[int, ...]:
    """The packed row counts a run compiles for: max_rows x k / buckets for k = 1 .. buckets, each rounded up to
    a multiple of `unit` (what splits into mini-batches, micro-batches and devices), without repeats; max_rows
    (a multiple of unit) is the last: the most rows a step can need."""
    return tuple(sorted({-(-max_rows * k // (buckets * unit)) * unit for k in range(1, buckets + 1)}))


def packed_rows_for(needed: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` that holds `needed` rows."""
    for size in sizes:
        if size >= needed:
            return size
    raise ValueError(f"{needed} packed rows: more than the largest size {sizes[-1]}")


def padding_fraction(trained_tokens: int, rows: int, row_length: int) -> float:
    """The share of `rows` x `row_length` token slots that hold no token of a trained sequence."""
    return 1.0 - trained_tokens / max(rows * row_length, 1)
