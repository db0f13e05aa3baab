"""ZeRO-3's parameters: each unit (a decoder layer, the embedding, the final norm, the head) gathered
from its owners before each use and released after, with the next one prefetched.

A unit's parameters on a rank share one flat storage (FSDP's flat parameter) in its sync group's
layout order, each parameter a view of it. Between uses the storage is resized to zero bytes: the
parameter objects (and every tensor autograd saved of them) stay, their memory goes. A gather gives
the storage its bytes back, writes this rank's owned part from its fp32 masters (rounded to the
parameters' dtype) and broadcasts each other owner's part, one broadcast per owner: an owner's
slice of the group (``runtime/zero.py``) is one consecutive range of its layout, so its part of a
unit is one consecutive range too and unequal parts need no padding (a broadcast moves the bytes of
an all-gather's ring pass). Across vendor islands a part crosses the bridge once per other island
(``comm/hierarchical.StartedBroadcast``). Where the holders' TP degrees or parameter dtypes differ,
the parts land in a staging tensor in the group's full-size layout and each rank copies its shard.

Which units: those whose holders all sit at the same position of pipelines of the same depth
(``hethub.layout.gathers_params``: per-use gathers at different positions would wait on each other in
a cycle); any other unit keeps its parameters whole on every holder, its gradients and optimizer state
sharded as under ZeRO-2.

When, per rank:

* forward (an F op): at its start the op's embedding/norm/head units, then layer 0 prefetched; each
  layer's forward waits for its gather, prefetches the next layer and releases itself after;
* backward (a B op): at its start (the stage output's gradient) the head units and a tied embedding
  (an untied embedding's backward reads no weights), the last layer prefetched; each layer's backward
  (its output's gradient) waits, prefetches the previous layer, and releases when its input's
  gradient is done. A recomputed forward inside the backward finds its layer gathered. ZB-H1's W
  reads no weights. Units left gathered are released at the next op's start and after the step's
  last backward.

Every holder of a group gathers its units the same number of times in the same order on each of two
process groups (channels): forward gathers on one, backward gathers on the other, since holders at
different pipeline positions interleave forwards and backwards differently while each kind of op
runs micro-batch after micro-batch (the plan requires equal micro-batch counts and one layer range
per stage, ``plan._check_zero23``).

Before the first forward the parameters are whole (weights loaded from a checkpoint or Hugging Face
land in them and their masters); the first op releases them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.layout import Topology, block_starts, gathers_params, unit_of, unit_position
from hethub.runtime.model import StageModel

FORWARD, BACKWARD = "zero3-forward", "zero3-backward"  # the two channels of the module doc


def sync_lines(topo: Topology) -> list[tuple[int, ...]]:
    """Every gradient-sync group of more than one rank, in the topology's creation order."""
    seen: dict[tuple[int, ...], None] = {}
    for unit, holders in topo.unit_holders.items():
        for st in holders:
            for r in st.ranks:
                g = topo.sync_group(unit, r).ranks
                if len(g) > 1:
                    seen.setdefault(g, None)
    return list(seen)


@dataclass
class _Unit:
    name: str
    zb: Any  # its group's sharding (runtime/zero._Bucket)
    idx: list[int]  # its parameters' indices in zb.params (consecutive in the layout)
    lo: int  # its element range [lo, hi) in the group's layout
    hi: int
    flat: torch.Tensor  # this rank's storage of its parameters
    direct: bool  # parts broadcast straight into ``flat`` (same layout and dtype on every holder)
    parts: list[tuple[int, int, int]] = field(default_factory=list)  # (member, a, b): nonempty owner ranges
    works: list[Any] | None = None
    staged: torch.Tensor | None = None
    gathered: bool = False

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ZeroParams:
    """The gathers of one rank (module doc); ``zero``: its Zero3Sync (pieces, masters, layout)."""

    def __init__(self, zero: Any, *, topo: Topology) -> None:
        self.zero, self.comm, self.model = zero, zero.comm, zero.model
        model: StageModel = self.model
        for channel in (FORWARD, BACKWARD):  # collective: every rank, every group, the same order
            self.comm.create_groups(sync_lines(topo), channel=channel)
        self.units: dict[str, _Unit] = {}
        for zb in zero.buckets:
            holders = topo.unit_holders[unit_of(zb.params[0][0])]
            if gathers_params([(st.stage, st.num_stages) for st in holders]):
                self._build(zb)
        num_layers = model.spec.num_layers
        order = sorted(self.units, key=lambda u: unit_position(u, num_layers=num_layers))
        layers = [u for u in order if u.startswith("layer.")]
        tied = model.spec.tied_embeddings
        # Each op's gathers in the order its data flows (module doc): groups gathered together.
        front = [u for u in order if u in ("embed", "pos") and model.has_embedding]
        tail = [u for u in order if u in ("final_norm", "head") or (u == "embed" and not model.has_embedding)]
        back = [u for u in order if u in ("final_norm", "head") or (u == "embed" and tied)]
        self.forward = [g for g in (front, *([u] for u in layers), tail) if g]
        self.backward = [g for g in (back, *([u] for u in reversed(layers))) if g]
        self.whole = True  # until the first op
        self.phase = ""
        self.live_bytes = self.peak_bytes = 0
        model.register_forward_pre_hook(self._op_start)
        model.register_forward_hook(self._op_end)
        if hasattr(model, "norm") and model.has_head:
            model.norm.register_forward_pre_hook(self._tail_start)
        for name, block in model.layers.items():
            if f"layer.{name}" in self.units:
                block.register_forward_pre_hook(self._layer_start(f"layer.{name}"))
                block.register_forward_hook(self._layer_end(f"layer.{name}"))

    def _build(self, zb: Any) -> None:
        by_unit: dict[str, list[int]] = {}
        for i, (name, _, _) in enumerate(zb.params):
            by_unit.setdefault(unit_of(name), []).append(i)
        offsets = [(j, off, off + size)
                   for j, (off, size) in enumerate(zip(block_starts(zb.sizes), zb.sizes, strict=True))]
        for unit, idx in by_unit.items():
            params = [zb.params[i][1] for i in idx]
            dtype = params[0].dtype
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            at = 0
            for p in params:
                n = p.numel()
                flat[at:at + n].copy_(p.data.reshape(-1))
                p.data = flat[at:at + n].view(p.shape)
                at += n
            lo = zb.first[idx[0]]
            hi = zb.first[idx[-1]] + int(torch.Size(zb.shapes[idx[-1]]).numel())
            u = _Unit(name=unit, zb=zb, idx=idx, lo=lo, hi=hi, flat=flat,
                      direct=not zb.mixed and zb.gather_dtype == dtype)
            u.parts = [(j, max(lo, a), min(hi, b)) for j, a, b in offsets if max(lo, a) < min(hi, b)]
            self.units[unit] = u

    def gathers(self, zb: Any) -> bool:
        """Whether group ``zb``'s parameters are gathered per use here (else kept whole)."""
        return any(u.zb is zb for u in self.units.values())

    # ---- gather / release ---------------------------------------------------------------------------
    def _start(self, u: _Unit, channel: str) -> None:
        if u.gathered or u.works is not None:
            return
        u.flat.untyped_storage().resize_(u.nbytes)
        zb = u.zb
        buf = u.flat if u.direct else torch.empty(u.hi - u.lo, dtype=zb.gather_dtype, device=u.flat.device)
        self._count(u.nbytes + (0 if u.direct else buf.numel() * buf.element_size()))
        with torch.no_grad():
            for s, t in zb.pieces:
                if u.idx[0] <= s.param <= u.idx[-1]:
                    at = zb.first[s.param] + s.start - u.lo
                    buf[at:at + t.numel()].copy_(t)
        u.staged = None if u.direct else buf
        u.works = [self.comm.start_broadcast(buf[a - u.lo:b - u.lo], group=zb.line, src=zb.line[j], channel=channel)
                   for j, a, b in u.parts]

    def _wait(self, u: _Unit, channel: str) -> None:
        if u.gathered:
            return
        if u.works is None:
            self._start(u, channel)
        assert u.works is not None
        for w in u.works:
            w.wait()
        u.works = None
        if u.staged is not None:  # each parameter's shard of the full-size layout, in its own dtype
            zb, buf = u.zb, u.staged
            with torch.no_grad():
                for i in u.idx:
                    a = zb.first[i] - u.lo
                    full = buf[a:a + int(torch.Size(zb.shapes[i]).numel())].view(zb.shapes[i])
                    zb.params[i][1].data.copy_(self.zero._from_layout(zb, i, full))
            self._count(-buf.numel() * buf.element_size())
            u.staged = None
        u.gathered = True

    def _release(self, u: _Unit) -> None:
        if u.works is not None:  # a prefetch nobody used: finish it first (collectives must complete)
            self._wait(u, "")
        if u.gathered:
            u.flat.untyped_storage().resize_(0)
            u.gathered = False
            self._count(-u.nbytes)

    def _count(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release_all(self) -> None:
        for u in self.units.values():
            self._release(u)

    def require_whole(self, what: str) -> None:
        if not self.whole:
            raise RuntimeError(f"cannot {what} under ZeRO-3 after training started: the parameters are sharded "
                               "(load weights before the first step)")

    # ---- hooks ------------------------------------------------------------------------------------
    def _run(self, seq: list[list[str]], k: int, channel: str) -> None:
        """Wait for group ``k`` of an op's sequence and prefetch group ``k + 1``."""
        for name in seq[k]:
            self._start(self.units[name], channel)
        for name in seq[k]:
            self._wait(self.units[name], channel)
        if k + 1 < len(seq):
            for name in seq[k + 1]:
                self._start(self.units[name], channel)

    def _op_start(self, module: Any, args: Any) -> None:
        """A forward op begins (the stage model is called)."""
        if self.whole:  # the first op: the masters hold the values now
            self.whole = False
            for u in self.units.values():
                u.flat.untyped_storage().resize_(0)
        self.release_all()
        self.phase = "F"
        if self.forward:
            self._run(self.forward, 0, FORWARD) if not self.forward[0][0].startswith("layer.") else \
                self._start(self.units[self.forward[0][0]], FORWARD)

    def _tail_start(self, module: Any, args: Any) -> None:
        """The final norm is called: the head's units are needed now."""
        if self.phase == "F" and self.forward and not self.forward[-1][0].startswith("layer."):
            self._run(self.forward, len(self.forward) - 1, FORWARD)

    def _op_end(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        for seq in (self.forward[0], self.forward[-1]) if self.forward else ():
            for name in seq:
                if not name.startswith("layer."):
                    self._release(self.units[name])
        return _OnGrad.apply(out, self._backward_start) if out.requires_grad else out

    def _backward_start(self) -> None:
        """A backward op begins (the gradient of the stage's output arrived)."""
        self.release_all()
        self.phase = "B"
        if self.backward:
            self._run(self.backward, 0, BACKWARD) if not self.backward[0][0].startswith("layer.") else \
                self._start(self.units[self.backward[0][0]], BACKWARD)

    def _layer_start(self, name: str) -> Any:
        k = self.forward.index([name])

        def hook(block: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            u = self.units[name]
            if self.phase == "B":  # a recomputed forward: gathered for its backward already
                self._wait(u, BACKWARD)
                return None
            self._run(self.forward, k, FORWARD)
            x = args[0]
            if not x.requires_grad:
                return None
            return (_OnGrad.apply(x, lambda: self._release(u)), *args[1:])
        return hook

    def _layer_end(self, name: str) -> Any:
        k = self.backward.index([name])

        def on_backward() -> None:
            self._run(self.backward, k, BACKWARD)

        def hook(block: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
            if self.phase == "B":
                return None
            self._release(self.units[name])
            return _OnGrad.apply(out, on_backward) if out.requires_grad else None
        return hook


class _OnGrad(torch.autograd.Function):
    """Identity whose backward first calls ``fn`` (when the gradient of its output is complete)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.fn()
        return g, None

