"""Per-device FLOPs and HBM bytes of a compiled program, read from its optimized HLO text, with every loop body
counted as many times as the loop runs, and broken down by where the bytes go.

XLA's own cost analysis (`compiled.cost_analysis()`) counts a while loop's body once whatever its trip count, so
a program whose work sits in loops (the learner step's scans over micro-batches, updates and log-prob chunks)
is undercounted by the trip counts. Here each instruction of the scheduled module is costed as XLA's
HloCostAnalysis costs it, to the precision a roofline needs, and a `while` with a `known_trip_count` (which XLA
annotates on every loop it can count: lax.scan, lax.map, fori_loop with static bounds) multiplies its body:

- bytes: what a top-level instruction reads and writes: its operands and its result. A fusion reads only the
  part of an operand that its dynamic-slices and slices take, and a fusion that updates a buffer in place
  (dynamic-update-slice at its root) writes only the update. Tuples, get-tuple-element, bitcasts, parameters
  and constants move nothing; an async collective is counted at its start.
- FLOPs: 2 per multiply-add of every dot and convolution, inside fusions too. Elementwise work is not counted:
  a roofline's FLOPs bound is the matmuls' (the elementwise work is in the bytes).
- A `conditional` costs its dearest branch; a `call` its computation.
- A custom call (a Pallas kernel) costs the `cost_estimate` its kernel states in the backend config (FLOPs and
  bytes, as megablox's grouped matmuls state them). Splash attention's kernels state none: their FLOPs are the
  matmuls of the blocks they compute, which the attention wrapper names in its scope (`splash_blocks_A_of_N`:
  A of the N query x key blocks are not masked whole, model.attention.splash_attention), and their bytes are
  their operands and results, read and written once. The paged-attention kernel reads only the pages a row
  holds: its scope names the keys per row (`paged_keys_K`, model.attention.paged_attention), from which its
  FLOPs (q k^T and p v over K keys) and bytes (K keys and values per row, the queries and the output) follow.

`Breakdown.parts` groups the bytes and FLOPs by the named scope of the model code that made each instruction
(`jax.named_scope`: the transformer's "attention", "mlp", ...; see SCOPES) and by the kind of instruction
(matmul, kernel, collective, copy, other), so the compile report can say what moves the bytes.

Pure Python over the HLO text: no JAX import, testable against NumPy-free references.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Element sizes in bytes by HLO primitive type.
ELEMENT_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
                 "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}

# The named scopes (jax.named_scope in the model and the learner) that a part of the breakdown is named by,
# innermost first: an instruction made under several (the LM head inside the log-probs) goes to the first.
SCOPES = ("lm_head", "logprobs", "attention", "mlp", "experts", "norm", "embed", "loss", "accumulate", "optimizer")

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "iota", "opt-barrier", "add-dependency", "domain"}

_NAME = re.compile(r"%([\w.\-]+)")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')
_SPLASH_KERNEL = re.compile(r"^splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_BLOCKS = re.compile(r"splash_blocks_(\d+)_of_(\d+)")
_PAGED_KEYS = re.compile(r"paged_keys_(\d+)")
_TYPED_SHAPE = re.compile(r"\b(bf16|f16|f32)\[([0-9,]+)\]")
# Matmuls of one query x key block per kernel, counted in multiply-adds of block_q x block_kv x head_dim: the forward
# kernel's q k^T and p v, the dq kernel's recomputed scores, d_p and d_q, the dkv kernel's scores, d_p, d_v, d_k.
SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's type text, e.g. "f32[8,128]{1,0}" or a tuple "(s32[], f32[4]{0})"
    opcode: str
    operands: tuple[str, ...]  # names of the operand instructions, in order
    arguments: str  # the text between the opcode's parentheses (a parameter's index)
    attributes: str  # the rest of the line: calls=, backend_config=, metadata=, ...
    root: bool

    @property
    def bytes(self) -> float:
        return shape_bytes(self.shape)

    def attribute(self, key: str) -> str:
        found = re.search(rf"\b{key}=(%[\w.\-]+|\{{[^}}]*\}}|[^,\s]+)", self.attributes)
        return found.group(1) if found else ""

    @property
    def called(self) -> tuple[str, ...]:
        """Computations this instruction runs: calls=, body=, condition=, branch_computations={...}, ..."""
        names = []
        for key in ("calls", "body", "condition", "to_apply", "true_computation", "false_computation",
                    "branch_computations"):
            value = self.attribute(key)
            names += _NAME.findall(value)
        return tuple(names)

    @property
    def op_name(self) -> str:
        found = re.search(r'op_name="([^"]*)"', self.attributes)
        return found.group(1) if found else ""


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}
        self._parameters = {int(i.arguments): i for i in self.instructions if i.opcode == "parameter"}

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions if i.root)

    def parameter(self, index: int) -> Instruction | None:
        return self._parameters.get(index)


@dataclasses.dataclass
class Part:
    flops: float = 0.0
    bytes: float = 0.0

    def add(self, flops: float, nbytes: float, times: float) -> None:
        self.flops += flops * times
        self.bytes += nbytes * times


@dataclasses.dataclass
class Breakdown:
    """A program's per-device FLOPs and bytes with loops counted, and the same split by (scope, kind)."""

    flops: float = 0.0
    bytes: float = 0.0
    parts: dict = dataclasses.field(default_factory=dict)  # (scope, kind) -> Part
    uncounted_loops: int = 0  # while loops without a known trip count, counted once as XLA does

    def add(self, scope: str, kind: str, flops: float, nbytes: float, times: float) -> None:
        self.flops += flops * times
        self.bytes += nbytes * times
        self.parts.setdefault((scope, kind), Part()).add(flops, nbytes, times)

    def largest(self, n: int = 6, by: str = "bytes") -> list[tuple[tuple[str, str], Part]]:
        return sorted(self.parts.items(), key=lambda kv: -getattr(kv[1], by))[:n]

    def as_dict(self) -> dict:
        return {"flops": self.flops, "bytes": self.bytes, "uncounted_loops": self.uncounted_loops,
                "parts": [[scope, kind, p.flops, p.bytes] for (scope, kind), p in self.parts.items()]}

    @classmethod
    def from_dict(cls, d: dict) -> Breakdown:
        return cls(d["flops"], d["bytes"], {(s, k): Part(f, b) for s, k, f, b in d["parts"]}, d["uncounted_loops"])


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([0-9,]*)(?::T\((\d+(?:,\d+)*)\))?[^}]*\})?")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO type text, an array or the sum over a tuple's arrays, as laid out: a TPU layout's tile
    (`{1,0:T(8,128)}`) rounds its most minor dimensions up to the tile, as the device stores them."""
    total = 0.0
    for dtype, dims, minor_to_major, tile in _ARRAY.findall(shape):
        sizes = [int(d) for d in dims.split(",") if d]
        if tile and minor_to_major:
            order = [int(d) for d in minor_to_major.split(",") if d]
            for dim, t in zip(order, reversed([int(t) for t in tile.split(",")])):
                sizes[dim] = -(-sizes[dim] // t) * t
        total += ELEMENT_BYTES.get(dtype, 4) * math.prod(sizes)
    return total


def shape_dims(shape: str) -> tuple[int, ...]:
    found = _ARRAY.search(shape)
    return tuple(int(d) for d in found.group(2).split(",") if d) if found else ()


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """The module's computations by name, and the entry computation's name."""
    computations, entry, current, instructions = {}, "", None, []
    for line in _logical_lines(text):
        header = _HEADER.match(line)
        if header:
            current, instructions = header.group(2), []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            computations[current] = Computation(current, instructions)
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if found:
            name, shape, opcode, rest = found.groups()
            depth, end = 1, len(rest)
            for k, ch in enumerate(rest):  # the operand list ends at the parenthesis that closes it
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    end = k
                    break
            instructions.append(Instruction(name, shape, opcode, tuple(_NAME.findall(rest[:end])), rest[:end],
                                            rest[end + 1:], line.lstrip().startswith("ROOT")))
    return computations, entry


def _logical_lines(text: str) -> list[str]:
    """The module's lines with an instruction's continuation lines (a kernel's multi-line frontend attributes)
    joined to it."""
    lines: list[str] = []
    for line in text.splitlines():
        continued = lines and line.strip() != "}" and not _HEADER.match(line) and not _INSTRUCTION.match(line) \
            and _INSTRUCTION.match(lines[-1])
        if continued:
            lines[-1] += line
        else:
            lines.append(line)
    return lines


def custom_call_cost(instruction: Instruction) -> tuple[float, float] | None:
    """FLOPs and bytes of a kernel that states them or that splash_flops counts (bytes None then: its operands
    and result), else None."""
    found = _COST_ESTIMATE.search(instruction.attributes)
    if found:
        return float(found.group(1)), float(found.group(2))
    paged = paged_cost(instruction)
    if paged is not None:
        return paged
    flops = splash_flops(instruction)
    return None if flops is None else (flops, None)


def _operand_shapes(instruction: Instruction) -> list[tuple[str, tuple[int, ...]]]:
    """The floating-point operands' types and shapes, in order, from the kernel's operand layout constraints."""
    start = instruction.attributes.find("operand_layout_constraints={")
    if start < 0:
        return []
    constraints = instruction.attributes[start:instruction.attributes.find("}}", start)]
    return [(kind, tuple(int(n) for n in dims.split(","))) for kind, dims in _TYPED_SHAPE.findall(constraints)]


def paged_cost(instruction: Instruction) -> tuple[float, float] | None:
    """A paged-attention kernel's FLOPs and bytes at the keys per row its scope names: from its query operand
    ([rows, kv heads, query heads per kv head, head_dim], its first floating-point operand) and its key pages
    ([kv heads, pages, page size, head_dim]); None for another kernel."""
    keys = _PAGED_KEYS.search(instruction.op_name)
    shapes = _operand_shapes(instruction)
    if not keys or len(shapes) < 2 or len(shapes[0][1]) != 4 or len(shapes[1][1]) != 4:
        return None
    (q_type, q), (k_type, k) = shapes[0], shapes[1]
    rows, kv, groups, dim = q
    per_row = int(keys.group(1))
    flops = 2.0 * 2 * rows * kv * groups * per_row * dim
    nbytes = (2.0 * rows * per_row * k[0] * dim * ELEMENT_BYTES[k_type]  # keys and values read
              + 2.0 * rows * kv * groups * dim * ELEMENT_BYTES[q_type])  # queries in, output out
    return flops, nbytes


def splash_flops(instruction: Instruction) -> float | None:
    """A splash-attention kernel's FLOPs: its matmuls (SPLASH_MATMULS) over the blocks it computes, from its
    query and key operands' shapes ([..., heads, queries, head_dim], [..., kv_heads, keys, head_dim], the first
    two floating-point operands) and the unmasked share of blocks its scope names; None for another kernel."""
    kernel = _SPLASH_KERNEL.match(instruction.name)
    blocks = _SPLASH_BLOCKS.search(instruction.op_name)
    shapes = [shape for _, shape in _operand_shapes(instruction)]
    if not kernel or not blocks or len(shapes) < 2 or len(shapes[0]) < 3 or len(shapes[1]) < 3:
        return None
    q, k = shapes[0], shapes[1]
    share = int(blocks.group(1)) / int(blocks.group(2))
    return 2.0 * SPLASH_MATMULS[kernel.group(1)] * math.prod(q[:-1]) * k[-2] * q[-1] * share


def _trip_count(loop: Instruction, computations: dict[str, Computation], outer: Computation) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` annotation (CPU, GPU); else (TPU, which leaves it out)
    read from the loop itself, when its condition is `counter < N` (or `N > counter`) on a tuple element that
    starts at a constant and to which the body adds a constant step (lax.scan, lax.map and static fori_loop
    all compile to this, and so do the TPU compiler's own loops). None when neither."""
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if found:
        return int(found.group(1))
    condition = computations.get(loop.attribute("condition").lstrip("%"))
    if condition is None:
        return None
    compare = condition.root
    operands = [condition.by_name.get(o) for o in compare.operands]
    if compare.opcode == "fusion":  # the comparison fused: map the fusion's parameters to its operands
        fused = computations.get(compare.attribute("calls").lstrip("%"))
        if fused is None or fused.root.opcode != "compare":
            return None
        inner = [fused.by_name.get(o) for o in fused.root.operands]
        if any(i is None or i.opcode != "parameter" for i in inner):
            return None
        operands = [operands[int(i.arguments)] for i in inner]
        compare = fused.root
    if compare.opcode != "compare" or len(operands) != 2 or any(o is None for o in operands):
        return None
    direction = compare.attribute("direction")
    counter, limit = operands if direction == "LT" else operands[::-1] if direction == "GT" else (None, None)
    if counter is None or counter.opcode != "get-tuple-element" or limit.opcode != "constant":
        return None
    index = int(counter.attribute("index"))
    step = _counter_step(computations.get(loop.attribute("body").lstrip("%")), index)
    if step is None:
        return None
    start = 0
    init = outer.by_name.get(loop.operands[0]) if loop.operands else None
    if init is not None and init.opcode == "tuple" and index < len(init.operands):
        element = _through_copies(outer, init.operands[index])
        if element is not None and element.opcode == "constant":
            start = int(element.arguments)
    return max(0, -(-(int(limit.arguments) - start) // step))


def _through_copies(computation: Computation, name: str) -> Instruction | None:
    element = computation.by_name.get(name)
    while element is not None and element.opcode == "copy":
        element = computation.by_name.get(element.operands[0])
    return element


def _counter_step(body: Computation | None, index: int) -> int | None:
    """What the loop body adds to tuple element `index` (its counter) each trip: 1 for lax.scan, 2 for a loop
    the compiler unrolled twice (TPU's windowed einsums); None when the body does not add a constant to it."""
    if body is None or body.root.opcode != "tuple" or index >= len(body.root.operands):
        return None
    update = body.by_name.get(body.root.operands[index])
    if update is None or update.opcode != "add":
        return None
    parts = [_through_copies(body, o) for o in update.operands]
    constant = next((p for p in parts if p is not None and p.opcode == "constant"), None)
    counter = next((p for p in parts if p is not None and p.opcode == "get-tuple-element"), None)
    if constant is None or counter is None or int(counter.attribute("index")) != index:
        return None
    step = int(constant.arguments)
    return step if step > 0 else None


def dot_flops(instruction: Instruction, computation: Computation) -> float:
    """2 x result elements x contracted elements, for a dot or a convolution."""
    out = math.prod(shape_dims(instruction.shape))
    lhs = computation.by_name.get(instruction.operands[0]) if instruction.operands else None
    if instruction.opcode == "dot":
        dims = shape_dims(lhs.shape) if lhs is not None else ()
        contracting = instruction.attribute("lhs_contracting_dims").strip("{}")
        size = math.prod(dims[int(d)] for d in contracting.split(",") if d) if dims else 1
        return 2.0 * out * size
    rhs = computation.by_name.get(instruction.operands[1]) if len(instruction.operands) > 1 else None
    labels = instruction.attribute("dim_labels")
    if lhs is None or rhs is None or "_" not in labels:
        return 0.0
    lhs_labels, rest = labels.split("_", 1)
    kernel_labels, out_labels = rest.split("->")
    lhs_dims, kernel, out_dims = shape_dims(lhs.shape), shape_dims(rhs.shape), shape_dims(instruction.shape)
    # Multiply-adds per output element: the kernel's input features times, per spatial dimension, the valid
    # (output position, window position) pairs over the output positions (padding and dilation hold none).
    macs = math.prod(size for label, size in zip(out_labels, out_dims) if not label.isdigit())
    macs *= kernel[kernel_labels.index("i")]
    window = _window(instruction.attribute("window"))
    for spatial in sorted(label for label in out_labels if label.isdigit()):
        k = int(spatial)
        size = kernel[kernel_labels.index(spatial)]
        w = window[k] if k < len(window) else {}
        macs *= _valid_pairs(out_dims[out_labels.index(spatial)], size, lhs_dims[lhs_labels.index(spatial)],
                             w.get("stride", 1), w.get("pad", (0, 0))[0], w.get("lhs_dilate", 1),
                             w.get("rhs_dilate", 1))
    return 2.0 * macs / int(instruction.attribute("batch_group_count") or 1)


def _window(text: str) -> list[dict]:
    """A convolution's window attribute, per spatial dimension: stride, pad (low, high), lhs_dilate, rhs_dilate."""
    fields = dict(re.findall(r"(\w+)=([\dx_\-]+)", text.strip("{}")))
    n = len(fields.get("size", "").split("x")) if fields.get("size") else 0
    dims = [{} for _ in range(n)]
    for key in ("stride", "lhs_dilate", "rhs_dilate"):
        for d, value in enumerate(fields.get(key, "").split("x") if key in fields else []):
            dims[d][key] = int(value)
    for d, value in enumerate(fields["pad"].split("x") if "pad" in fields else []):
        low, high = value.split("_")
        dims[d]["pad"] = (int(low), int(high))
    return dims


def _valid_pairs(out: int, window: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                 rhs_dilate: int) -> int:
    """How many (output position, window position) pairs of one spatial dimension read an input element."""
    dilated = (size - 1) * lhs_dilate + 1
    total = 0
    for k in range(window):
        offset = k * rhs_dilate - pad_low  # input position = o * stride + offset
        if lhs_dilate == 1:
            low = max(0, -(-(-offset) // stride)) if offset < 0 else 0
            high = min(out - 1, (dilated - 1 - offset) // stride) if dilated - 1 - offset >= 0 else -1
            total += max(0, high - low + 1)
        else:
            total += sum(1 for o in range(out) if 0 <= o * stride + offset < dilated
                         and (o * stride + offset) % lhs_dilate == 0)
    return total


class _Walker:
    def __init__(self, text: str, count_loops: bool = True):
        self.count_loops = count_loops
        self.computations, self.entry = parse_module(text)
        self.result = Breakdown()
        self._fusion_flops: dict[str, float] = {}
        self._fusion_opcodes: dict[str, frozenset[str]] = {}

    def walk(self) -> Breakdown:
        self._computation(self.entry, 1.0)
        return self.result

    def _computation(self, name: str, times: float) -> None:
        computation = self.computations[name]
        for instruction in computation.instructions:
            self._instruction(instruction, computation, times)

    def _instruction(self, instruction: Instruction, computation: Computation, times: float) -> None:
        op = instruction.opcode
        if op in FREE or op.endswith("-done") or op.endswith("-update"):
            return
        if op == "while":
            body, condition = instruction.attribute("body"), instruction.attribute("condition")
            trips = _trip_count(instruction, self.computations, computation)
            if trips is None:
                self.result.uncounted_loops += 1
            if trips is None or not self.count_loops:
                trips = 1
            for called in (body, condition):
                self._computation(called.lstrip("%"), times * trips)
            return
        if op == "conditional":
            outer, costs = self.result, []
            for branch in instruction.called:
                self.result = Breakdown()
                self._computation(branch, 1.0)
                costs.append(self.result)
            self.result = outer
            dearest = max(costs, key=lambda b: (b.bytes, b.flops), default=Breakdown())
            for (scope, kind), part in dearest.parts.items():
                self.result.add(scope, kind, part.flops, part.bytes, times)
            self.result.uncounted_loops += dearest.uncounted_loops
            return
        if op in ("call", "async-start") and instruction.called:
            for called in instruction.called:
                self._computation(called, times)
            return
        scope, kind = self._scope(instruction), self._kind(instruction)
        flops = 0.0
        if op == "fusion":
            flops = self._flops_inside(instruction.attribute("calls").lstrip("%"))
            nbytes = self._fusion_bytes(instruction, computation)
        else:
            if op in ("dot", "convolution"):
                flops = dot_flops(instruction, computation)
            nbytes = self._plain_bytes(instruction, computation)
            if op == "custom-call":
                stated = custom_call_cost(instruction)
                if stated is not None:
                    flops, nbytes = stated[0], nbytes if stated[1] is None else stated[1]
        self.result.add(scope, kind, flops, nbytes, times)

    def _operand_bytes(self, name: str, computation: Computation) -> float:
        operand = computation.by_name.get(name)
        return operand.bytes if operand is not None else 0.0

    def _plain_bytes(self, instruction: Instruction, computation: Computation) -> float:
        op = instruction.opcode
        result = instruction.bytes
        if op.endswith("-start"):  # an async pair's start: its result tuple holds its operands and its result
            return result
        if op in ("dynamic-slice", "slice", "gather"):
            return 2 * result
        if op in ("dynamic-update-slice", "scatter"):
            update = self._operand_bytes(instruction.operands[1 if op == "dynamic-update-slice" else 2],
                                         computation)
            return 2 * update
        return sum(self._operand_bytes(o, computation) for o in instruction.operands) + result

    def _fusion_bytes(self, instruction: Instruction, computation: Computation) -> float:
        fused = self.computations.get(instruction.attribute("calls").lstrip("%"))
        if fused is None:
            return self._plain_bytes(instruction, computation)
        in_place = set()
        written = instruction.bytes
        root = fused.root
        roots = [fused.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
        if any(r.opcode == "dynamic-update-slice" for r in roots):
            written = 0.0
            for r in roots:
                if r.opcode == "dynamic-update-slice":
                    target = fused.by_name.get(r.operands[0])
                    if target is not None and target.opcode == "parameter":
                        in_place.add(target.name)
                    written += self._operand_bytes(r.operands[1], fused)
                else:
                    written += r.bytes
        read = 0.0
        users = _users(fused)
        for index, operand in enumerate(instruction.operands):
            parameter = fused.parameter(index)
            full = self._operand_bytes(operand, computation)
            if parameter is None:
                read += full
                continue
            if parameter.name in in_place:
                continue
            uses = users.get(parameter.name, [])
            if uses and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == parameter.name
                            for u in uses):
                read += min(full, sum(u.bytes for u in uses))
            else:
                read += full
        return read + written

    def _flops_inside(self, name: str) -> float:
        if name not in self._fusion_flops:
            computation = self.computations.get(name)
            total = 0.0
            if computation is not None:
                for i in computation.instructions:
                    if i.opcode in ("dot", "convolution"):
                        total += dot_flops(i, computation)
                    elif i.opcode == "fusion":
                        total += self._flops_inside(i.attribute("calls").lstrip("%"))
            self._fusion_flops[name] = total
        return self._fusion_flops[name]

    def _fusion_has(self, name: str, opcodes: tuple[str, ...]) -> bool:
        return not self._opcodes_inside(name).isdisjoint(opcodes)

    def _opcodes_inside(self, name: str) -> frozenset[str]:
        """The opcodes of a fused computation, nested fusions included (once per computation: a loop body's
        fusions are met again on every walk of it)."""
        if name not in self._fusion_opcodes:
            computation = self.computations.get(name)
            found = set()
            for i in computation.instructions if computation is not None else ():
                found.add(i.opcode)
                if i.opcode == "fusion":
                    found |= self._opcodes_inside(i.attribute("calls").lstrip("%"))
            self._fusion_opcodes[name] = frozenset(found)
        return self._fusion_opcodes[name]

    def _kind(self, instruction: Instruction) -> str:
        op = instruction.opcode.removesuffix("-start")
        if op in COLLECTIVES:
            return "collective"
        if op in ("dot", "convolution"):
            return "matmul"
        if op == "custom-call" and custom_call_cost(instruction) is not None:
            return "kernel"
        if op == "fusion":
            called = instruction.attribute("calls").lstrip("%")
            if self._fusion_has(called, ("dot", "convolution")):
                return "matmul"
            if self._fusion_has(called, COLLECTIVES):
                return "collective"
        if op in ("copy", "transpose"):
            return "copy"
        return "other"

    @staticmethod
    def _scope(instruction: Instruction) -> str:
        """The instruction's named scope (SCOPES), and " (backward)" for the gradient's (transposed) work."""
        name = instruction.op_name
        words = set(re.findall(r"[A-Za-z_]+", name))
        scope = next((s for s in SCOPES if s in words), "other")
        return scope + " (backward)" if "transpose" in words else scope


def _users(computation: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for i in computation.instructions:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def program_cost(hlo_text: str, count_loops: bool = True) -> Breakdown:
    """The compiled program's per-device FLOPs and bytes, every loop body counted as often as it runs
    (count_loops=False: once, as XLA's cost analysis counts it; the tests compare the two)."""
    return _Walker(hlo_text, count_loops).walk()
