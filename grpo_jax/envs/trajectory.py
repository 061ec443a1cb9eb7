"""Trajectory: one episode's token ids as the learner is to train them, built turn by turn. Pure Python.

Token-in/token-out: the sampled ids are kept as the sampler gave them (with their behaviour log-probs and the
weight version that drew each); the renderer gives the ids around them (the opening prompt, then after each
environment step the end-of-turn glue, the environment's messages and the next generation prompt). The
conversation is never encoded again from text, except where the template forces it: when the renderer cannot
extend (CannotExtend: the template renders the history differently once the environment's messages follow),
the trajectory is cut there and a new Segment starts whose prompt is the fresh render of the whole history
(prime-rl's approach; there every message's text, the model's own earlier turns included, is encoded as text: a
special token's spelling in it is no special token, see grpo_jax.envs.render). Earlier segments keep what the model
saw when it sampled them.

A Segment is one sequence to train: `tokens`, `loss_mask` 1 exactly on the sampled tokens (0 on the prompt's,
the glue's and the environment's), `behaviour_logprobs` and `weight_versions` of the sampled tokens (0.0 and -1
elsewhere). The sequence the engine continues is `current_ids` (the last segment).

Calls, in order: Trajectory(renderer, messages, tools), then add_turn and add_step alternately, ending with
add_turn. A turn that did not end with an end-of-turn token (finish "length": cut off, which marks the
trajectory truncated; or "eos") ends the trajectory: add_step refuses. The engine, which enforces max_turns and
max_total_tokens, calls mark_truncated when those stop an episode the environment had not ended.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from grpo_jax.envs.environment import TokenPrompt
from grpo_jax.envs.render import AssistantTurn, CannotExtend, Renderer
from grpo_jax.envs.tools import Tool

NO_VERSION = -1  # weight_versions of a token that was not sampled


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """One sequence of a trajectory; four columns of one length (module docstring)."""

    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]

    def __post_init__(self):
        lengths = {len(self.tokens), len(self.loss_mask), len(self.behaviour_logprobs), len(self.weight_versions)}
        if len(lengths) != 1:
            raise ValueError(f"Segment: tokens, loss_mask, behaviour_logprobs, weight_versions differ in length "
                             f"({len(self.tokens)}, {len(self.loss_mask)}, {len(self.behaviour_logprobs)}, "
                             f"{len(self.weight_versions)})")


class Trajectory:
    """An episode's segments and totals (turns, tool_calls, tool_errors, truncated, cuts), built turn by turn."""

    def __init__(self, renderer: Renderer, messages: Sequence[dict] | TokenPrompt,
                 tools: Sequence[Tool | dict] | None = None):
        """messages: the opening conversation (Environment.reset's), or a TokenPrompt (the opening ids as they
        are: the trajectory then holds no messages); tools: those offered to the model."""
        self.renderer, self.tools = renderer, tools
        prompt = messages if isinstance(messages, TokenPrompt) else None
        # the conversation so far, as the template takes it ([] while the sequence came from token prompts)
        self.messages: list[dict] = [] if prompt is not None else [dict(m) for m in messages]
        self.turns = self.tool_calls = self.tool_errors = 0
        self.truncated = False
        self.cuts: list[str] = []  # why each segment after the first began (CannotExtend.reason)
        self._columns: list[tuple[list, list, list, list]] = []
        self._next = "turn"  # what may come: "turn", "step", or "" once the trajectory ended
        self._before_step: tuple | None = None  # what add_step changed, for take_back_step
        self._last_text: str | None = None  # the last turn's text as sampled (Renderer.append_ids' `sampled`)
        self._cut_by_caller = False  # the last turn was cut at its caller's limit (add_turn's `capped`)
        self._start_segment(self._checked(prompt.ids) if prompt is not None else
                            renderer.initial_ids(self.messages, tools))

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(Segment(tokens=tuple(t), loss_mask=tuple(m), behaviour_logprobs=tuple(lp),
                             weight_versions=tuple(v)) for t, m, lp, v in self._columns)

    @property
    def current_ids(self) -> list[int]:
        """The sequence the sampler continues: the last segment's tokens."""
        return list(self._columns[-1][0])

    @property
    def ended(self) -> bool:
        return self._next == ""

    def _checked(self, ids: Sequence[int]) -> list[int]:
        """A token prompt's ids, ValueError unless each is one of the tokenizer's."""
        vocab = self.renderer.tokenizer.vocab_size
        bad = next((i for i in ids if not 0 <= int(i) < vocab), None)
        if bad is not None:
            raise ValueError(f"token prompt: id {bad} is not in the tokenizer's vocabulary of {vocab}")
        return [int(i) for i in ids]

    def _start_segment(self, prompt_ids: Sequence[int]) -> None:
        self._columns.append(([], [], [], []))
        self._append(prompt_ids)

    def _append(self, ids: Sequence[int], logprobs: Sequence[float] | None = None,
                versions: Sequence[int] | None = None) -> None:
        tokens, mask, column_logprobs, column_versions = self._columns[-1]
        sampled = logprobs is not None
        tokens.extend(int(i) for i in ids)
        mask.extend([int(sampled)] * len(ids))
        column_logprobs.extend([float(x) for x in logprobs] if sampled else [0.0] * len(ids))
        column_versions.extend([int(v) for v in versions] if sampled else [NO_VERSION] * len(ids))

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], weight_versions: Sequence[int], *,
                 capped: bool = False) -> AssistantTurn:
        """The sampled ids of one assistant turn (its stop id included, when sampled), each token's behaviour
        log-prob and weight version. Returns the parsed turn, for the environment's step. A turn that ends
        without an end-of-turn id ends the trajectory truncated, unless `capped`: it was cut at a limit its caller
        set (an agent's max_tokens) with room left, and a step may follow it, in a new segment (the model never
        closed the turn, so no render of the conversation extends the ids held)."""
        if self._next != "turn":
            raise ValueError("add_turn: " + ("the trajectory has ended" if self.ended else
                                             "an assistant turn needs an environment step (add_step) before it"))
        if not len(ids) or not len(ids) == len(logprobs) == len(weight_versions):
            raise ValueError(f"add_turn: ids, logprobs, weight_versions must have one entry per sampled token, and "
                             f"a turn at least one ({len(ids)}, {len(logprobs)}, {len(weight_versions)})")
        if not all(math.isfinite(float(x)) and float(x) <= 0 for x in logprobs):
            raise ValueError("add_turn: every log-prob must be finite and <= 0")
        if any(int(v) < 0 for v in weight_versions):
            raise ValueError("add_turn: weight versions are >= 0")
        turn = self.renderer.parse(ids)
        self._append(ids, logprobs, weight_versions)
        self.messages.append(turn.message)
        self._last_text = turn.text
        self.turns += 1
        self.tool_calls += len(turn.tool_calls)
        cut = turn.finish == "length"
        self._cut_by_caller = cut and capped
        self.truncated = self.truncated or (cut and not capped)
        self._next = "step" if turn.finish == "stop" or self._cut_by_caller else ""
        return turn

    def add_step(self, messages: Sequence[dict], *, tool_errors: int = 0,
                 history: Sequence[dict] | None = None, prompt: TokenPrompt | None = None) -> bool:
        """The environment's messages after the last turn (StepResult.messages and .tool_errors): their ids
        follow the turn, or, where the renderer cannot extend, a new segment starts. True when it did. history
        (StepResult.history): the whole conversation anew instead, which always starts a new segment. prompt
        (StepResult.prompt): the next prompt's ids whole, which extend the sequence where they start with the ids
        held (what follows them appended as they are), else start a new segment."""
        if self._next != "step":
            raise ValueError("add_step: " + ("the trajectory has ended (its last turn did not end with an "
                                             "end-of-turn token, or it was marked truncated)" if self.ended else
                                             "an environment step answers an assistant turn (add_turn) first"))
        if prompt is not None:
            ids, held = self._checked(prompt.ids), self._columns[-1][0]
            self._before_step = (len(self._columns), len(held), list(self.messages), self.tool_errors)
            self.messages.clear()  # the conversation is the ids' now
            self.tool_errors += tool_errors
            self._next = "turn"
            if ids[:len(held)] == held:
                self._append(ids[len(held):])
                return False
            self.cuts.append("the token prompt does not start with the ids the sequence holds")
            self._start_segment(ids)
            return True
        if history is not None:
            ids = CannotExtend(reason="the environment gave the conversation anew (StepResult.history)")
        elif self._cut_by_caller:
            ids = CannotExtend(reason="the last turn was cut at its caller's token limit, without an end-of-turn id")
        else:
            ids = self.renderer.append_ids(self.messages, messages, self.tools, sampled=self._last_text)
        self._before_step = (len(self._columns), len(self._columns[-1][0]), list(self.messages), self.tool_errors)
        if history is not None:
            self.messages[:] = [dict(m) for m in history]
        self.messages.extend(dict(m) for m in messages)
        self.tool_errors += tool_errors
        self._next = "turn"
        if isinstance(ids, CannotExtend):
            self.cuts.append(ids.reason)
            self._start_segment(self.renderer.initial_ids(self.messages, self.tools))
            return True
        self._append(ids)
        return False

    def take_back_step(self) -> None:
        """Undo the last add_step (its messages and ids, or the segment it started) and end the trajectory
        truncated: the engine's way out when the environment's answer does not fit the sequence."""
        if self._before_step is None:
            raise ValueError("take_back_step: no environment step to take back")
        segments, length, messages, tool_errors = self._before_step
        del self._columns[segments:]
        for column in self._columns[-1]:
            del column[length:]
        self.messages[:] = messages
        del self.cuts[segments - 1:]
        self.tool_errors = tool_errors
        self._before_step = None
        self.mark_truncated()

    def mark_truncated(self) -> None:
        """The episode was stopped before the environment ended it (max_turns, max_total_tokens)."""
        self.truncated = True
        self._next = ""
