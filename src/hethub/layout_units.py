"""Parameter units (``embed``, ``pos``, ``layer.<i>``, ``final_norm``, ``head``): which a stage holds,
their parameter names, the order gradients are reduced in, Megatron's gradient buckets, the ZeRO-1
split of a bucket among its owners and which units ZeRO-3 gathers. Used by the layout (layout.py),
the runtime's gradient sync and optimizer sharding, and the predictor's sync model. Pure Python."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from hethub.layout_parts import StagePlace


def stage_units(stage: StagePlace, *, tied: bool, learned_pos: bool) -> tuple[str, ...]:
    """The units a stage holds, in module order."""
    return _units(stage.layer_ranges, embedding=stage.embedding, head=stage.head, tied=tied, learned_pos=learned_pos)


# Cached: a large plan has thousands of stages but few distinct (layers, embedding, head) shapes.
@functools.lru_cache(maxsize=4096)
def _units(ranges: tuple[tuple[int, int], ...], *, embedding: bool, head: bool, tied: bool,
           learned_pos: bool) -> tuple[str, ...]:
    units: list[str] = []
    if embedding:
        units.append("embed")
        if learned_pos:
            units.append("pos")
    units += [f"layer.{i}" for a, b in ranges for i in range(a, b)]
    if head:
        units.append("final_norm")
        if not tied:
            units.append("head")
        elif "embed" not in units:
            units.append("embed")  # the tied head holds the embedding under its own name
    return tuple(units)


_MODULE_OF_UNIT = {"embed": "embed", "pos": "pos", "final_norm": "norm", "head": "head"}
_UNIT_OF_MODULE = {m: u for u, m in _MODULE_OF_UNIT.items()}


def unit_of(param_name: str) -> str:
    """Map a parameter name of the stage module to its unit."""
    parts = param_name.split(".")
    if parts[0] == "layers":
        return f"layer.{parts[1]}"
    return _UNIT_OF_MODULE[parts[0]]


def unit_param_prefix(unit: str) -> str:
    """The name every parameter of ``unit`` starts with in a stage module (the inverse of ``unit_of``);
    the runtime walks parameters sorted by name, so this orders the gradient syncs."""
    if unit.startswith("layer."):
        return f"layers.{unit[len('layer.'):]}"
    return _MODULE_OF_UNIT[unit]


# Megatron-LM's default data-parallel bucket (``--ddp-bucket-size``: 40M elements, 160 MB of fp32
# gradients): large enough to amortise a collective's latency, small enough that the backward still
# has work left to hide the next bucket behind.
DEFAULT_BUCKET_ELEMS = 40_000_000


def unit_position(unit: str, *, num_layers: int) -> int:
    """A unit's place in the forward pass: embedding, positions, layers 0..L-1, final norm, head."""
    if unit.startswith("layer."):
        return 2 + int(unit[len("layer."):])
    return {"embed": 0, "pos": 1, "final_norm": num_layers + 2, "head": num_layers + 3}[unit]


def reduction_key(param_name: str, *, num_layers: int) -> tuple[int, str]:
    """Sort key of a parameter in the gradient reduction order: units in reverse forward order (the
    order the backward makes their gradients final), then by name. Every rank sorts its gradient
    buckets by it, so ranks sharing a group issue their collectives in the same order (NCCL requires
    it). A tied head's embedding matrix sorts with the embedding, last."""
    return (-unit_position(unit_of(param_name), num_layers=num_layers), param_name)


def bucket_ranges(numels: list[int] | tuple[int, ...], *, cap_elems: int) -> list[tuple[int, int]]:
    """Consecutive items ``[i, j)`` of each bucket over tensors of these sizes, in order: a bucket
    closes once it holds at least ``cap_elems`` elements (Megatron's rule: a tensor is never split, so
    one larger than the cap is a bucket of its own)."""
    if cap_elems < 1:
        raise ValueError(f"the gradient bucket size must be >= 1 element, got {cap_elems}")
    out, start, acc = [], 0, 0
    for i, n in enumerate(numels):
        acc += n
        if acc >= cap_elems:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(numels):
        out.append((start, len(numels)))
    return out


def split_elems(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` elements split in proportion to ``weights`` (largest remainder; ties to the earlier
    member), summing to ``n`` exactly: a bucket's slices among its ZeRO-1 owners, sized the same by
    the runtime and the memory model. Zero weights get nothing unless every weight is zero (then
    equal shares)."""
    w = list(map(max, itertools.repeat(0.0), map(float, weights)))
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(weights), float(len(weights))
    # Members of equal weight (a stage's ranks, replicas' stages) have equal shares: each distinct
    # weight's share and remainder found once.
    exact = {x: n * x / total for x in set(w)}
    whole = {x: int(e) for x, e in exact.items()}
    sizes = list(map(whole.__getitem__, w))
    left = n - sum(sizes)
    if left:
        # Largest remainder first, ties to the earlier member (a stable sort keeps index order).
        behind = {x: -(e - whole[x]) for x, e in exact.items()}
        for i in sorted(range(len(w)), key=list(map(behind.__getitem__, w)).__getitem__)[:left]:
            sizes[i] += 1
    return sizes


# ZeRO-2/3's rounds of gradient reductions a rank keeps in flight at once (runtime/zero_grads.py), which
# the memory model counts.
ZERO_IN_FLIGHT_ROUNDS = 2


def gathers_params(positions: Sequence[tuple[int, int]]) -> bool:
    """Whether ZeRO-3 shards the parameters of a unit whose holder stages sit at these positions
    ((stage index, stages in its pipeline) each; runtime/zero_params.py): two or more holders, all at
    the same position of pipelines of the same depth. Their forwards and
    backwards then run in one order, so gathering before each use (a collective of all holders) pairs
    up; holders at different positions interleave them differently (a last stage runs B(0) before
    F(1), a first stage F(1) before B(0)) and per-use gathers would wait on each other in a cycle, so
    such a unit keeps its parameters whole (its gradients and optimizer state stay sharded)."""
    return len(positions) > 1 and len(set(positions)) == 1
