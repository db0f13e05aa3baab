"""ZeRO-1 across unequal data-parallel holders: each holder keeps AdamW state for one slice only.

For every bucket of parameters with the same holders (the gradient sync's grouping,
``runtime/data_parallel.py``), the members of each reduction group (``hethub.predict.sharding``:
one rank per holder with equal TP rank, or every rank of every holder when their TP degrees differ)
split the bucket's flat element range into consecutive slices, member i owning the i-th; slice sizes
come from ``hethub.layout.split_elems`` over the members' weights, which the plan carries
(``training.optimizer_shard_weights``: free device memory by default, at the headroom the plan was
scored with), so the slices are the ones the predictor's memory model counted.

One step:

1. gradients are packed into a padded buffer (``len(group)`` chunks of the largest slice) and
   reduce-scattered (``Communicator.reduce_scatter``: native inside one vendor's island; across the
   bridge native inside each island and only each owner's slice, unpadded, over the bridge:
   ``hethub.islands``); each owner divides its slice by the global sample count (the single-device
   mean, as in GradSync);
2. the global gradient norm is the square root of the world sum of each owner's squared slice norm,
   each element counted once (elements replicated over a TP group only on TP rank 0's line), so
   clipping is exact;
3. AdamW (``runtime/optim.py``, the same update as unsharded: it is element-wise) steps each owned
   *piece* (a slice's intersection with one parameter, decayed as its parameter would be). In fp32
   a piece of a same-TP bucket is a view of the rank's own parameter (the parameter is the master:
   no copy); a piece of a mixed bucket lies in the full-size layout, which the rank may not hold, so
   it keeps an fp32 master copy of it. In mixed precision (bf16/fp16, as Megatron's distributed
   optimizer) every piece is an fp32 master copy, the rank's parameters are stored in the compute
   dtype, and gradients accumulate over micro-batches in an fp32 ``main_grad`` beside each
   parameter (a tensor hook adds each 16-bit gradient there): the master weights are sharded with
   the moments;
4. updated slices are all-gathered (padded; unpadded over a bridge) and copied into every member's
   parameters, in the members' parameter dtype when they all store the same one (bf16: half the
   bytes), else fp32.

Model gradients are dropped after the reduce-scatter (owners keep only their slice's). ZeRO-2
(gradients sharded while the backward runs) is not built: gradients accumulate whole over all
micro-batches before any sync, so sharding them would not lower the step's peak.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hethub.comm.communicator import Communicator
from hethub.layout import Topology, block_starts, split_elems, unit_of
from hethub.runtime.data_parallel import world_grad_norm
from hethub.runtime.model import StageModel

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Seg:
    """Elements [start, stop) of parameter ``param`` (flat, in the bucket's layout) in member ``member``'s
    slice at offset ``pos``."""

    param: int
    start: int
    stop: int
    member: int
    pos: int


@dataclass
class _Bucket:
    line: tuple[int, ...]
    mixed: bool
    params: list[tuple[str, nn.Parameter, int | None]] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # per parameter, in the bucket's layout
    sizes: list[int] = field(default_factory=list)
    me: int = 0
    gather_dtype: torch.dtype = torch.float32  # the updated slices' all-gather
    segs: list[_Seg] = field(default_factory=list)
    pieces: list[tuple[_Seg, torch.Tensor]] = field(default_factory=list)  # this rank's, with their tensors

    @property
    def pad(self) -> int:
        return max(self.sizes)


class ZeroSync:
    """Gradient sync, norm, clipping and the post-step parameter gather of a ZeRO-1 run (the same
    methods the Trainer calls on GradSync, plus :meth:`after_step`); :attr:`pieces` are what the
    rank's AdamW steps (``optim.build_optimizer_for``)."""

    def __init__(self, model: StageModel, *, topo: Topology, rank: int, comm: Communicator,
                 weights: dict[int, float], param_dtypes: dict[int, torch.dtype] | None = None) -> None:
        """``param_dtypes``: every rank's parameter storage dtype (its compute dtype in mixed precision,
        fp32 otherwise; all fp32 when None). A 16-bit one here shards the fp32 masters."""
        self.comm, self.rank, self.model = comm, rank, model
        dtypes = param_dtypes or {}
        self.param_dtype = dtypes.get(rank, torch.float32)
        self.sharded_masters = self.param_dtype != torch.float32
        place = topo.place(rank)
        self.tp, self.tp_rank = place.stage.tp, place.tp_rank
        self.device = next(model.parameters()).device
        self.params = [p for _, p in sorted(model.named_parameters())]
        self.steps = 0  # optimizer steps taken (AdamW's per-parameter "step", the same for every piece)
        by_line: dict[tuple[int, ...], _Bucket] = {}
        self._first_holder: dict[str, bool] = {}
        for name, p in sorted(model.named_parameters()):
            unit = unit_of(name)
            g = topo.sync_group(unit, rank)
            dim = model.shard_dim(name)
            b = by_line.setdefault(g.ranks, _Bucket(line=g.ranks, mixed=g.mixed))
            b.params.append((name, p, dim))
            b.shapes.append(self._layout_shape(p, dim) if g.mixed else tuple(p.shape))
            self._first_holder[name] = rank in topo.unit_holders[unit][0].ranks
        self.buckets = list(by_line.values())
        self.pieces: list[tuple[str, torch.Tensor, bool]] = []  # (parameter name, tensor, decayed)
        self._counted: list[torch.Tensor] = []  # pieces whose gradients count in the global norm
        for b in self.buckets:
            members = {dtypes.get(r, torch.float32) for r in b.line}
            b.gather_dtype = members.pop() if len(members) == 1 else torch.float32
            self._place(b, weights)
        if self.sharded_masters:  # the masters are copied: parameters drop to the compute dtype
            for p in self.params:
                p.data = p.data.to(self.param_dtype)
                p.main_grad = None  # type: ignore[attr-defined]
                # A tensor hook sees every gradient reaching the parameter, also those ZB-H1's split
                # weight pass hands to autograd's accumulation (runtime/weight_grad.py); the 16-bit
                # .grad is then dropped at once.
                p.register_hook(functools.partial(_to_main_grad, p))
                p.register_post_accumulate_grad_hook(_drop_grad)

    # ---- layout ---------------------------------------------------------------------------------
    def _layout_shape(self, p: torch.Tensor, dim: int | None) -> tuple[int, ...]:
        """A mixed bucket's layout: the full (unsharded) parameter."""
        shape = list(p.shape)
        if dim is not None and self.tp > 1:
            shape[dim] *= self.tp
        return tuple(shape)

    def _to_layout(self, b: _Bucket, i: int, t: torch.Tensor, *, first_holder_only: bool = False) -> torch.Tensor:
        """This rank's contribution to parameter i's layout tensor (mixed: its TP shard in place, zeros
        elsewhere; a replicated one from TP rank 0 only). Same-TP buckets: ``t`` itself."""
        name, _, dim = b.params[i]
        if not b.mixed:
            return t
        if first_holder_only and not self._first_holder[name]:
            return torch.zeros(b.shapes[i], dtype=t.dtype, device=t.device)
        if dim is None or self.tp == 1:
            return t if self.tp_rank == 0 else torch.zeros_like(t)
        full = torch.zeros(b.shapes[i], dtype=t.dtype, device=t.device)
        full.narrow(dim, self.tp_rank * t.shape[dim], t.shape[dim]).copy_(t)
        return full

    def _from_layout(self, b: _Bucket, i: int, full: torch.Tensor) -> torch.Tensor:
        """Parameter i's local part of its layout tensor."""
        _, p, dim = b.params[i]
        if b.mixed and dim is not None and self.tp > 1:
            return full.narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim])
        return full

    def _place(self, b: _Bucket, weights: dict[int, float]) -> None:
        numels = [int(torch.Size(s).numel()) for s in b.shapes]
        b.sizes = split_elems(sum(numels), [weights[r] for r in b.line])
        b.me = b.line.index(self.rank)
        offsets = block_starts(b.sizes)
        flat = 0
        for i, n in enumerate(numels):
            for j, (off, size) in enumerate(zip(offsets, b.sizes, strict=True)):
                lo, hi = max(flat, off), min(flat + n, off + size)
                if lo < hi:
                    b.segs.append(_Seg(param=i, start=lo - flat, stop=hi - flat, member=j, pos=lo - off))
            flat += n
        values = self._master_values(b)
        for s in (s for s in b.segs if s.member == b.me):
            name, p, dim = b.params[s.param]
            if values is not None:
                t = values(s).clone()
            else:
                assert p.is_contiguous(), name
                t = p.data.view(-1)[s.start:s.stop]  # the parameter is the master: a view, no copy
            b.pieces.append((s, t))
            self.pieces.append((name, t, p.ndim >= 2))
            if b.mixed or dim is not None or self.tp_rank == 0:
                self._counted.append(t)

    def _master_values(self, b: _Bucket) -> Any:
        """segment -> its fp32 values from the parameters, for pieces kept as master copies (None where
        a piece is a view of the parameter). Collective over the line for a mixed bucket: masters of
        elements this rank may not hold are the full values, summed from the first holder's ranks."""
        if b.mixed:
            full = torch.cat([self._to_layout(b, i, p.detach().float(), first_holder_only=True).reshape(-1)
                              for i, (_, p, _) in enumerate(b.params)])
            self.comm.all_reduce(full, group=b.line)
            starts = block_starts([int(torch.Size(x).numel()) for x in b.shapes])
            return lambda s: full[starts[s.param] + s.start:starts[s.param] + s.stop]
        if self.sharded_masters:
            return lambda s: b.params[s.param][1].detach().reshape(-1)[s.start:s.stop].float()
        return None

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Collective: set the master copies from the parameters again, after weights were loaded into
        the model (``--init-from``); views need nothing."""
        for b in self.buckets:
            values = self._master_values(b)
            if values is not None:
                for s, t in b.pieces:
                    t.copy_(values(s))

    # ---- the step ---------------------------------------------------------------------------------
    def sync(self, *, global_samples: int) -> None:
        """Reduce-scatter every bucket's gradients to their owners (as the mean over the global batch)."""
        for b in self.buckets:
            grads = [self._to_layout(b, i, self._grad(p)).reshape(-1) for i, (_, p, _) in enumerate(b.params)]
            pad = b.pad
            buf = torch.zeros(pad * len(b.line), dtype=torch.float32, device=self.device)
            for s in b.segs:
                buf[s.member * pad + s.pos:s.member * pad + s.pos + s.stop - s.start] = grads[s.param][s.start:s.stop]
            del grads
            mine = self.comm.reduce_scatter(buf, group=b.line, sizes=b.sizes)[:b.sizes[b.me]]
            mine.div_(float(global_samples))
            for s, t in b.pieces:
                t.grad = mine[s.pos:s.pos + s.stop - s.start]
        self._drop_model_grads()  # owners keep their slices' gradients only

    def _grad(self, p: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient summed over this step's micro-batches, fp32 (zeros if it got none)."""
        g = p.main_grad if self.sharded_masters else p.grad  # type: ignore[attr-defined]
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device) if g is None else g

    def _drop_model_grads(self) -> None:
        for p in self.params:
            p.grad = None
            if self.sharded_masters:
                p.main_grad = None  # type: ignore[attr-defined]

    def global_norm(self) -> torch.Tensor:
        """The global gradient norm from every owner's slice (each element once), identical on every rank."""
        grads = [t.grad for t in self._counted if t.grad is not None and t.numel()]
        return world_grad_norm(grads, comm=self.comm, device=self.device)

    def clip_with(self, total: torch.Tensor, *, max_norm: float) -> None:
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([t for _, t, _ in self.pieces], max_norm, total.float().reshape(()))

    def unscale(self, scale: float) -> None:
        if scale != 1.0:
            grads = [t.grad for _, t, _ in self.pieces if t.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(scale))

    def after_step(self) -> None:
        """All-gather every bucket's updated slices into every member's parameters."""
        self.steps += 1
        with torch.no_grad():
            for b in self.buckets:
                mine = torch.zeros(b.pad, dtype=b.gather_dtype, device=self.device)
                for s, t in b.pieces:
                    mine[s.pos:s.pos + s.stop - s.start] = t
                self._scatter_gathered(b, self.comm.all_gather(mine, group=b.line, sizes=b.sizes), self._set_param)

    def _set_param(self, b: _Bucket, i: int, full: torch.Tensor) -> None:
        b.params[i][1].data.copy_(self._from_layout(b, i, full))

    def _scatter_gathered(self, b: _Bucket, gathered: torch.Tensor, put: Any) -> None:
        """Rebuild each parameter's layout tensor from a padded gather and hand it to ``put``."""
        pad = b.pad
        flats = [torch.empty(int(torch.Size(s).numel()), dtype=gathered.dtype, device=gathered.device)
                 for s in b.shapes]
        for s in b.segs:
            flats[s.param][s.start:s.stop] = gathered[s.member * pad + s.pos:s.member * pad + s.pos + s.stop - s.start]
        for i, f in enumerate(flats):
            put(b, i, f.view(b.shapes[i]))

    def zero(self) -> None:
        self._drop_model_grads()
        for _, t, _ in self.pieces:
            t.grad = None

    # ---- state ------------------------------------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """(AdamW moment bytes, separate master-copy bytes) this rank holds: what the memory model predicts."""
        moments = sum(v.numel() * v.element_size() for _, t, _ in self.pieces
                      for k, v in optimizer.state.get(t, {}).items() if k in _MOMENTS)
        masters = sum(t.numel() * t.element_size() for b in self.buckets if b.mixed or self.sharded_masters
                      for _, t in b.pieces)
        return moments, masters

    def gather_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """Collective over every bucket's members: each parameter's AdamW state in the parameter's
        local (TP-shard) shape, as an unsharded run keeps it (moments only once stepped); with sharded
        masters also ``param``, the fp32 master values (the 16-bit parameters are their rounding)."""
        keys = (_MOMENTS if self.steps else ()) + (("param",) if self.sharded_masters else ())
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            for key in keys:
                mine = torch.zeros(b.pad, dtype=torch.float32, device=self.device)
                for s, t in b.pieces:
                    st = {"param": t} if key == "param" else optimizer.state.get(t)
                    if st is not None:
                        mine[s.pos:s.pos + s.stop - s.start] = st[key]

                def put(b: _Bucket, i: int, full: torch.Tensor, key: str = key) -> None:
                    out.setdefault(b.params[i][0], {})[key] = self._from_layout(b, i, full).clone()

                self._scatter_gathered(b, self.comm.all_gather(mine, group=b.line, sizes=b.sizes), put)
        if self.steps:
            for v in out.values():
                v["step"] = torch.tensor(float(self.steps))
        return out

    def load_state(self, optimizer: torch.optim.Optimizer, *, full: dict[str, dict[str, torch.Tensor]],
                   steps: int, shard: Any) -> None:
        """Take this rank's pieces from full-size tensors (``full[name]``: ``param`` and, once stepped,
        the moments): re-sharding under any plan and sharding. ``shard(t, name)`` slices a full tensor
        to this rank's TP shard. Master copies are reloaded from the full parameter."""
        self.steps = steps
        for b in self.buckets:
            for s, t in b.pieces:
                name = b.params[s.param][0]
                if b.mixed or self.sharded_masters:
                    t.copy_(self._piece_of(b, s, full[name]["param"], shard))
                if "exp_avg" in full[name]:
                    optimizer.state[t] = {"step": torch.tensor(float(steps)),
                                          **{k: self._piece_of(b, s, full[name][k], shard).clone() for k in _MOMENTS}}

    def _piece_of(self, b: _Bucket, s: _Seg, x: torch.Tensor, shard: Any) -> torch.Tensor:
        """Segment ``s`` of a full-size tensor ``x`` of its parameter, in the bucket's layout."""
        local = x if b.mixed else shard(x, b.params[s.param][0])
        return local.reshape(-1)[s.start:s.stop].to(self.device)


def _to_main_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Tensor hook of a 16-bit parameter: add this gradient to the fp32 ``main_grad`` (the sum over
    micro-batches stays fp32, as with fp32 parameters under autocast)."""
    if p.main_grad is None:  # type: ignore[attr-defined]
        p.main_grad = grad.float() if grad.dtype != torch.float32 else grad.clone()  # type: ignore[attr-defined]
    else:
        p.main_grad.add_(grad)  # type: ignore[attr-defined]


def _drop_grad(p: torch.Tensor) -> None:
    """The 16-bit gradient, already in ``main_grad``, is not kept."""
    p.grad = None
