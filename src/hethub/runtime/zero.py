"""ZeRO-1 across unequal data-parallel holders: each holder keeps AdamW state for one slice only.

For every sync group (the ranks that sum one set of gradients, ``runtime/data_parallel.py``), the
members of the group (``hethub.predict.sharding``: one rank per holder with equal TP rank, or every
rank of every holder when their TP degrees differ) split the group's flat element range (its
parameters in the gradient buffer's order) into consecutive slices, member i owning the i-th; slice
sizes come from ``hethub.layout.split_elems`` over the members' weights, which the plan carries
(``training.optimizer_shard_weights``: free device memory by default, at the headroom the plan was
scored with), so the slices are the ones the predictor's memory model counted.

One step:

1. gradients accumulate in the rank's contiguous fp32 buffer (``runtime/grad_buffer.py``), cut into
   the same buckets as an unsharded run; as soon as a bucket's gradients are final in the last
   micro-batch's backward, each of its pieces (its intersection with one member's slice) is reduced
   onto that member, asynchronously (``Communicator.start_reduce``: native inside one vendor island;
   across islands native inside each, then only the owner's piece over the bridge,
   ``comm/hierarchical.StartedReduce``). The pieces of all buckets are the group's reduce-scatter,
   bucketed: every element is reduced once, onto its owner. Each owner then divides its slice by
   the global sample count (the single-device mean, as in GradSync);
2. the global gradient norm is the square root of the world sum of each owner's squared slice norm,
   each element counted once (elements replicated over a TP group only on TP rank 0's line), so
   clipping is exact;
3. AdamW (``runtime/optim.py``, the same update as unsharded: it is element-wise) steps each owned
   *piece* (a slice's intersection with one parameter, decayed as its parameter would be). In fp32
   a piece of a same-TP group is a view of the rank's own parameter (the parameter is the master:
   no copy) and its gradient a view of the buffer; a piece of a mixed group lies in the full-size
   layout, which the rank may not hold, so it keeps an fp32 master copy of it. In mixed precision
   (bf16/fp16, the recipe of ``runtime/precision.py``) every piece is an fp32 master copy and the
   rank's parameters are stored in the compute dtype: the master weights are sharded with the
   moments;
4. updated slices are all-gathered (padded; unpadded over a bridge) and copied into every member's
   parameters, in the members' parameter dtype when they all store the same one (bf16: half the
   bytes), else fp32.

The gradient buffer stays whole (as Megatron's distributed optimizer keeps its grad buffer). ZeRO-2
and ZeRO-3 (``runtime/zero_grads.py``, ``runtime/zero_params.py``) keep this split and these pieces,
and shard the gradients (and the parameters) among the same owners.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hethub.comm.communicator import Communicator
from hethub.layout import DEFAULT_BUCKET_ELEMS, Topology, block_starts, split_elems, unit_of
from hethub.runtime.data_parallel import backward_passes, bucket_layout, world_grad_norm
from hethub.runtime.grad_buffer import Bucket, GradBuffer
from hethub.runtime.grad_clip import clip_with_norm_
from hethub.runtime.model import StageModel
from hethub.runtime.precision import store_params
from hethub.runtime.timing import Mark, OpTimer

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Seg:
    """Elements [start, stop) of parameter ``param`` (flat, in the group's layout) in member ``member``'s
    slice at offset ``pos``."""

    param: int
    start: int
    stop: int
    member: int
    pos: int


@dataclass
class _Bucket:
    """One sync group's sharding: its parameters in the buffer's order and who owns which elements."""

    line: tuple[int, ...]
    mixed: bool
    params: list[tuple[str, nn.Parameter, int | None]] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # per parameter, in the group's layout
    sizes: list[int] = field(default_factory=list)
    me: int = 0
    gather_dtype: torch.dtype = torch.float32  # the updated slices' all-gather
    segs: list[_Seg] = field(default_factory=list)
    pieces: list[tuple[_Seg, torch.Tensor]] = field(default_factory=list)  # this rank's, with their tensors
    first: list[int] = field(default_factory=list)  # per parameter, its first element in the layout

    @property
    def pad(self) -> int:
        return max(self.sizes)


class ZeroSync:
    """Gradient sync, norm, clipping and the post-step parameter gather of a ZeRO-1 run (the same
    methods the Trainer calls on GradSync, plus :meth:`after_step`); :attr:`pieces` are what the
    rank's AdamW steps (``optim.build_optimizer_for``)."""

    stage = 1
    copies_params = False  # every piece an fp32 copy even where the parameter is fp32 (ZeRO-3: it is freed)

    def __init__(self, model: StageModel, *, topo: Topology, rank: int, comm: Communicator,
                 weights: dict[int, float], param_dtypes: dict[int, torch.dtype] | None = None,
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS, overlap: bool = True, timer: OpTimer | None = None,
                 ) -> None:
        """``param_dtypes``: every rank's parameter storage dtype (its compute dtype in mixed precision,
        fp32 otherwise; all fp32 when None). A 16-bit one here shards the fp32 masters."""
        self.comm, self.rank, self.model = comm, rank, model
        dtypes = param_dtypes or {}
        self.param_dtype = dtypes.get(rank, torch.float32)
        self.sharded_masters = self.param_dtype != torch.float32 or self.copies_params
        place = topo.place(rank)
        self.tp, self.tp_rank = place.stage.tp, place.tp_rank
        self.device = next(model.parameters()).device
        self.timer = timer or OpTimer(self.device)
        self.params = [p for _, p in sorted(model.named_parameters())]
        self.steps = 0  # optimizer steps taken (AdamW's per-parameter "step", the same for every piece)
        named, groups, numels, dims = bucket_layout(model, topo, rank)
        dim_of = {n: d for (n, _), d in zip(named, dims, strict=True)}
        self.buffer = self._make_buffer(named, groups=groups, layout_numels=numels,
                                        micro_batches=place.num_micro_batches, bucket_elems=bucket_elems,
                                        overlap=overlap)
        by_line: dict[tuple[int, ...], _Bucket] = {}
        self._first_holder: dict[str, bool] = {}
        self._where: dict[int, tuple[_Bucket, int]] = {}  # buffer bucket -> (its group, its first element there)
        for b in self.buffer.buckets:
            zb = by_line.setdefault(b.group.ranks, _Bucket(line=b.group.ranks, mixed=b.group.mixed))
            self._where[b.index] = (zb, sum(int(torch.Size(x).numel()) for x in zb.shapes))
            for name, p in self.buffer.bucket_params(b):
                zb.params.append((name, p, dim_of[name]))
                zb.shapes.append(self._layout_shape(p, dim_of[name]) if zb.mixed else tuple(p.shape))
                # CP rank 0 of the first holder: every CP rank holds the same values.
                self._first_holder[name] = rank in topo.unit_holders[unit_of(name)][0].tp_group(0)
        self.buckets = list(by_line.values())
        self.buffer_index = {n: k for k, n in enumerate(self.buffer.names)}
        self._group_index = {n: i for zb in self.buckets for i, (n, _, _) in enumerate(zb.params)}
        self.pieces: list[tuple[str, torch.Tensor, bool]] = []  # (parameter name, tensor, decayed)
        self._counted: list[torch.Tensor] = []  # pieces whose gradients count in the global norm
        for zb in self.buckets:
            members = {dtypes.get(r, torch.float32) for r in zb.line}
            zb.gather_dtype = members.pop() if len(members) == 1 else torch.float32
            self._place(zb, weights)
        if self.sharded_masters:  # the masters are copied: parameters drop to the compute dtype
            store_params(model, self.param_dtype)
            self.buffer.reset()
        self.t0: Mark = None
        self.reductions: list[tuple[int, Mark, Mark]] = []  # (bucket, started, found done) this step

    def _make_buffer(self, named: list[tuple[str, nn.Parameter]], *, groups: list[Any], layout_numels: list[int],
                     micro_batches: int, bucket_elems: int, overlap: bool) -> Any:
        """The whole main-grad buffer (ZeRO-2/3 override it with per-micro-batch rounds)."""
        return GradBuffer(named, groups=groups, layout_numels=layout_numels,
                          finals=[micro_batches * backward_passes(self.model, n) for n, _ in named],
                          num_layers=self.model.spec.num_layers, cap_elems=bucket_elems, overlap=overlap,
                          launch=self._launch)

    def begin_step(self, t0: Mark) -> None:
        self.t0, self.reductions = t0, []

    # ---- layout ---------------------------------------------------------------------------------
    def _layout_shape(self, p: torch.Tensor, dim: int | None) -> tuple[int, ...]:
        """A mixed group's layout: the full (unsharded) parameter."""
        shape = list(p.shape)
        if dim is not None and self.tp > 1:
            shape[dim] *= self.tp
        return tuple(shape)

    def _to_layout(self, b: _Bucket, i: int, t: torch.Tensor, *, first_holder_only: bool = False) -> torch.Tensor:
        """This rank's contribution to parameter i's layout tensor (mixed: its TP shard in place, zeros
        elsewhere; a replicated one from TP rank 0 only). Same-TP groups: ``t`` itself."""
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
        b.first = block_starts(numels)
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
        a piece is a view of the parameter). Collective over the line for a mixed group: masters of
        elements this rank may not hold are the full values, summed from the first holder's ranks."""
        if b.mixed:
            full = torch.cat([self._to_layout(b, i, p.detach().float(), first_holder_only=True).reshape(-1)
                              for i, (_, p, _) in enumerate(b.params)])
            self.comm.all_reduce(full, group=b.line)
            return lambda s: full[b.first[s.param] + s.start:b.first[s.param] + s.stop]
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
    def _launch(self, bb: Bucket) -> None:
        """Reduce each piece of a ready bucket onto its owner (module doc, step 1)."""
        zb, at = self._where[bb.index]
        if len(zb.line) <= 1:
            return
        bb.extra["start"] = self.timer.mark()
        if zb.mixed:
            src = self._full_size(zb, bb, at)
            bb.extra["full"] = src
        else:
            src = self.buffer.data[bb.lo:bb.hi]
        bb.extra["works"] = self._reduce_pieces(zb, at, src)

    def _reduce_pieces(self, zb: _Bucket, at: int, src: torch.Tensor, *, eager: bool = False) -> list[Any]:
        """Start reducing each piece of ``src`` (a bucket at element ``at`` of group ``zb``'s layout)
        onto its owner (``eager``: ``Communicator.start_reduce``'s)."""
        works = []
        for j, (off, size) in enumerate(zip(block_starts(zb.sizes), zb.sizes, strict=True)):
            lo, hi = max(at, off), min(at + src.numel(), off + size)
            if lo < hi:
                works.append(self.comm.start_reduce(src[lo - at:hi - at], group=zb.line, dst=zb.line[j], eager=eager))
        return works

    def _full_size(self, zb: _Bucket, bb: Bucket, at: int, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A mixed bucket's contribution in the group's full-size layout (``grads``: its parameters'
        gradients, default their main grads)."""
        full = torch.empty(bb.layout_numel, dtype=torch.float32, device=self.device)
        for k, g in zip(bb.params, self.buffer.bucket_grads(bb) if grads is None else grads, strict=True):
            i = self._group_index[self.buffer.names[k]]
            lo = zb.first[i] - at
            full[lo:lo + int(torch.Size(zb.shapes[i]).numel())] = self._to_layout(zb, i, g).reshape(-1)
        return full

    def flush(self) -> None:
        """Start the reductions the backward did not (call once the rank's last backward is done,
        before any other collective)."""
        self.buffer.flush()

    def sync(self, *, global_samples: int) -> None:
        """Finish every bucket's reductions (in bucket order); each owner's slice, divided by the global
        sample count, becomes its pieces' gradients."""
        self.flush()
        fulls: dict[int, tuple[torch.Tensor, int]] = {}
        for bb in self.buffer.buckets:
            works = bb.extra.pop("works", None)
            if works is None:
                continue
            for w in works:
                w.wait()
            if "full" in bb.extra:
                fulls[bb.index] = (bb.extra.pop("full"), self._where[bb.index][1])
            self.reductions.append((bb.index, bb.extra.pop("start"), self.timer.mark()))
        for zb in self.buckets:
            for seg, t in zb.pieces:
                t.grad = self._reduced(zb, seg, fulls)
        grads = [t.grad for _, t, _ in self.pieces if t.grad is not None and t.numel()]
        if grads:
            torch._foreach_div_(grads, float(global_samples))

    def _reduced(self, zb: _Bucket, seg: _Seg, fulls: dict[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
        """An owned segment's reduced gradient: a view of the buffer (same-TP) or of its bucket's
        full-size tensor (mixed)."""
        k = self.buffer_index[zb.params[seg.param][0]]
        if not zb.mixed:
            return self.buffer.views[k].reshape(-1)[seg.start:seg.stop]
        full, at = fulls[self.buffer.bucket_of[k]]
        lo = zb.first[seg.param] + seg.start - at
        return full[lo:lo + seg.stop - seg.start]

    def global_norm(self) -> torch.Tensor:
        """The global gradient norm from every owner's slice (each element once), identical on every rank."""
        grads = [t.grad for t in self._counted if t.grad is not None and t.numel()]
        return world_grad_norm(grads, comm=self.comm, device=self.device)

    def clip_with(self, total: torch.Tensor, *, max_norm: float) -> None:
        if max_norm > 0:
            clip_with_norm_([t for _, t, _ in self.pieces], max_norm, total)

    def unscale(self, scale: float) -> None:
        if scale != 1.0:
            grads = [t.grad for _, t, _ in self.pieces if t.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(scale))

    def after_step(self) -> None:
        """All-gather every group's updated slices into every member's parameters."""
        self.steps += 1
        with torch.no_grad():
            for b in self.buckets:
                if not self.keeps_whole(b):
                    continue
                mine = torch.zeros(b.pad, dtype=b.gather_dtype, device=self.device)
                for s, t in b.pieces:
                    mine[s.pos:s.pos + s.stop - s.start] = t
                self._scatter_gathered(b, self.comm.all_gather(mine, group=b.line, sizes=b.sizes), self._set_param)

    def keeps_whole(self, b: _Bucket) -> bool:
        """Whether every member keeps group ``b``'s parameters whole (ZeRO-3 gathers some instead)."""
        return True

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
        self.buffer.reset()
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
                    optimizer.state[t] = {"step": torch.tensor(float(steps), device=t.device),
                                          **{k: self._piece_of(b, s, full[name][k], shard).clone() for k in _MOMENTS}}

    def _piece_of(self, b: _Bucket, s: _Seg, x: torch.Tensor, shard: Any) -> torch.Tensor:
        """Segment ``s`` of a full-size tensor ``x`` of its parameter, in the bucket's layout."""
        local = x if b.mixed else shard(x, b.params[s.param][0])
        return local.reshape(-1)[s.start:s.stop].to(self.device)

