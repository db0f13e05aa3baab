"""Byte accounting of tensor storage on any device (CPU has no allocator statistics to ask).

What the predictor's memory model counts, measured on real modules:

* training state: parameters, their gradients and the optimizer's per-parameter state (for AdamW
  ``exp_avg`` and ``exp_avg_sq``; the one-element ``step`` counters are left out, 4 bytes per
  tensor, because the predictor counts bytes per parameter);
* activations: the tensors autograd saves for backward during a forward, caught with
  ``torch.autograd.graph.saved_tensors_hooks``; storages are counted once (views share them) and
  parameters (which linear layers save too) are excluded, as they are already counted above; so
  are parameters' cast copies under mixed precision, which are counted on their own
  (:class:`WeightCopies`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return str(t.device), s.data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Parameters, gradients (where allocated) and per-parameter optimizer state of ``model``."""
    params = list(model.parameters())
    # Gradients: .grad, and the fp32 main grads a 16-bit parameter accumulates into (runtime/grad_buffer.py).
    grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    opt: list[torch.Tensor] = []
    if optimizer is not None:
        # The optimizer's own tensors: the model's parameters, or a sharded run's owned pieces (runtime/zero.py).
        for p in (t for g in optimizer.param_groups for t in g["params"]):
            for v in optimizer.state.get(p, {}).values():
                # Per-parameter moments have the parameter's shape; scalar step counters do not.
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    opt.append(v)
    return StateBytes(storage_bytes(params), storage_bytes(grads), storage_bytes(opt))


class WeightCopies:
    """Recognises a saved storage that holds a parameter cast to another dtype: the compute-dtype
    copies autocast's weight cache makes (and ZB-H1's split GEMMs, ``runtime/weight_grad.cast_weight``).
    They are per-parameter, not per-token memory (the memory model counts them with the weights), so
    the activation counts keep them apart. A storage is such a copy when it has as many elements as a
    parameter of another dtype and holds exactly that parameter's values cast (each storage is
    checked once, when first saved)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.by_numel: dict[int, list[torch.Tensor]] = {}
        for p in params:
            self.by_numel.setdefault(p.numel(), []).append(p)

    def holds_copy(self, t: torch.Tensor) -> bool:
        s = t.untyped_storage()
        if not t.is_floating_point() or s.nbytes() % t.element_size():
            return False
        candidates = [p for p in self.by_numel.get(s.nbytes() // t.element_size(), ()) if p.dtype != t.dtype]
        if not candidates:
            return False
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(s)
        return any(torch.equal(flat, p.detach().reshape(-1).to(t.dtype)) for p in candidates)


@dataclass
class SavedTensors:
    """Collects the storages autograd saves for backward inside :func:`saved_for_backward`:
    activations in ``storages``, parameters' cast copies in ``copies``."""

    exclude: set[tuple[str, int]] = field(default_factory=set)
    storages: dict[tuple[str, int], int] = field(default_factory=dict)
    copies: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    @property
    def copy_bytes(self) -> int:
        return sum(self.copies.values())


@contextmanager
def saved_for_backward(exclude: Iterable[torch.Tensor] = (), *, weights: Iterable[torch.Tensor] = ()
                       ) -> Iterator[SavedTensors]:
    """Count the bytes autograd keeps for backward of the forwards run inside the block.

    ``exclude``: tensors whose storage is accounted elsewhere (the module's parameters and buffers).
    ``weights``: parameters whose cast copies are counted apart from the activations
    (:class:`WeightCopies`).
    """
    rec = SavedTensors(exclude={_storage_key(t) for t in exclude})
    copies = WeightCopies(weights)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key not in rec.exclude and key not in rec.storages and key not in rec.copies:
                into = rec.copies if copies.holds_copy(t) else rec.storages
                into[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield rec


class LiveSavedTensors:
    """Peak bytes of the tensors autograd holds for backward *at the same time*, over a whole schedule.

    Unlike :func:`saved_for_backward` (everything one forward saves), this follows each saved storage
    until autograd releases it (after its backward), so under 1F1B or GPipe the peak is what the
    stage holds for its in-flight micro-batches. Use as ``with tracker.active(): run_schedule()``.
    Parameters' cast copies (``weights``: :class:`WeightCopies`) are followed apart: ``copy_peak_bytes``.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, weights: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {_storage_key(t) for t in exclude}
        self.copies = WeightCopies(weights)
        self.live: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, holders, is a weight copy]
        self.current_bytes = self.peak_bytes = 0
        self.copy_bytes = self.copy_peak_bytes = 0

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            if entry[2]:
                self.copy_bytes -= entry[0]
            else:
                self.current_bytes -= entry[0]
            del self.live[key]

    def _pack(self, t: torch.Tensor) -> object:
        if t.device.type == "meta":
            return t
        key = _storage_key(t)
        if key in self.exclude:
            return t
        entry = self.live.get(key)
        if entry is None:
            copy = self.copies.holds_copy(t)
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0, copy]
            if copy:
                self.copy_bytes += entry[0]
                self.copy_peak_bytes = max(self.copy_peak_bytes, self.copy_bytes)
            else:
                self.current_bytes += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        return _Held(t, self, key)

    @contextmanager
    def active(self) -> Iterator[LiveSavedTensors]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, _Held) else h):
            yield self


class _Held:
    """A saved tensor's stand-in: autograd drops it when it frees the saved tensor, which releases it."""

    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: LiveSavedTensors, key: tuple[str, int]) -> None:
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self) -> None:
        self.tracker._release(self.key)
