"""Continuous-batching rollout engine: slots, one prefill per prompt shared by its samples, in-flight updates.

The static sampler (grpo_jax.rollout.sampler) runs one batch until its longest row ends, prefills every prompt once
per sample, and takes new weights only between calls. With long-tailed completion lengths most of its rows
sit finished while a few run on. This engine keeps a fixed number of sequences in flight instead:

- Slots. `slots` sequences decode together, in jitted chunks of `chunk_steps` steps. Between chunks the
  host refills the slots whose sequence ended (eos or its token limit) with waiting samples, streams out
  every group whose G samples have all finished, and may swap in new weights.
- One prefill per prompt. A group's prompt is prefilled once per chunk boundary at which its samples get
  slots (normally once), and its keys/values are copied into each of those slots; the first token of every
  sample is drawn from that one prefill's logits.
- Ring KV cache. Each slot has L = max_prompt_len + max_new_tokens cache columns used as a ring: decode step
  t of a bank writes column t % L for every slot at once (one dynamic_update_slice, as in the static
  sampler), and a sequence's keys are the run of columns ending at the current one, marked in key_mask.
  A new sequence's prompt goes into the L columns just before the current one, so slots can start at any
  step. A sequence spans at most max_prompt_len + max_new_tokens - 1 columns, so it never overwrites itself.
  Attention is permutation-invariant over keys (RoPE is applied before caching), so the ring order is free.
  Sliding-window layers (Gemma 3's local layers) keep a ring of their own of W = min(L, sliding_window)
  columns, written at t % W: writing a token overwrites the one W positions back, which has just left the
  window, so the ring holds exactly the keys the layer may read (local_key_mask marks the current sequence's).
- Exactness. Sample i of a group draws token t from fold_in(keys[i], t), exactly as the static sampler's row
  does, so which slot (or bank, or chunk) a sample lands in does not change what it draws, up to float noise
  between batch shapes (a draw within rounding of a CDF boundary can flip).
- In-flight weight updates. update_params(state, version) takes effect at the next device call: sequences
  in flight keep their keys/values (computed by older weights) and go on with the new weights. Every token
  carries the version of the weights that produced its logits and its log-prob under them (the behaviour
  policy of that token). With inflight_updates off, new weights wait until the slots have drained, and no
  new sequence starts meanwhile.
- Paged KV (sampler.kv_cache = paged; rollout.pages). Instead of a ring per slot, a bank keeps every
  full-attention layer's keys and values in one pool of kv_pages pages (model.attention.PagedKV), and each slot a
  page table: its key at position p in its p // page_size-th page. Before each chunk the host gives every live
  sequence the pages its next chunk_steps keys need (oldest first); when the pool runs short, the youngest
  sequence in flight is put back in the queue (its pages freed, its tokens dropped) and later restarts from its
  prompt, drawing what it drew before on the same weights. A sample starts only when its prompt and first
  chunk's pages are free, so a full pool stops admission, never the run. The samples of a group admitted
  together share the pages their prompt fills whole. Decode attention reads only a sequence's pages (TPU's
  paged-attention kernel; elsewhere the pages are gathered). Sliding-window layers keep their per-slot ring.
- Draining. With nothing waiting, a bank whose live slots fit in half of it is halved (down to
  MIN_BANK_SLOTS), so the long tail of a batch decodes a few slots, not a bank of finished ones; it grows
  back to full size when work arrives.
- Programs (jit once): the decode chunk (one per bank size, sampling mode and, with paged KV, page-table
  width), the admission (prefill + copy into slots + first token; one per power-of-two prompt count and prompt
  bucket), the bank resizes and the empty state. Weights, temperature, top-p and token limits are runtime
  values. warm_up() compiles them all before a run; programs() publishes them with abstract arguments for
  `grpo-jax compile` (rollout.common).
- Routing (a model with experts and model.routing_replay): every token's experts in each MoE layer are recorded,
  the prompt's from its prefill and each sampled token's from the decode step that reads it, and returned with
  the group (GroupResult.routing), so that the learner routes each token as the actor did.
- Streams. The slots are split into `decode_streams` banks, each with its own state and clock, run from
  their own threads (XLA's CPU runtime overlaps separate executions; use 1 stream on an accelerator).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.algorithm.lengths import ExpectedLengths
from grpo_jax.algorithm.sampling import sample_logits
from grpo_jax.model.attention import AttentionMask, PagedKV
from grpo_jax.model.transformer import positions_from_mask, rope_inverse_frequencies
from grpo_jax.parallel.sharding import traced_on
from grpo_jax.rollout.common import (  # draw_uniforms, Sampling, GroupResult: also importable from here
    GeneratorProgram,
    GroupResult,
    SampleResult,
    Sampling,
    Workload,
    abstract_arrays,
    bucket,
    cache_layout,
    check_top_k,
    checked_config,
    checked_prompts,
    draw_uniforms,
    is_abstract,
    merged,
    placed,
    raw_keys,
    replicated,
    vocab_major_head,
    weights_mesh,
    weights_state,
)
from grpo_jax.rollout.pages import PagePool, pages_for, positions_needed
from grpo_jax.rollout.sampler import Sampler, SamplerConfig

DONATED_SLOT_STATE = (3,)  # the admission and the chunk update a bank's slot state in place
DONATED_RESIZE = (0,)  # a paged bank's resize: its slot state
DEFAULT_SLOTS = 64  # SamplerConfig.slots = 0 outside the trainer (which uses prompts_per_step x group_size)
MIN_BANK_SLOTS = 8  # a draining bank is halved down to this many slots (below, a step costs about the same)


class SlotState(NamedTuple):
    """One bank's slots on the device (S slots, L ring columns)."""

    cache: tuple  # per layer (k, v), each [S, C, L, D]: keys/values of each slot's sequence, in ring columns (C:
    #               the KV heads, or each repeated so that the tensor axis splits them: sampler.cache_layout); with
    #               paged KV, a full-attention layer's are the bank's pool, each [C, N + 1, page_size, D]
    key_mask: jax.Array  # [S, L] bool: the ring columns that hold a key of the slot's current sequence ([S, 0]
    #                      with paged KV: a sequence's keys are its positions)
    local_key_mask: jax.Array  # [S, W] bool: the same for the sliding-window layers' ring (W = 0 without them)
    last_token: jax.Array  # [S] int32: the token sampled last, fed to the model at the next step
    position: jax.Array  # [S] int32: RoPE position of last_token (the number of tokens before it)
    generated: jax.Array  # [S] int32: tokens the slot's sequence has drawn, i.e. the index of its next draw
    limit: jax.Array  # [S] int32: the sequence's max_new_tokens
    done: jax.Array  # [S] bool: no sequence, or it ended (eos or limit): the slot idles until refilled
    keys: jax.Array  # [S, 2] uint32: raw key data of the sequence; token t draws from fold_in(key, t)
    clock: jax.Array  # [] int32: decode steps this bank has run; step t writes ring column t % L


@dataclasses.dataclass
class _Request:
    """A submitted prompt whose samples are waiting for slots or in flight (host side)."""

    prompt: np.ndarray  # [P] int32
    keys: np.ndarray  # [G, 2] uint32 raw key data, one per sample
    max_new: int
    tag: Any
    pending: list = dataclasses.field(default_factory=list)  # samples waiting for a slot, in sample order
    queued: bool = True  # in the engine's waiting queue
    finished: int = 0
    # Per sample, once finished: (tokens [n] int32, logprobs [n] float32, versions [n] int32, finish reason,
    # routing [prompt + n - 1, moe layers, k] int32 or None).
    samples: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.samples = [None] * len(self.keys)
        self.pending = list(range(len(self.keys)))


class _Bank:
    """A bank's device state and its host mirror: which sample each slot holds and what it has drawn so far, and
    with paged KV its page pool and each slot's pages."""

    def __init__(self, state, slots: int, max_new: int, routing_shape: tuple = (0, 0), pages: int = 0,
                 pages_per_sequence: int = 0):
        self.state = state
        self.occupants: list = [None] * slots  # (request, sample index) or None
        self.generated = np.zeros(slots, np.int32)  # tokens of the slot's sample recorded here
        self.tokens = np.zeros((slots, max_new), np.int32)
        self.logprobs = np.zeros((slots, max_new), np.float32)
        self.versions = np.zeros((slots, max_new), np.int32)  # the weight version that drew each token
        # Routing recorded (Engine.record_routing): of each sampled token, and of the slot's prompt ([P, ...]).
        self.routing = np.zeros((slots, max_new, *routing_shape), np.int32)
        self.prompt_routing: list = [None] * slots
        self.pool = PagePool(pages) if pages else None
        scratch = pages  # the pool's scratch page (PagePool.scratch)
        self.page_table = np.full((slots, pages_per_sequence), scratch, np.int32)
        self.held: list = [[] for _ in range(slots)]  # each slot's pages, in position order
        self.prompt_len = np.zeros(slots, np.int32)
        self.started = np.zeros(slots, np.int64)  # when the slot's sample got it (a counter): youngest is put back
        self.stop = np.zeros(slots, bool)  # slots whose sample was put back: the next chunk marks them done

    def take(self, index: np.ndarray) -> None:
        """Keep the host rows `index` (in that order; -1: a new empty slot)."""
        keep = index >= 0
        self.occupants = [self.occupants[i] if i >= 0 else None for i in index]
        self.prompt_routing = [self.prompt_routing[i] if i >= 0 else None for i in index]
        self.held = [self.held[i] if i >= 0 else [] for i in index]
        for name in ("generated", "tokens", "logprobs", "versions", "routing", "prompt_len", "started", "stop"):
            rows = getattr(self, name)[np.maximum(index, 0)]
            rows[~keep] = 0
            setattr(self, name, rows)
        table = self.page_table[np.maximum(index, 0)]
        table[~keep] = self.pool.scratch if self.pool is not None else 0
        self.page_table = table


@dataclasses.dataclass
class _Admission:
    """What one bank admits at a chunk boundary: the prompts to prefill and the slots they go to."""

    requests: list  # distinct requests prefilled (rows of the prefill batch)
    entries: list  # (slot, row in requests, sample index)


class Engine:
    """Slot-based generation with continuous batching; see the module docstring (a common.StreamingGenerator).
    Not thread-safe: one thread (the actor) drives it. Over abstract weights (common module docstring) its banks'
    slot state is abstract too, and only programs() and the shape logic may be used."""

    def __init__(self, model: nnx.Module, eos_ids: Sequence[int], pad_id: int, config: SamplerConfig | None = None,
                 *, slots: int = 0, adapters: nnx.Module | None = None, version: int = 0, mesh: Mesh | None = None):
        """mesh: the one the weights are laid out on (default: read from them; None for weights on one device),
        on which the slot state is laid out (slot_shardings)."""
        self.config = checked_config(config or SamplerConfig())
        cfg = self.config
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id = int(pad_id)
        self.vocab_size = model.config.vocab_size
        self.graphdef, self.state = nnx.split(model)
        self._head = vocab_major_head(self.graphdef, self.state)
        self.adapter_graphdef, self.adapters = nnx.split(adapters) if adapters is not None else (None, None)
        self.version = int(version)
        self._pending: tuple | None = None  # (state, version) held back while inflight_updates is off
        self.sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        total = slots or cfg.slots or DEFAULT_SLOTS
        self.num_banks, self.bank_slots = cfg.banks(total)  # every bank the same shape: one compiled chunk program
        self.ring = cfg.max_prompt_len + cfg.max_new_tokens
        self.local_ring = min(self.ring, model.config.sliding_window) if model.config.has_local_layers else 0
        self.paged = cfg.kv_cache == "paged"
        self.page_size = cfg.page_size
        self.pages_per_sequence = cfg.pages_per_sequence if self.paged else 0
        # With paged KV, 0 pages: what the slots' rings would hold, so that no sequence ever waits for a page.
        self.bank_pages = cfg.pages_per_bank(self.bank_slots) if self.paged else 0
        self.key_columns = 0 if self.paged else self.ring  # the ring's columns (SlotState.key_mask)
        self.table_widths = self._page_table_widths()  # fixed by the config: looked up before every chunk
        self._started = 0  # samples given a slot so far (a paged bank puts the youngest back first)
        mesh = weights_mesh(self.state) if mesh is None else mesh
        self.mesh = mesh
        self.cache_heads, self.cache_sharding = cache_layout(model.config, mesh)
        self.model_config = model.config
        self.record_routing = model.config.replays_routing
        self.routing_shape = model.config.routing_shape
        self.slot_shardings = None if mesh is None else self._slot_shardings(mesh, model.config.num_layers)
        # With a mesh, every program returns the slot state in that one layout (the KV ring split as cache_layout
        # says, everything else replicated), and its tokens replicated: a bank keeps one layout for the whole run.
        banked, admitted, chunked = {}, {}, {}  # out_shardings of the programs, with a mesh
        if mesh is not None:
            whole = NamedSharding(mesh, PartitionSpec())
            banked = {"out_shardings": self.slot_shardings}
            routed = (whole,) if self.record_routing else ()
            admitted = {"out_shardings": (self.slot_shardings, whole, whole, *routed)}
            chunked = {"out_shardings": (self.slot_shardings, whole, whole, whole, *routed)}
        self.num_compilations = 0  # traces of the engine's programs (each is one XLA compile)
        self._admit = jax.jit(traced_on(mesh, self._admit_impl), static_argnames=("greedy", "top_k", "use_top_p"),
                              donate_argnums=DONATED_SLOT_STATE, **admitted)
        # With paged KV the resize passes the bank's pools through: donated, they are not copied.
        self._resize = jax.jit(self._resize_impl, donate_argnums=DONATED_RESIZE if self.paged else (), **banked)
        self._chunk = jax.jit(traced_on(mesh, self._chunk_impl),
                              static_argnames=("steps", "greedy", "top_k", "use_top_p", "cost_keys"),
                              donate_argnums=DONATED_SLOT_STATE, **chunked)
        self._empty = jax.jit(self._empty_state_impl, static_argnums=(0, 1), **banked)
        self._compiled: set = set()  # program keys called at least once (see step)
        if is_abstract(self.state):
            empty = self.slot_state_shape(self.bank_slots)
            copies = [empty] * self.num_banks
        else:
            empty = self._empty(self.bank_slots, self.key_columns)
            copies = [empty] + [jax.tree.map(jnp.copy, empty) for _ in range(self.num_banks - 1)]
        self._banks = [self._new_bank(state) for state in copies]
        # A bank whose live slots fit in half of it, with nothing waiting, is halved (down to MIN_BANK_SLOTS):
        # the long tail of a batch then decodes a few slots, not a full bank of finished ones. Only where
        # sequences can outlive a chunk: otherwise every slot ends within the chunk it started in anyway, and
        # the smaller banks would only be more programs to compile.
        self.min_bank_slots = min(MIN_BANK_SLOTS, self.bank_slots)
        self.shrink = cfg.max_new_tokens > cfg.chunk_steps
        self._waiting: collections.deque[_Request] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(self.num_banks - 1, 1), thread_name_prefix="engine")
        self.stats = collections.Counter()  # running totals, see metrics()
        self._static: Sampler | None = None  # for generate() while busy, see there

    def _new_bank(self, state) -> _Bank:
        return _Bank(state, self.bank_slots, self.config.max_new_tokens, self.routing_shape, self.bank_pages,
                     self.pages_per_sequence)

    def _is_paged(self, layer: int) -> bool:
        """Whether `layer` keeps its keys in the bank's page pool (paged KV, a full-attention layer)."""
        return self.paged and not self.model_config.is_local(layer)

    def _layer_cache_sharding(self, layer: int) -> NamedSharding | None:
        """A layer's cache layout in the slot state: the ring's (cache_layout), or for a page pool [C, N, page, D]
        the same split of its heads."""
        if self.cache_sharding is None or not self._is_paged(layer):
            return self.cache_sharding
        return NamedSharding(self.mesh, PartitionSpec(*self.cache_sharding.spec[1:2]))

    def _slot_shardings(self, mesh: Mesh, layers: int) -> SlotState:
        """The slot state's layout on `mesh`: the KV ring (or page pool) as cache_layout says (its heads split over
        `tensor`, each KV head repeated where their number does not divide it), every other field replicated."""
        replicated = NamedSharding(mesh, PartitionSpec())
        return SlotState(cache=tuple((self._layer_cache_sharding(i),) * 2 for i in range(layers)),
                         **{name: replicated for name in SlotState._fields if name != "cache"})

    # -- weights --------------------------------------------------------------------------------------

    def update_params(self, model_or_state, version: int | None = None) -> None:
        """New trained weights, as Sampler.update_params takes them (the model or its nnx.State; with LoRA
        adapters, the adapters), and their version (default: one more). Used from the next device call on, with
        sequences in flight; with inflight_updates off, once the slots have drained. Same structure: no
        recompile."""
        model_or_state = weights_state(model_or_state)
        version = self.version + 1 if version is None else int(version)
        if self.config.inflight_updates or self.active_slots == 0:
            self._swap(model_or_state, version)
        else:
            self._pending = (model_or_state, version)
            self.stats["updates_held_back"] += 1

    def _swap(self, state, version: int) -> None:
        if self.adapter_graphdef is not None:
            self.adapters = state  # the base weights stay
        else:
            self.state, self._head = state, vocab_major_head(self.graphdef, state)
        self.version = version
        self._pending = None

    # -- queue ----------------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], keys, tag: Any = None, max_new_tokens: int | None = None) -> None:
        """Queue one prompt with one key per sample (typed keys or raw uint32 key data [G, 2]); its group
        comes back from step() once every sample has finished."""
        cfg = self.config
        check_top_k(self.sampling.top_k, self.vocab_size, "submit")
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if len(prompt) == 0:
            raise ValueError("submit: the prompt is empty")
        if len(prompt) > cfg.max_prompt_len:
            raise ValueError(f"submit: the prompt has {len(prompt)} tokens, "
                             f"more than max_prompt_len={cfg.max_prompt_len}")
        max_new = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= max_new <= cfg.max_new_tokens:
            raise ValueError(f"submit: max_new_tokens={max_new}: must be in 1..{cfg.max_new_tokens} (the KV ring "
                             "is sized for sampler.max_new_tokens)")
        keys = raw_keys(keys)
        if len(keys) == 0:
            raise ValueError("submit: needs at least one key (one per sample)")
        self._waiting.append(_Request(prompt, keys, max_new, tag))

    @property
    def active_slots(self) -> int:
        return sum(o is not None for bank in self._banks for o in bank.occupants)

    @property
    def free_slots(self) -> int:
        return self.num_banks * self.bank_slots - self.active_slots

    @property
    def waiting_samples(self) -> int:
        """Samples submitted and not yet given a slot (or put back in the queue)."""
        return sum(len(r.pending) for r in self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or self.active_slots > 0

    @property
    def bank_sizes(self) -> list[int]:
        """Each bank's current number of slots (halved while draining, back to full when work arrives)."""
        return [len(bank.occupants) for bank in self._banks]

    @property
    def num_slots(self) -> int:
        return self.num_banks * self.bank_slots

    def close(self) -> None:
        """Stop the bank threads once their current work ends (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._static is not None:
            self._static.close()

    # -- running --------------------------------------------------------------------------------------

    def step(self) -> list[GroupResult]:
        """One chunk boundary and one chunk: fill free slots with waiting samples (prefilling their prompts),
        decode every bank with a live slot for up to chunk_steps steps, and return the groups that finished."""
        start = time.perf_counter()
        if self._pending is not None and self.active_slots == 0:
            self._swap(*self._pending)
        admissions = []
        for bank in self._banks:
            if self.paged:
                self._grow(bank)
            if self._pending is None and self._waiting and len(bank.occupants) < self.bank_slots:
                self._resize_bank(bank, self.bank_slots)
            admissions.append(self._plan(bank) if self._pending is None else None)
        state, head, adapters, version = self.state, self._head, self.adapters, self.version
        calls = [(bank, admission) for bank, admission in zip(self._banks, admissions)
                 if admission is not None or any(o is not None for o in bank.occupants)]

        def run(call):
            bank, admission = call
            first = None
            if admission is not None:
                first = self._run_admission(bank, admission, state, head, adapters)
            return first, self._run_chunk(bank, state, head, adapters)

        keys = set().union(*(self._program_keys(bank, admission) for bank, admission in calls))
        if len(calls) > 1 and keys <= self._compiled:
            futures = [self._pool.submit(run, call) for call in calls[1:]]
            outs = [run(calls[0])] + [f.result() for f in futures]
        else:  # a program's first call runs alone, so that two threads never trace it twice
            outs = [run(call) for call in calls]
            self._compiled |= keys
        finished = []
        for (bank, admission), (first, chunk) in zip(calls, outs):
            finished += self._record(bank, admission, first, chunk, version)
        if self._pending is not None and self.active_slots == 0:
            self._swap(*self._pending)  # drained: held-back weights now, so the caller's next admission sees them
        for bank in self._banks if self.shrink else ():
            live = sum(o is not None for o in bank.occupants)
            size = len(bank.occupants)
            while not self._waiting and size > self.min_bank_slots and live <= size // 2:
                size //= 2
                self._resize_bank(bank, size)  # halving only: one resize program per size
        self.stats["seconds"] += time.perf_counter() - start
        return finished

    def generate(self, prompts: list[list[int]], keys, *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None) -> SampleResult:
        """Sampler.generate's interface: one completion per prompt, keys as there (an int seed or [B] per-row
        keys). Rows with identical prompts share one prefill. With requests in flight (an evaluation between
        two chunks of training rollouts), or a token limit beyond the engine's KV ring, the static Sampler
        does the work on the same weights: it draws the same tokens (up to float noise), and the slots in
        flight are left as they are."""
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if self.busy or max_new > cfg.max_new_tokens:
            return self._static_sampler().generate(prompts, keys, max_new_tokens=max_new, temperature=temperature,
                                                   top_p=top_p, top_k=top_k)
        sampling = Sampling(temperature=cfg.temperature if temperature is None else float(temperature),
                            top_p=cfg.top_p if top_p is None else float(top_p),
                            top_k=cfg.top_k if top_k is None else int(top_k))
        problems = dataclasses.replace(cfg, temperature=sampling.temperature, top_p=sampling.top_p,
                                       top_k=sampling.top_k).validate()
        if problems:
            raise ValueError("invalid sampling arguments: " + "; ".join(problems))
        check_top_k(sampling.top_k, self.vocab_size, "generate")
        n = len(prompts)
        checked_prompts(prompts, cfg.max_prompt_len)
        if isinstance(keys, (int, np.integer)):
            keys = jax.random.split(jax.random.key(int(keys)), n)
        keys = raw_keys(keys)
        if len(keys) != n:
            raise ValueError(f"got {len(keys)} keys for {n} prompts")
        rows_of: dict[tuple, list[int]] = {}
        for i, p in enumerate(prompts):
            rows_of.setdefault(tuple(int(t) for t in p), []).append(i)
        saved, self.sampling = self.sampling, sampling
        try:
            for prompt, rows in rows_of.items():
                self.submit(prompt, keys[rows], tag=rows, max_new_tokens=max_new)
            results = []
            while self.busy:
                results += self.step()
        finally:
            self.sampling = saved
        tokens = np.full((n, max_new), self.pad_id, np.int32)
        logprobs = np.zeros((n, max_new), np.float32)
        lengths = np.zeros(n, np.int32)
        reasons = [""] * n
        for result in results:
            for row, toks, lps, reason in zip(result.tag, result.tokens, result.logprobs, result.finish_reasons):
                tokens[row, :len(toks)], logprobs[row, :len(toks)] = toks, lps
                lengths[row], reasons[row] = len(toks), reason
        return SampleResult(tokens=tokens, logprobs=logprobs, lengths=lengths, finish_reasons=reasons,
                            prompt_lengths=np.array([len(p) for p in prompts], np.int32))

    def _static_sampler(self) -> Sampler:
        """A static Sampler on this engine's current weights (built once; it shares the arrays)."""
        if self._static is None:
            adapters = None if self.adapter_graphdef is None else nnx.merge(self.adapter_graphdef, self.adapters)
            self._static = Sampler(nnx.merge(self.graphdef, self.state), self.eos_ids, self.pad_id, self.config,
                                   adapters=adapters)
        self._static.share_weights(self.state, self._head, self.adapters, self.version)
        return self._static

    def program_shapes(self, group_size: int = 1) -> tuple[list[int], list[int], list[int]]:
        """The shapes of the programs a run with groups of `group_size` samples can use (what warm_up compiles,
        and grpo_jax.planning.compile compiles for a TPU slice): the bank sizes (full, then halved one step at a
        time while draining), the prompt buckets, and the admission's row counts (every power-of-two count of
        prompts one bank can take at a boundary, partly placed groups included)."""
        cfg = self.config
        sizes = [self.bank_slots]
        while self.shrink and sizes[-1] // 2 >= self.min_bank_slots:
            sizes.append(sizes[-1] // 2)
        plens = sorted({self._prompt_bucket(n) for n in range(1, cfg.max_prompt_len + 1)})
        most = min(self.bank_slots, -(-self.bank_slots // group_size) + 1)
        rows = sorted({self._admission_rows(n) for n in range(1, most + 1)})
        return sizes, plens, rows

    def warm_up(self, group_size: int = 1) -> int:
        """Compile, up front, every program a run with groups of `group_size` samples can use: the decode chunk
        for every bank size (and, with paged KV, page-table width: table_widths), the bank resizes, and the
        admission for every prompt bucket and every power-of-two count of prompts one bank can take at a boundary
        (partly placed groups included). Runs them on a
        throwaway bank. Returns how many programs were compiled; afterwards a run compiles nothing."""
        if self.busy:
            raise RuntimeError("warm_up() needs an idle engine")
        before = self.num_compilations
        sizes, plens, rows = self.program_shapes(group_size)
        bank = self._new_bank(self._empty(self.bank_slots, self.key_columns))
        dummy = _Request(np.zeros(1, np.int32), np.zeros((1, 2), np.uint32), 1, None)
        for plen in plens:
            for count in rows:
                prompt = np.full(plen, self.pad_id, np.int32)
                self._run_admission(bank, _Admission([dataclasses.replace(dummy, prompt=prompt)] * count, []),
                                    self.state, self._head, self.adapters)
        for size in sizes:  # full, then halved one step at a time, as step() does
            if size != self.bank_slots:
                self._resize_bank(bank, size)
            for width in self.table_widths:
                self._run_chunk(bank, self.state, self._head, self.adapters, width)
        for size in reversed(sizes[1:]):  # and back to full from every size (the bank is at the smallest now)
            while len(bank.occupants) > size:
                self._resize_bank(bank, len(bank.occupants) // 2)
            self._resize_bank(bank, self.bank_slots)
        static = tuple(sorted(self.sampling.static.items()))
        self._compiled |= {("chunk", size, width, static) for size in sizes for width in self.table_widths}
        self._compiled |= {("admit", (count, plen), static) for plen in plens for count in rows}
        return self.num_compilations - before

    def metrics(self) -> dict:
        """Running totals since the engine was built: slot occupancy (live slot-steps over decoded slot-steps),
        prefill tokens computed and saved by sharing, tokens generated, weight updates that waited for the
        slots to drain (inflight_updates off), and tokens/s while stepping."""
        s = self.stats
        return {"engine/slot_occupancy": s["live_slot_steps"] / max(s["slot_steps"], 1),
                "engine/prefill_tokens": int(s["prefill_tokens"]),
                "engine/prefill_tokens_saved": int(s["prefill_tokens_saved"]),
                "engine/generated_tokens": int(s["generated_tokens"]),
                "engine/updates_held_back": int(s["updates_held_back"]),
                **({"engine/kv_pages_peak": max(bank.pool.peak_used for bank in self._banks),
                    "engine/samples_put_back": int(s["put_back"])} if self.paged else {}),
                "engine/tokens_per_s": s["generated_tokens"] / max(s["seconds"], 1e-9)}

    # -- planning -------------------------------------------------------------------------------------

    @property
    def head(self) -> jax.Array:
        """The vocab-major LM head the programs take (vocab_major_head of the weights)."""
        return self._head

    def slot_state_shape(self, slots: int) -> SlotState:
        """A bank of `slots` slots as ShapeDtypeStructs, in the layout the programs return it in (slot_shardings)."""
        return placed(jax.eval_shape(lambda: self._empty(slots, self.key_columns)), self.slot_shardings)

    def _in_flight(self, positions: float) -> int:
        """Sequences one bank holds at once when each holds `positions` key positions: its slots, or with paged KV
        as many as its pages hold (at least one)."""
        if not self.paged:
            return self.bank_slots
        return max(1, min(self.bank_slots, int(self.bank_pages // pages_for(math.ceil(positions), self.page_size))))

    def _calls_per_step(self, samples: int, group_size: int, prompt_len: int) -> tuple[int, dict[int, int]]:
        """Decode chunks, and admissions by their prefill rows, of a step of `samples` samples in groups of
        `group_size` when every sample decodes to max_new_tokens in lockstep: the samples fill the slots in waves
        (with paged KV, as many per bank as its pages hold at that length, prompts of `prompt_len`); each wave is
        one admission per bank it uses (one prefill per group) and ceil((max_new_tokens - 1) / chunk_steps)
        chunks per bank (the first token comes from the admission; a last partial chunk counts whole); banks run
        one after the other."""
        cfg = self.config
        per_bank = self._in_flight(prompt_len + cfg.max_new_tokens - 1)
        chunks_per_wave = max(-(-(cfg.max_new_tokens - 1) // cfg.chunk_steps), 1)
        chunks, admissions, start = 0, {}, 0
        while start < samples:
            wave = min(samples - start, per_bank * self.num_banks)
            for first in range(start, start + wave, per_bank):
                last = min(first + per_bank, start + wave)  # this bank's samples [first, last)
                rows = self._admission_rows((last - 1) // group_size - first // group_size + 1)
                admissions[rows] = admissions.get(rows, 0) + 1
                chunks += chunks_per_wave
            start += wave
        return chunks, admissions

    def expected_keys(self, workload: Workload) -> int:
        """The keys a decoding sequence holds on average over a step's decode steps, at the workload's expected
        lengths (ExpectedLengths.decode_keys)."""
        return self.expected_lengths(workload).decode_keys()

    def expected_lengths(self, workload: Workload) -> ExpectedLengths:
        """The workload's expected lengths, each at most what this engine takes (its longest prompt and
        max_new_tokens where the workload gives none)."""
        cfg = self.config
        longest = min(workload.prompt_len, cfg.max_prompt_len)
        if workload.expected is None:
            return ExpectedLengths.at_buckets(longest, cfg.max_new_tokens)
        return workload.expected.clipped(longest, cfg.max_new_tokens)

    def _expected_chunks(self, workload: Workload) -> int:
        """Decode chunks of a step whose samples have the workload's expected lengths: each bank it uses keeps as
        many sequences in flight as it holds (its slots; with paged KV, at most what its pages hold at the mean
        live length, expected_keys, plus a chunk) while samples wait, and decodes its share of their tokens, at
        least its longest sequence (the tail sets the floor); banks run one after the other. Samples that end
        early refill at once: the continuous engine's point, which the worst case (_calls_per_step) leaves
        out."""
        cfg = self.config
        lengths = self.expected_lengths(workload)
        if workload.samples == 0:
            return 0
        in_flight = self._in_flight(self.expected_keys(workload) + cfg.chunk_steps)
        banks = min(self.num_banks, -(-workload.samples // in_flight))
        per_bank = -(-workload.samples // banks)
        tokens = math.ceil(per_bank * (lengths.mean_completion - 1))
        steps = max(-(-tokens // in_flight), lengths.longest_completion - 1)
        return banks * max(-(-steps // cfg.chunk_steps), 1)

    def programs(self, workload: Workload) -> list[GeneratorProgram]:
        """The engine's programs at the shapes warm_up compiles for groups of workload.group_size
        (program_shapes), over abstract arguments, with their calls per step (_calls_per_step), in this order:

        - "engine chunk": a decode chunk of chunk_steps steps for every bank size (full first, then halved while
          draining; shape: (slots,)); then one decode step alone (the chunk with steps=1 on a full bank), compiled
          for its cost (cost_part: chunk_steps); with paged KV and expected lengths in the workload, one more at
          the keys a sequence holds on average (at_expected: the kernel reads only those pages). Chunk calls at
          the expected lengths (expected_calls_per_step) beside the worst case when the workload has them;
        - "engine admission": prefill + copy into slots + first token on a full bank (shape: (prompts, prompt
          bucket)), at the most prompts one bank takes at a boundary, then at each other prompt count a step uses
          (fewest first), all at the bucket of workload.prompt_len;
        - "engine resize": a bank halved while draining, then grown back to full from every smaller size (shape:
          (slots, new slots)); none where banks do not shrink."""
        cfg, full = self.config, self.bank_slots
        sizes, _, admission_rows = self.program_shapes(workload.group_size)
        chunk_calls, admissions = self._calls_per_step(workload.samples, workload.group_size, workload.prompt_len)
        expected = workload.expected is not None
        expected_chunks = self._expected_chunks(workload) if expected else None
        whole = replicated(self.mesh)
        static = self.sampling.static
        state, head, adapters = abstract_arrays((self.state, self._head, self.adapters))
        banks = {size: self.slot_state_shape(size) for size in sizes}

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

        scalars = (sds((), jnp.float32), sds((), jnp.float32))

        def tables(size):  # the page table and the slots put back, as _run_chunk passes them
            return sds((size, self.pages_per_sequence), jnp.int32), sds((size,), jnp.bool_)

        programs = [GeneratorProgram(name="engine chunk", label=f"engine chunk ({size} slots)", jitted=self._chunk,
                                     args=(state, head, adapters, banks[size], *tables(size), *scalars),
                                     kwargs=dict(static, steps=cfg.chunk_steps), shape=(size,),
                                     donated=DONATED_SLOT_STATE, calls_per_step=chunk_calls if size == full else 0,
                                     expected_calls_per_step=expected_chunks if size == full else None)
                    for size in sizes]
        programs.append(GeneratorProgram(
            name="engine chunk", label="engine chunk (one decode step alone, for its cost)", jitted=self._chunk,
            args=(state, head, adapters, banks[full], *tables(full), *scalars), kwargs=dict(static, steps=1),
            shape=(full,),
            donated=DONATED_SLOT_STATE, cost_part=cfg.chunk_steps))
        keys = self.expected_keys(workload)
        if expected and self.paged and keys < self.pages_per_sequence * self.page_size:  # reads held pages only
            programs.append(GeneratorProgram(
                name="engine chunk", label=f"engine chunk (one decode step alone, {keys} keys per row, for its cost)",
                jitted=self._chunk, args=(state, head, adapters, banks[full], *tables(full), *scalars),
                kwargs=dict(static, steps=1, cost_keys=keys), shape=(full,), donated=DONATED_SLOT_STATE,
                cost_part=cfg.chunk_steps, at_expected=True))

        plen = self._prompt_bucket(workload.prompt_len)
        slot_args = (sds((full,), jnp.int32), sds((full,), jnp.int32), sds((full, 2), jnp.uint32),
                     sds((full,), jnp.int32))
        most = admission_rows[-1]
        for rows in [most, *(r for r in sorted(admissions) if r != most)]:
            label = "engine admission" if rows == most else f"engine admission ({rows} prompts, for its cost)"
            programs.append(GeneratorProgram(
                name="engine admission", label=label, jitted=self._admit,
                args=(state, head, adapters, banks[full], tables(full)[0], sds((rows, plen), jnp.int32),
                      sds((rows, plen), jnp.bool_), *slot_args, *scalars),
                kwargs=dict(static), shape=(rows, plen), donated=DONATED_SLOT_STATE,
                calls_per_step=admissions.get(rows, 0)))

        pairs = list(zip(sizes, sizes[1:])) + [(size, full) for size in sizes[1:]]
        programs += [GeneratorProgram(name="engine resize", label=f"engine resize ({a} -> {b} slots)",
                                      jitted=self._resize, args=(banks[a], sds((b,), jnp.int32)), shape=(a, b),
                                      donated=DONATED_RESIZE if self.paged else ())
                     for a, b in pairs]
        return programs

    # -- host side of a boundary -------------------------------------------------------------------------

    def _plan(self, bank: _Bank) -> _Admission | None:
        """Give this bank's free slots to waiting samples, oldest request first (a request's samples in
        order, possibly over several boundaries). With paged KV a sample also takes the pages of its prompt (those
        it fills whole shared by the request's samples admitted together) and of its first chunk, and admission
        stops at the first sample whose pages are not free."""
        free = [s for s, o in enumerate(bank.occupants) if o is None]
        requests, entries = [], []
        out_of_pages = False
        while free and self._waiting and not out_of_pages:
            request = self._waiting[0]
            row, shared = len(requests), None
            while free and request.pending:
                slot = free[0]
                if self.paged:
                    shared = self._give_pages(bank, slot, request, shared)
                    if shared is None:
                        out_of_pages = True
                        break
                free.pop(0)
                if row == len(requests):
                    requests.append(request)
                sample = request.pending.pop(0)
                entries.append((slot, row, sample))
                bank.occupants[slot] = (request, sample)
                bank.started[slot], self._started = self._started, self._started + 1
                bank.stop[slot] = False
            if not request.pending:
                self._waiting.popleft()
                request.queued = False
        return _Admission(requests, entries) if entries else None

    def _give_pages(self, bank: _Bank, slot: int, request: _Request, shared: list | None) -> list | None:
        """Pages for a sample of `request` starting in `slot`: its prompt's whole pages (`shared`: those taken for
        the request's samples before it in this admission, None for the first) and its own for the prompt's tail
        and first chunk. Returns the prompt's whole pages, or None (nothing taken) when the pool lacks them."""
        n = len(request.prompt)
        whole = n // self.page_size
        total = pages_for(positions_needed(n, 1, request.max_new, self.config.chunk_steps), self.page_size)
        own = total - whole
        if bank.pool.free < own + (whole if shared is None else 0):
            return None
        if shared is None:
            shared = bank.pool.take(whole)
        else:
            bank.pool.share(shared)
        held = shared + bank.pool.take(own)
        bank.held[slot], bank.prompt_len[slot] = held, n
        bank.page_table[slot] = bank.pool.scratch
        bank.page_table[slot, :len(held)] = held
        return shared

    def _grow(self, bank: _Bank) -> None:
        """Before a chunk: every live sequence of the bank gets the pages its next chunk_steps keys need, oldest
        first; when the pool runs short, the youngest sequence in flight is put back (_put_back) until it does not."""
        live = sorted((s for s, o in enumerate(bank.occupants) if o is not None), key=lambda s: bank.started[s])
        for slot in live:
            if bank.occupants[slot] is None:  # put back for an older one
                continue
            request, _ = bank.occupants[slot]
            need = pages_for(positions_needed(int(bank.prompt_len[slot]), int(bank.generated[slot]),
                                              request.max_new, self.config.chunk_steps), self.page_size)
            more = need - len(bank.held[slot])
            while more > bank.pool.free:
                youngest = max((s for s, o in enumerate(bank.occupants) if o is not None),
                               key=lambda s: bank.started[s])
                self._put_back(bank, youngest)
                if youngest == slot:
                    break
            if bank.occupants[slot] is None or more <= 0:
                continue
            pages = bank.pool.take(more)
            bank.page_table[slot, len(bank.held[slot]):need] = pages
            bank.held[slot] = bank.held[slot] + pages

    def _put_back(self, bank: _Bank, slot: int) -> None:
        """Put the slot's sample back in the queue (paged KV out of pages): its pages are freed and its tokens
        dropped; it restarts from its prompt when pages allow, its request ahead of every later one."""
        request, sample = bank.occupants[slot]
        self._free_slot(bank, slot)
        bank.stop[slot] = True
        request.pending = sorted(request.pending + [sample])
        if not request.queued:
            self._waiting.appendleft(request)
            request.queued = True
        self.stats["put_back"] += 1

    def _free_slot(self, bank: _Bank, slot: int) -> None:
        bank.occupants[slot], bank.generated[slot], bank.prompt_routing[slot] = None, 0, None
        if self.paged:
            bank.pool.release(bank.held[slot])
            bank.held[slot] = []
            bank.page_table[slot] = bank.pool.scratch

    def _resize_bank(self, bank: _Bank, size: int) -> None:
        """Rebuild the bank with `size` slots: its live slots first (in order), then empty ones."""
        live = [s for s, o in enumerate(bank.occupants) if o is not None]
        index = np.full(size, -1, np.int32)
        index[:len(live)] = live
        bank.state = self._resize(bank.state, index)
        bank.take(index)

    def _prompt_bucket(self, longest: int) -> int:
        """The prompt width an admission whose longest prompt has `longest` tokens is compiled for."""
        return min(bucket(longest, self.config.min_prompt_bucket), self.config.max_prompt_len)

    def _admission_rows(self, prompts: int) -> int:
        """The prefill rows an admission of `prompts` distinct prompts is compiled for."""
        return min(bucket(prompts, 1), self.bank_slots)

    def _admission_shapes(self, admission: _Admission) -> tuple[int, int]:
        longest = max(len(r.prompt) for r in admission.requests)
        return self._admission_rows(len(admission.requests)), self._prompt_bucket(longest)

    def _page_table_widths(self) -> tuple[int, ...]:
        """The page-table widths (pages per slot) a decode chunk is compiled for with paged KV (table_widths): powers
        of two from what a longest prompt and its first chunk need, then pages_per_sequence; a chunk reads only the
        pages of the narrowest width that holds every slot's ((0,) without paged KV)."""
        if not self.paged:
            return (0,)
        width = bucket(pages_for(self.config.max_prompt_len + self.config.chunk_steps, self.page_size), 1)
        widths = []
        while width < self.pages_per_sequence:
            widths.append(width)
            width *= 2
        return (*widths, self.pages_per_sequence)

    def _table_width(self, bank: _Bank) -> int:
        most = max((len(held) for held in bank.held), default=0)
        return next(w for w in self.table_widths if w >= most)

    def _program_keys(self, bank: _Bank, admission: _Admission | None) -> set:
        static = tuple(sorted(self.sampling.static.items()))
        keys = {("chunk", len(bank.occupants), self._table_width(bank), static)}
        if admission is not None:
            keys.add(("admit", self._admission_shapes(admission), static))
        return keys

    def _run_admission(self, bank: _Bank, admission: _Admission, state, head, adapters):
        rows, plen = self._admission_shapes(admission)
        s = len(bank.occupants)
        tokens = np.full((rows, plen), self.pad_id, np.int32)
        mask = np.zeros((rows, plen), bool)
        mask[len(admission.requests):, -1] = True  # dummy rows: one (pad) token, so none attends to nothing
        for r, request in enumerate(admission.requests):
            tokens[r, plen - len(request.prompt):] = request.prompt
            mask[r, plen - len(request.prompt):] = True
        slot = np.full(s, s, np.int32)  # s: out of range, dropped (an unused entry)
        source = np.zeros(s, np.int32)
        keys = np.zeros((s, 2), np.uint32)
        limit = np.ones(s, np.int32)
        for e, (slot_index, row, sample) in enumerate(admission.entries):
            request = admission.requests[row]
            slot[e], source[e], keys[e], limit[e] = slot_index, row, request.keys[sample], request.max_new
        bank.state, *first = self._admit(
            state, head, adapters, bank.state, bank.page_table, tokens, mask, slot, source, keys, limit,
            *self.sampling.scalars, **self.sampling.static)
        return first  # first token, its log-prob (and the prompts' routing)

    def _run_chunk(self, bank: _Bank, state, head, adapters, width: int | None = None):
        stop, bank.stop = bank.stop, np.zeros_like(bank.stop)
        table = bank.page_table[:, :self._table_width(bank) if width is None else width]
        bank.state, tokens, logprobs, steps, *routing = self._chunk(
            state, head, adapters, bank.state, table, stop, *self.sampling.scalars,
            steps=self.config.chunk_steps, **self.sampling.static)
        return jax.device_get((tokens, logprobs, bank.state.generated, bank.state.done, steps, *routing))

    def _record(self, bank: _Bank, admission: _Admission | None, first, chunk, version: int) -> list[GroupResult]:
        """Host bookkeeping after a bank's admission and chunk: copy each slot's new tokens (with the weight
        version that drew them) into the bank's host rows, free the slots whose sample ended, and return the
        groups now complete. Vectorised over slots: per chunk, only ended samples cost Python work."""
        stats = self.stats
        if admission is not None:
            first_token, first_logprob, *prompt_routing = jax.device_get(first)
            slots = np.array([slot for slot, _, _ in admission.entries])
            count = len(slots)
            bank.tokens[slots, 0], bank.logprobs[slots, 0] = first_token[:count], first_logprob[:count]
            bank.versions[slots, 0], bank.generated[slots] = version, 1
            for slot, row, _ in admission.entries if prompt_routing else ():  # prompts are left-padded
                bank.prompt_routing[slot] = prompt_routing[0][row, -len(admission.requests[row].prompt):]
            prefilled = sum(len(r.prompt) for r in admission.requests)
            stats["prefill_tokens"] += prefilled
            stats["prefill_tokens_saved"] += sum(len(admission.requests[row].prompt)
                                                 for _, row, _ in admission.entries) - prefilled
            stats["generated_tokens"] += count
        tokens, logprobs, generated, done, steps, *routing = chunk
        occupied = np.array([o is not None for o in bank.occupants])
        new = np.where(occupied, generated - bank.generated, 0)
        rows, cols = np.nonzero(np.arange(tokens.shape[1])[None, :] < new[:, None])
        at = bank.generated[rows] + cols
        bank.tokens[rows, at], bank.logprobs[rows, at], bank.versions[rows, at] = (tokens[rows, cols],
                                                                                  logprobs[rows, cols], version)
        if routing:  # the step that drew token `at` read token at - 1: its routing
            bank.routing[rows, at - 1] = routing[0][rows, cols]
        bank.generated += new
        stats["slot_steps"] += len(bank.occupants) * int(steps)
        stats["live_slot_steps"] += int(new.sum())
        stats["generated_tokens"] += int(new.sum())
        finished = []
        for slot in np.flatnonzero(occupied & done):
            request, sample = bank.occupants[slot]
            n = bank.generated[slot]
            reason = "stop" if int(bank.tokens[slot, n - 1]) in self.eos_ids else "length"
            routing = None
            if self.record_routing:
                routing = np.concatenate([bank.prompt_routing[slot], bank.routing[slot, :n - 1]])
            request.samples[sample] = (bank.tokens[slot, :n].copy(), bank.logprobs[slot, :n].copy(),
                                       bank.versions[slot, :n].copy(), reason, routing)
            self._free_slot(bank, slot)
            request.finished += 1
            if request.finished == len(request.keys):
                tokens_, logprobs_, versions_, reasons, routing_ = (list(x) for x in zip(*request.samples))
                finished.append(GroupResult(tag=request.tag, tokens=tokens_, logprobs=logprobs_, versions=versions_,
                                            finish_reasons=reasons,
                                            routing=routing_ if self.record_routing else None))
        return finished

    # -- device programs ------------------------------------------------------------------------------

    def _empty_state_impl(self, slots: int, ring: int) -> SlotState:
        self.num_compilations += 1  # runs only while tracing
        model = nnx.merge(self.graphdef, self.state)
        cache = model.init_cache(slots, ring, self.cache_heads, self.local_ring)
        if self.paged:  # full-attention layers: the bank's pool and its scratch page
            pool_shape = (self.cache_heads, self.bank_pages + 1, self.page_size, self.model_config.resolved_head_dim)
            cache = tuple(((jnp.zeros(pool_shape, model.compute_dtype),) * 2) if self._is_paged(i) else layer
                          for i, layer in enumerate(cache))
        return SlotState(cache=cache,
                         key_mask=jnp.zeros((slots, ring), bool),
                         local_key_mask=jnp.zeros((slots, self.local_ring), bool),
                         last_token=jnp.full((slots,), self.pad_id, jnp.int32),
                         position=jnp.zeros((slots,), jnp.int32), generated=jnp.zeros((slots,), jnp.int32),
                         limit=jnp.ones((slots,), jnp.int32), done=jnp.ones((slots,), bool),
                         keys=jnp.zeros((slots, 2), jnp.uint32), clock=jnp.zeros((), jnp.int32))

    def _resize_impl(self, state: SlotState, index) -> SlotState:
        """A bank of len(index) slots: slot i is the old slot index[i], or an empty one where index[i] < 0."""
        self.num_compilations += 1
        take = jnp.maximum(index, 0)
        empty = index < 0
        # An empty slot's cache and key mask are left as found: admission overwrites both. A page pool is the
        # bank's, not a slot's: it stays (the host reorders the page tables).
        cache = tuple(layer if self._is_paged(i) else jax.tree.map(lambda x: x[take], layer)
                      for i, layer in enumerate(state.cache))
        return SlotState(cache=cache, key_mask=state.key_mask[take],
                         local_key_mask=state.local_key_mask[take],
                         last_token=state.last_token[take], position=state.position[take],
                         generated=state.generated[take], limit=state.limit[take],
                         done=state.done[take] | empty, keys=state.keys[take], clock=state.clock)

    def _pinned(self, cache):
        """An admission's prefill cache held in the ring's layout (cache_layout); as it is without a mesh."""
        if self.cache_sharding is None:
            return cache
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.cache_sharding), cache)

    def _pinned_slots(self, cache):
        """A bank's cache (rings, page pools) held in the slot state's layout; as it is without a mesh."""
        if self.cache_sharding is None:
            return cache
        return tuple(jax.tree.map(lambda x, i=i: jax.lax.with_sharding_constraint(x, self._layer_cache_sharding(i)),
                                  layer) for i, layer in enumerate(cache))

    def _admit_impl(self, params, head, adapters, state: SlotState, page_table, tokens, mask, slot, source, keys,
                    limit, temperature, top_p, *, greedy, top_k, use_top_p):
        """Prefill the prompts [R, P] once, copy each entry's prompt keys/values into its slot (the P ring
        columns before the current one; with paged KV, positions 0 .. n - 1 of the slot's pages, page_table
        [S, pages per sequence]), and draw every entry's first token. Entries e: prompt row source[e] -> slot
        slot[e] (slot == S: unused), with its key and token limit."""
        self.num_compilations += 1
        model, lora = merged(self.graphdef, params, self.adapter_graphdef, adapters)
        rows, plen = tokens.shape
        hidden, prefill, prompt_routing = model.hidden_states_and_routing(
            tokens, positions_from_mask(mask), mask, self._pinned(model.init_cache(rows, plen, self.cache_heads)), 0,
            adapters=lora)
        logits = jnp.einsum("ve,re->vr", head, hidden[:, -1], preferred_element_type=jnp.float32)
        token, logprob = sample_logits(logits[:, source], draw_uniforms(keys, jnp.zeros_like(limit)), temperature,
                                       top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p, vocab_major=True)
        # An empty bank restarts its ring at 0: a batch that starts on empty slots is then laid out the same way
        # whatever ran before it (the order of attention's sums, and so the last bits, depends on the columns),
        # e.g. in a resumed run.
        clock = jnp.where(jnp.all(state.done), 0, state.clock)

        def columns(ring):  # the columns of the last min(plen, ring) prompt tokens: those before the current one
            kept = min(plen, ring)
            return plen - kept, (clock - kept + jnp.arange(kept)) % ring

        def place(cache, new):  # new [R, C, P, D] -> entries' slots; indexing puts [E, P] first: [E, P, C, D]
            first, cols = columns(cache.shape[2])
            at = (slot[:, None], slice(None), cols[None, :], slice(None))
            return cache.at[at].set(new[source, :, first:].transpose(0, 2, 1, 3).astype(cache.dtype), mode="drop")

        def marked(key_mask):
            first, cols = columns(key_mask.shape[1])
            key_mask = key_mask.at[slot].set(False, mode="drop")
            return key_mask.at[slot[:, None], cols[None, :]].set(mask[source, first:], mode="drop")

        if self.paged:  # column c of prompt row r is the prompt's position c - (its left padding)
            n_slots, per_sequence = page_table.shape
            position = jnp.arange(plen)[None, :] - (plen - mask.sum(-1))[source][:, None]  # [E, P]
            used = (position >= 0) & (slot[:, None] < n_slots)
            rows = page_table[jnp.minimum(slot, n_slots - 1)]
            page_of = jnp.take_along_axis(rows, jnp.clip(position // self.page_size, 0, per_sequence - 1), axis=1)
            page_of = jnp.where(used, page_of, self.bank_pages + 1)  # past the scratch page: dropped
            offset = jnp.maximum(position, 0) % self.page_size

        def place_paged(pool, new):  # new [R, C, P, D] -> pool [C, N, page, D] at [E, P] pages/offsets: [C, E, P, D]
            return pool.at[:, page_of, offset].set(new[source].transpose(1, 0, 2, 3).astype(pool.dtype), mode="drop")

        cache = tuple(((place_paged(k, pk), place_paged(v, pv)) if self._is_paged(i) else (place(k, pk), place(v, pv)))
                      for i, ((k, v), (pk, pv)) in enumerate(zip(state.cache, prefill)))
        key_mask = state.key_mask if self.paged else marked(state.key_mask)
        local_key_mask = marked(state.local_key_mask) if self.local_ring else state.local_key_mask
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)

        def put(x, value):
            return x.at[slot].set(value, mode="drop")

        state = SlotState(cache=cache, key_mask=key_mask, local_key_mask=local_key_mask,
                          last_token=put(state.last_token, token),
                          position=put(state.position, mask.sum(-1).astype(jnp.int32)[source]),
                          generated=put(state.generated, 1), limit=put(state.limit, limit),
                          done=put(state.done, jnp.isin(token, eos) | (limit <= 1)), keys=put(state.keys, keys),
                          clock=clock)
        if self.record_routing:
            return state, token, logprob, prompt_routing
        return state, token, logprob

    def _chunk_impl(self, params, head, adapters, state: SlotState, page_table, stop, temperature, top_p, *, steps,
                    greedy, top_k, use_top_p, cost_keys=0):
        """Up to `steps` decode steps for every slot (stopping early once all are done), the slots `stop` [S]
        marked done first (samples put back). Returns the new state and each slot's tokens and log-probs of this
        chunk ([S, steps]; a live slot's new tokens are a prefix of its row) and the steps run. page_table
        [S, pages per sequence]: with paged KV, each slot's pages (the host gave them room for `steps` keys).
        cost_keys: for grpo-jax compile's cost only (PagedKV.cost_keys)."""
        self.num_compilations += 1
        model, lora = merged(self.graphdef, params, self.adapter_graphdef, adapters)
        state = state._replace(done=state.done | stop)
        slots, ring = state.key_mask.shape
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
        config = model.config
        inv_freq = rope_inverse_frequencies(config)
        local_inv_freq = rope_inverse_frequencies(config, local=True)

        def body(carry):
            j, st, out_tokens, out_logprobs, out_routing = carry
            key_mask, column = st.key_mask, None
            if ring:
                column = st.clock % ring
                key_mask = jax.lax.dynamic_update_slice(key_mask, jnp.ones((slots, 1), bool), (0, column))
            paged = None
            if self.paged:  # this step writes each live slot's key at its position; a done slot's at the scratch page
                per_sequence = page_table.shape[1]
                page = jnp.take_along_axis(page_table, jnp.minimum(st.position // self.page_size,
                                                                   per_sequence - 1)[:, None], axis=1)[:, 0]
                paged = PagedKV(k_pages=None, v_pages=None, page_table=page_table, lengths=st.position + 1,
                                write_page=jnp.where(st.done, self.bank_pages, page), cost_keys=cost_keys)
            local_key_mask, local_column = st.local_key_mask, None
            if self.local_ring:
                local_column = st.clock % self.local_ring
                local_key_mask = jax.lax.dynamic_update_slice(local_key_mask, jnp.ones((slots, 1), bool),
                                                              (0, local_column))
            # The model's layers with this ring's mask (model.hidden_states builds a causal mask from the write
            # index, which a ring does not follow): every key marked in key_mask precedes the current token.
            x = model.embed_tokens(st.last_token[:, None])
            cache, used = [], []
            for i, layer in enumerate(model.layers):
                local = config.is_local(i)
                layer_cache = st.cache[i]
                if self._is_paged(i):
                    k_pages, v_pages = layer_cache
                    layer_cache = dataclasses.replace(paged, k_pages=k_pages, v_pages=v_pages)
                x, layer_cache, experts = layer(x, st.position[:, None],
                                                AttentionMask(key_mask=local_key_mask if local else key_mask),
                                                local_inv_freq if local else inv_freq, layer_cache,
                                                local_column if local else column,
                                                None if lora is None else lora.layers[i])
                if self._is_paged(i):
                    layer_cache = (layer_cache.k_pages, layer_cache.v_pages)
                cache.append(layer_cache)
                if experts is not None:
                    used.append(experts[:, 0])
            if self.record_routing:  # [S, moe layers, k]: the experts last_token went through
                out_routing = jax.lax.dynamic_update_slice(out_routing, jnp.stack(used, axis=1)[:, None],
                                                           (0, j, 0, 0))
            hidden = model.final_norm(x)[:, 0]
            logits = jnp.einsum("ve,se->vs", head, hidden, preferred_element_type=jnp.float32)
            token, logprob = sample_logits(logits, draw_uniforms(st.keys, st.generated), temperature, top_p,
                                           greedy=greedy, top_k=top_k, use_top_p=use_top_p, vocab_major=True)
            live = ~st.done
            token = jnp.where(live, token, self.pad_id)
            out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, j))
            out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, jnp.where(live, logprob, 0.0)[:, None], (0, j))
            generated = st.generated + live
            done = st.done | (live & jnp.isin(token, eos)) | (generated >= st.limit)
            st = st._replace(cache=self._pinned_slots(tuple(cache)), key_mask=key_mask, local_key_mask=local_key_mask,
                             last_token=jnp.where(live, token, st.last_token), position=st.position + live,
                             generated=generated, done=done, clock=st.clock + 1)
            return j + 1, st, out_tokens, out_logprobs, out_routing

        def cond(carry):
            j, st = carry[:2]
            return (j < steps) & ~jnp.all(st.done)

        out = (jnp.int32(0), state, jnp.full((slots, steps), self.pad_id, jnp.int32),
               jnp.zeros((slots, steps), jnp.float32), jnp.zeros((slots, steps, *self.routing_shape), jnp.int32))
        j, state, out_tokens, out_logprobs, out_routing = jax.lax.while_loop(cond, body, out)
        if self.record_routing:
            return state, out_tokens, out_logprobs, j, out_routing
        return state, out_tokens, out_logprobs, j


def make_generator(model: nnx.Module, eos_ids: Sequence[int], pad_id: int, config: SamplerConfig, *,
                   adapters: nnx.Module | None = None, slots: int = 0, version: int = 0) -> Sampler | Engine:
    """The actor's generator for sampler.engine: a continuous Engine (`slots` when sampler.slots is 0, weights
    of `version`) or the static Sampler."""
    if config.engine == "continuous":
        return Engine(model, eos_ids, pad_id, config, slots=config.slots or slots, adapters=adapters, version=version)
    return Sampler(model, eos_ids, pad_id, config, adapters=adapters)
