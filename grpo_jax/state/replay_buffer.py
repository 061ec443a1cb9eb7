"""Finished groups waiting for the learner, the staleness bound, and the actor's admission rule.

Versions and steps. The weight version is the number of learner steps done so far (each step makes
optim.mini_batches x optim.epochs optimizer updates; the version counts steps, not updates). The learner
trains the step that starts at version k (take(n, current_version=k)); that step makes version k + 1. A group
generated with weights of version w and trained at version k has staleness k - w, which must be
<= max_staleness. take() enforces this hard: a group found too stale is taken out and handed back
separately, to be generated again (Collector.requeue); it is never silently evicted.

Admission (the actor's side). Before generating a group, the actor reserves a slot with
reserve(n, actor_version). The groups the learner will train before a new one are the ones already
waiting in the buffer plus the ones reserved (being generated); the learner takes prompts_per_step (P)
per step, oldest ordinal first, so the new group lands at the latest in

    target_step = learner_version + (waiting + reserved + n - 1) // P

where learner_version is the version the learner's next take() trains at. It is admitted iff

    target_step - actor_version <= max_staleness                       (may_generate)

i.e. "stop admitting prompts that could not be trained within the bound". With actor weights current,
that allows at most (max_staleness + 1) * P groups waiting or in flight. A refusal clears once the
actor loads newer weights (the learner has moved on), so the actor loop is:

    n = buffer.admissible(actor_version)   # 0: wait for weights newer than actor_version
    buffer.reserve(n, actor_version)       # within what admissible() allowed, so it always succeeds
    ... generate with actor_version ...; then buffer.put(group) or, if the prompt is dropped, buffer.release(1)

max_staleness = 0 is strictly on-policy synchronous GRPO through the same code: at learner version k the
actor may admit only while target_step == actor_version == k, i.e. it generates step k's P groups only
with weights of version k (after P reservations it is refused until it loads version k + 1, which exists
only after the learner trained step k), and the learner trains them at version k (staleness 0).

The rule is a bound on the common path, not the guarantee: groups finishing out of order, or a
restored buffer, can still produce a too-stale group; take() catches those.

Capacity: put() blocks while the buffer holds `capacity` groups (with a timeout it raises
ReplayBufferTimeout). Under the admission rule the buffer never holds more than (max_staleness + 1) * P,
so that is the natural capacity; capacity must be >= prompts_per_step or no step could ever be taken.

The end of the data is not a failure, and the two are told apart:
- finish(): the data is exhausted, no new prompts. What is reserved is still coming (groups in flight in
  the generator finish over later decode chunks): put() takes those in, release() gives back the dropped
  ones, and take() waits for them. take() hands out what is left, possibly fewer than n, with
  drained=True, once nothing is reserved; with nothing left either, drained=True and no groups. Groups
  that grow too stale after that are still generated again: reserve() and put() stay open for them (a
  put needs a reservation then: one without is a caller's bug, ValueError).
- close(error): the producer failed; every waiter wakes, and put/take/reserve raise ReplayBufferClosed
  from `error` instead of waiting forever, whatever is reserved.

Serialisation: to_state()/from_state() use plain JSON values only (arrays as {"__ndarray__": dtype,
shape, data}); nothing is pickled, so loading a checkpoint never runs code. With an ArrayPool the arrays
go into one flat array per dtype instead (what an Orbax checkpoint stores) and the JSON points into them.
Pure Python + numpy, no JAX.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

STATE_FORMAT = "grpo_jax.state.replay_buffer/1"


class ReplayBufferClosed(RuntimeError):
    """The buffer was closed with an error (the actor died); raised from put/take/reserve, from that error."""


class ReplayBufferTimeout(TimeoutError):
    """put() found no room, or take() got nothing, within the timeout."""


# Segment groups (multi-turn environments). A trajectory is cut into segments, each one learner sequence whose
# completion interleaves sampled tokens with tokens the environment wrote. Such a group lays out the segments of
# all G trajectories (trajectory 0's first, each trajectory's in order) as its rows: completions and
# behaviour_logprobs are per segment (0.0 at environment tokens), Group.segments says which tokens are whose, and
# rewards, advantages and valid stay per trajectory. prompt["prompt_ids"] (the data path's tokenization of the row)
# is not trained: the segments have their own.
# In a saved state a group is a dict with the fields ordinal .. regenerations and an "extras" dict holding the
# rest under these keys (the layout of states written before Group was typed, which still restore):
SEGMENT_PROMPTS = "segment_prompts"
SEGMENT_MASKS = "segment_masks"
SEGMENT_TRAJECTORY = "segment_trajectory"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segments:
    """Which trajectory each row of a segment group is, and which of its tokens the model sampled."""

    prompts: list  # per segment: [prompt length] int32, the tokens before its first sampled token
    masks: list  # per segment: [completion length] 0/1 (int8 or float32), 1 = sampled (trained)
    trajectory: np.ndarray  # [segments] int32: the trajectory (0 .. G - 1) of each segment


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeStats:
    """What a group's G episodes did, for the metrics only (rollout.actor.episode_metrics); never trained."""

    stats: np.ndarray  # [G, len(rollout.actor.EPISODE_STATS)] float32
    reward_parts: np.ndarray  # [G, parts] float32: each named part of reward(), NaN where an episode gave none
    reward_part_names: list  # [parts] str
    step_rewards: np.ndarray  # [G, turns] float32: each step's reward in turn order, NaN where none


@dataclasses.dataclass
class Group:
    """The G completions of one prompt, as generated by the actor (or the segments of G trajectories: `segments`),
    with what the learner trains them with. The record the actor hands the learner across their threads, and what
    a checkpoint keeps of the buffer (group_to_plain, group_from_plain)."""

    ordinal: int  # the prompt's ordinal (grpo_jax.data.collector)
    prompt: dict  # the prompt record as handed out (has "dataset_index" and "epoch")
    completions: list  # per row: the completion's token ids (arrays or lists; ragged)
    behaviour_logprobs: list  # per row: per-token log-probs under the generating weights, aligned with completions
    rewards: np.ndarray  # [G] float32, per sample (per trajectory in a segment group)
    weight_version: int  # the oldest actor weight version among the group's sampled tokens
    regenerations: int = 0  # how many times this prompt was generated again for being too stale
    advantages: np.ndarray | None = None  # [G] float32: what each sample trains with (0 where not valid)
    valid: np.ndarray | None = None  # [G] bool: the sample was scored / the episode did not fail; None: all were
    zero_variance: bool = False  # every valid advantage is 0 (trained only without filter_zero_variance)
    token_versions: list | None = None  # per row: [sampled tokens] int32, the weight version that drew each
    routing: list | None = None  # per row: [tokens, layers, top_k] int32, the experts each token went through
    segments: Segments | None = None  # a multi-turn group's layout; None: one row per sample
    episodes: EpisodeStats | None = None  # a multi-turn group's metrics

    def staleness(self, current_version: int) -> int:
        return current_version - self.weight_version

    @property
    def segmented(self) -> bool:
        """Whether its rows are the segments of multi-turn trajectories."""
        return self.segments is not None


_HEAD_FIELDS = ("ordinal", "prompt", "completions", "behaviour_logprobs", "rewards", "weight_version", "regenerations")
_EPISODE_KEYS = {"episode_stats": "stats", "reward_parts": "reward_parts", "reward_part_names": "reward_part_names",
                 "step_rewards": "step_rewards"}
_EXTRAS_KEYS = ("advantages", "valid", "zero_variance", "token_versions", "routing", SEGMENT_PROMPTS, SEGMENT_MASKS,
                SEGMENT_TRAJECTORY, *_EPISODE_KEYS)


def group_to_plain(group: Group, pool: ArrayPool | None = None) -> dict:
    """A group as plain JSON values (to_plain), in the saved layout (see SEGMENT_PROMPTS)."""
    extras = {name: getattr(group, name) for name in ("advantages", "valid", "token_versions", "routing")
              if getattr(group, name) is not None}
    extras["zero_variance"] = bool(group.zero_variance)
    if group.segments is not None:
        extras.update({SEGMENT_PROMPTS: group.segments.prompts, SEGMENT_MASKS: group.segments.masks,
                       SEGMENT_TRAJECTORY: group.segments.trajectory})
    if group.episodes is not None:
        extras.update({key: getattr(group.episodes, name) for key, name in _EPISODE_KEYS.items()})
    head = {name: getattr(group, name) for name in _HEAD_FIELDS}
    return to_plain({**head, "extras": extras}, f"group of ordinal {group.ordinal}", pool)


def group_from_plain(plain: Any, pool: ArrayPool | None = None) -> Group:
    """group_to_plain's inverse, also for states saved before Group was typed (the same keys). ValueError naming
    the group and the key for anything else."""
    value = from_plain(plain, pool)
    where = f"replay buffer state: group of ordinal {value.get('ordinal') if isinstance(value, dict) else '?'}"
    if not isinstance(value, dict) or not isinstance(value.get("extras", {}), dict):
        raise ValueError(f"{where}: expected a dict with an extras dict")
    extras = value.get("extras", {})
    unknown = sorted((set(value) - {*_HEAD_FIELDS, "extras"}) | (set(extras) - set(_EXTRAS_KEYS)))
    missing = [name for name in _HEAD_FIELDS[:-1] if name not in value]
    if unknown or missing:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"unknown key(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else []))
            + ": not a state this version of grpo_jax wrote")
    segment_keys = [k for k in (SEGMENT_PROMPTS, SEGMENT_MASKS, SEGMENT_TRAJECTORY) if k in extras]
    if segment_keys and len(segment_keys) != 3:
        raise ValueError(f"{where}: extras has {segment_keys} but a segment group needs {SEGMENT_PROMPTS}, "
                         f"{SEGMENT_MASKS} and {SEGMENT_TRAJECTORY}")
    episode_keys = [k for k in _EPISODE_KEYS if k in extras]
    if episode_keys and len(episode_keys) != len(_EPISODE_KEYS):
        raise ValueError(f"{where}: extras has {episode_keys} but a group's episode stats need {list(_EPISODE_KEYS)}")
    return Group(
        **{name: value[name] for name in _HEAD_FIELDS if name in value},
        advantages=extras.get("advantages"), valid=extras.get("valid"),
        zero_variance=bool(extras.get("zero_variance", False)), token_versions=extras.get("token_versions"),
        routing=extras.get("routing"),
        segments=Segments(prompts=extras[SEGMENT_PROMPTS], masks=extras[SEGMENT_MASKS],
                          trajectory=np.asarray(extras[SEGMENT_TRAJECTORY])) if segment_keys else None,
        episodes=EpisodeStats(**{name: extras[key] for key, name in _EPISODE_KEYS.items()}) if episode_keys else None)


@dataclasses.dataclass
class Taken:
    """The result of take(): `groups` (n of them, or fewer only when drained) and `too_stale` (taken out of
    the buffer, to be requeued for generation again)."""

    groups: list
    too_stale: list
    drained: bool = False  # finished and nothing reserved: nothing more will come


class ReplayBuffer:
    """Thread-safe store of finished groups keyed by ordinal; one lock (a Condition) for everything."""

    def __init__(self, capacity: int, max_staleness: int, prompts_per_step: int, learner_version: int = 0):
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={prompts_per_step}: must be >= 1")
        if capacity < prompts_per_step:
            raise ValueError(f"capacity={capacity}: must be >= prompts_per_step={prompts_per_step}, else no step fits")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.capacity = int(capacity)
        self.max_staleness = int(max_staleness)
        self.prompts_per_step = int(prompts_per_step)
        self._cond = threading.Condition()
        self._groups: dict[int, Group] = {}
        self._reserved = 0
        self._learner_version = int(learner_version)
        self._finished = False  # finish(): no new prompts; what is reserved still comes
        self._error: BaseException | None = None
        # Restored groups that from_state(fits=...) left out, as (ordinal, reason): to be generated again.
        self.left_out: list[tuple[int, str]] = []

    # -- admission -------------------------------------------------------------------------------

    def may_generate(self, target_step: int, actor_version: int) -> bool:
        """The staleness rule itself: a group generated with `actor_version` and trained at `target_step`
        is within the bound."""
        return target_step - actor_version <= self.max_staleness

    def next_target_step(self, n: int = 1) -> int:
        """The latest step that would train the n-th group admitted from now (see the module doc)."""
        with self._cond:
            return self._target_step(n)

    def admissible(self, actor_version: int, max_steps: int | None = None) -> int:
        """How many more groups the actor may reserve now with weights `actor_version`: the largest n with
        may_generate(target_step(n), actor_version), and, with max_steps, no more than the steps before
        max_steps still need. The actor reserves min(this, handout size), so a handout thinned by drops is
        topped up by a smaller one instead of waiting for a full handout that could never be admitted."""
        with self._cond:
            last_step = actor_version + self.max_staleness
            if max_steps is not None:
                last_step = min(last_step, max_steps - 1)
            slots = (last_step - self._learner_version + 1) * self.prompts_per_step
            return max(0, slots - len(self._groups) - self._reserved)

    def reserve(self, n: int, actor_version: int) -> bool:
        """Admit n groups for generation with weights `actor_version` if all of them can be trained within
        the staleness bound; returns False (and reserves nothing) otherwise. put() consumes a reservation,
        release() gives one back (prompt dropped, generation abandoned)."""
        with self._cond:
            self._raise_if_failed()
            if not self.may_generate(self._target_step(n), actor_version):
                return False
            self._reserved += n
            return True

    def release(self, n: int = 1) -> None:
        with self._cond:
            if n > self._reserved:
                raise ValueError(f"release({n}): only {self._reserved} reserved")
            self._reserved -= n
            self._cond.notify_all()

    @property
    def learner_version(self) -> int:
        with self._cond:
            return self._learner_version

    def set_learner_version(self, version: int) -> None:
        """The version the learner's next take() trains at (set on start/restore; take() keeps it current)."""
        with self._cond:
            self._learner_version = int(version)
            self._cond.notify_all()

    # -- putting and taking ----------------------------------------------------------------------

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Add a finished group; blocks while the buffer is full (ReplayBufferTimeout after `timeout`
        seconds). Consumes a reservation if there is one; after finish() there must be one (ValueError
        without). Raises ReplayBufferClosed once closed with an error, ValueError for an ordinal already present."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._finished and self._reserved == 0:
                    raise ValueError(f"put(ordinal {group.ordinal}) without a reservation after finish(): once the "
                                     "data is exhausted only groups reserved before (in flight, or generated again) "
                                     "may come")
                if group.ordinal in self._groups:
                    raise ValueError(f"put(): a group for ordinal {group.ordinal} is already in the buffer")
                if len(self._groups) < self.capacity:
                    break
                if not self._wait(deadline):
                    raise ReplayBufferTimeout(f"put(ordinal {group.ordinal}): buffer full ({self.capacity} groups) "
                                              f"for {timeout} s")
            self._groups[group.ordinal] = group
            if self._reserved > 0:
                self._reserved -= 1
            self._cond.notify_all()

    def take(self, n: int, current_version: int, timeout: float | None = None) -> Taken:
        """Take n groups for the learner step at `current_version`, oldest ordinal first, each with
        staleness <= max_staleness.

        Groups found too stale are taken out and returned in `too_stale` at once (with no groups if fewer
        than n fresh ones are there), so the caller can requeue them without waiting. After a successful
        take the next step is current_version + 1, which the admission rule uses from then on.
        After finish(): waits for the groups still reserved, then returns what is left (possibly fewer than n,
        possibly none) with drained=True. Closed with an error: raises ReplayBufferClosed. Nothing within
        `timeout` seconds: ReplayBufferTimeout."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"take({n}): n must be in 1..capacity={self.capacity}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._learner_version = int(current_version)
            while True:
                self._raise_if_failed()
                too_stale = [g for g in self._groups.values() if g.staleness(current_version) > self.max_staleness]
                for g in too_stale:
                    del self._groups[g.ordinal]
                too_stale.sort(key=lambda g: g.ordinal)
                if len(self._groups) >= n or (self._finished and self._reserved == 0 and self._groups):
                    taken = [self._groups.pop(o) for o in sorted(self._groups)[:n]]
                    drained = len(taken) < n
                    if not drained:
                        self._learner_version = int(current_version) + 1
                    self._cond.notify_all()
                    return Taken(taken, too_stale, drained)
                if too_stale:
                    self._cond.notify_all()  # room freed for put()
                    return Taken([], too_stale)
                if self._finished and self._reserved == 0:
                    return Taken([], [], drained=True)
                if not self._wait(deadline):
                    raise ReplayBufferTimeout(
                        f"take({n}) at version {current_version}: {len(self._groups)} group(s) waiting and "
                        f"{self._reserved} being generated after {timeout} s"
                    )

    def put_back(self, groups: list[Group], current_version: int) -> None:
        """Return groups from an abandoned take(n, current_version) (a stop signal came before the learner
        trained them): they wait again, for a checkpoint to save, and the next step is current_version again.
        Ignores the capacity: the room was theirs a moment ago."""
        with self._cond:
            for group in groups:
                if group.ordinal in self._groups:
                    raise ValueError(f"put_back(): a group for ordinal {group.ordinal} is already in the buffer")
                self._groups[group.ordinal] = group
            self._learner_version = int(current_version)
            self._cond.notify_all()

    def finish(self) -> None:
        """The data is exhausted: no new prompts. Reservations stay: the groups in flight still arrive (or are
        released), and take() waits for them before it reports drained. Idempotent."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def close(self, error: BaseException) -> None:
        """The producer failed with `error`: every waiter wakes, and put/take/reserve raise ReplayBufferClosed
        from it (reservations no longer count: what they stood for will never arrive)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """No new prompts will come: finish() was called, or close(error)."""
        with self._cond:
            return self._finished or self._error is not None

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def ordinals(self) -> list[int]:
        with self._cond:
            return sorted(self._groups)

    @property
    def reserved(self) -> int:
        with self._cond:
            return self._reserved

    # -- checkpoints -----------------------------------------------------------------------------

    def to_state(self, pool: ArrayPool | None = None) -> dict:
        """The waiting groups as plain JSON values (reservations are not saved: in-flight generation is
        lost on a restart, and the collector hands those prompts out again). `ordinals` lists the
        groups' ordinals: pass it to Collector.checkpoint_state, after taking this state. With `pool`,
        the groups' arrays go into the pool and the state holds references to them."""
        with self._cond:
            groups = [self._groups[o] for o in sorted(self._groups)]
            return {
                "format": STATE_FORMAT,
                "capacity": self.capacity,
                "max_staleness": self.max_staleness,
                "prompts_per_step": self.prompts_per_step,
                "learner_version": self._learner_version,
                "ordinals": [g.ordinal for g in groups],
                "groups": [group_to_plain(g, pool) for g in groups],
            }

    @classmethod
    def from_state(cls, state: dict, capacity: int | None = None, max_staleness: int | None = None,
                   prompts_per_step: int | None = None, pool: ArrayPool | None = None,
                   learner_version: int | None = None,
                   fits: Callable[[Group], str | None] | None = None) -> ReplayBuffer:
        """A buffer holding the saved groups; the sizes and learner version default to the saved ones (a
        new config may change them). `pool`: the arrays a state taken with a pool refers to.

        With `fits` (a group -> None if it can still be trained, else why not), the groups that do not fit,
        and beyond the capacity the newest ones, are left out and listed in `left_out` as (ordinal,
        reason): they are unfinished prompts to generate again, never lost. Without it, saved groups that
        do not fit the capacity raise ValueError."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"replay buffer state: expected format {STATE_FORMAT!r}")
        buffer = cls(
            capacity if capacity is not None else state["capacity"],
            max_staleness if max_staleness is not None else state["max_staleness"],
            prompts_per_step if prompts_per_step is not None else state["prompts_per_step"],
            learner_version=state["learner_version"] if learner_version is None else learner_version,
        )
        if fits is None and len(state["groups"]) > buffer.capacity:
            raise ValueError(f"replay buffer state holds {len(state['groups'])} groups, capacity is {buffer.capacity}")
        groups = sorted((group_from_plain(plain, pool) for plain in state["groups"]), key=lambda g: g.ordinal)
        for group in groups:
            reason = None if fits is None else fits(group)
            if reason is None and len(buffer._groups) >= buffer.capacity:
                reason = f"beyond the buffer's capacity of {buffer.capacity} groups"
            if reason is None:
                buffer._groups[group.ordinal] = group
            else:
                buffer.left_out.append((group.ordinal, reason))
        return buffer

    # -- internals (lock held) -------------------------------------------------------------------

    def _target_step(self, n: int) -> int:
        return self._learner_version + (len(self._groups) + self._reserved + n - 1) // self.prompts_per_step

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ReplayBufferClosed(
                f"replay buffer closed: {type(self._error).__name__}: {self._error}") from self._error

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a notify; False once the deadline has passed."""
        if deadline is None:
            self._cond.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True


# ----------------------------------------------------------------------------------------------------
# Plain-JSON encoding of group contents.


class ArrayPool:
    """Arrays gathered into one flat array per dtype: a replay buffer saved "as arrays" is a few large
    arrays (for Orbax) plus JSON references {"__pooled__": dtype, "start", "shape"} into them."""

    def __init__(self, flats: dict[str, Any] | None = None):
        self.flats = {k: np.asarray(v) for k, v in (flats or {}).items()}
        self._parts: dict[str, list[np.ndarray]] = {}
        self._sizes: dict[str, int] = {}

    def put(self, array: np.ndarray) -> dict:
        key = str(array.dtype)
        start = self._sizes.get(key, 0)
        self._parts.setdefault(key, []).append(array.ravel())
        self._sizes[key] = start + array.size
        return {"__pooled__": key, "start": start, "shape": list(array.shape)}

    def get(self, ref: dict) -> np.ndarray:
        try:
            flat = self.flats[ref["__pooled__"]]
            start, shape = int(ref["start"]), [int(d) for d in ref["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"replay buffer state: bad array reference {ref!r} ({e!r})") from e
        size = int(np.prod(shape))
        if start + size > flat.size:
            raise ValueError(f"replay buffer state: reference {ref!r} runs past the end of its array ({flat.size})")
        return flat[start:start + size].reshape(shape).copy()

    def arrays(self) -> dict[str, np.ndarray]:
        """The flat arrays, each with one trailing pad element: Orbax refuses zero-size arrays, and an
        empty buffer still saves one array."""
        parts = self._parts or {"int32": []}
        return {k: np.concatenate(v + [np.zeros(1, _dtype(k))]) for k, v in parts.items()}


def to_plain(value: Any, where: str = "group", pool: ArrayPool | None = None) -> Any:
    """`value` as JSON values: arrays (anything with dtype/shape, numpy or not) become
    {"__ndarray__": dtype, "shape": [...], "data": [...]} (or, with `pool`, a reference into it), bytes
    {"__bytes__": base64}, tuples lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict key {k!r} is not a string")
            out[k] = to_plain(v, f"{where}.{k}", pool)
        return out
    if isinstance(value, (list, tuple)):
        return [to_plain(v, f"{where}[{i}]", pool) for i, v in enumerate(value)]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        array = np.asarray(value)
        if array.dtype.kind not in "biuf" and not _is_ml_dtype(array.dtype):
            raise TypeError(f"{where}: array of dtype {array.dtype} cannot be saved as plain numbers")
        if pool is not None:
            return pool.put(array)
        return {"__ndarray__": str(array.dtype), "shape": list(array.shape), "data": array.ravel().tolist()}
    raise TypeError(f"{where}: {type(value).__name__} cannot be saved as plain JSON")


def from_plain(value: Any, pool: ArrayPool | None = None) -> Any:
    if isinstance(value, list):
        return [from_plain(v, pool) for v in value]
    if isinstance(value, dict):
        if "__pooled__" in value:
            if pool is None:
                raise ValueError("replay buffer state refers to pooled arrays, but none were given")
            return pool.get(value)
        if "__ndarray__" in value:
            return np.asarray(value["data"], dtype=_dtype(value["__ndarray__"])).reshape(value["shape"])
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        return {k: from_plain(v, pool) for k, v in value.items()}
    return value


def _is_ml_dtype(dtype: np.dtype) -> bool:
    """bfloat16 and the float8 types (numpy kind 'V'), which ml_dtypes defines."""
    try:
        import ml_dtypes
    except ImportError:
        return False
    return isinstance(getattr(ml_dtypes, str(dtype), None), type)


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends are registered by name only through ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
