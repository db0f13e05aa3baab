"""Sample-weighted gradient sync among the ranks that hold each parameter, and global-norm clipping.

Every replica's loss is a *sum* of per-sample losses, so summing gradients over holders and dividing
by the global sample count gives exactly the single-device gradient of the mean loss, however
unequal the replicas' shares and however differently they split the layers.

Holders with equal TP degree all-reduce each shard among corresponding TP ranks. Holders with
different TP degrees cannot match shards, so each contributes a full-size gradient (its shard in
place, zeros elsewhere; a replicated parameter from TP rank 0 only), all of them all-reduce, and each
keeps its slice. One flat buffer per group keeps it to one collective per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hethub.comm.buffers import unflatten_into
from hethub.comm.communicator import Communicator
from hethub.layout import GradGroup, Topology, unit_of
from hethub.runtime.model import StageModel


def world_grad_norm(grads: list[torch.Tensor], *, comm: Communicator, device: torch.device) -> torch.Tensor:
    """The L2 norm over every rank's ``grads`` (each rank passing the gradients it alone counts):
    local norms squared in float64, summed over the world, identical on every rank."""
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    sq = local.double().pow(2).reshape(1)
    comm.all_reduce(sq)
    return sq.sqrt()


@dataclass
class _Bucket:
    group: GradGroup
    params: list[tuple[str, nn.Parameter, int | None]] = field(default_factory=list)


class GradSync:
    def __init__(self, model: StageModel, *, topo: Topology, rank: int, comm: Communicator) -> None:
        self.device = next(model.parameters()).device
        self.comm, self.rank = comm, rank
        place = topo.place(rank)
        self.tp, self.tp_rank = place.stage.tp, place.tp_rank
        buckets: dict[tuple[int, ...], _Bucket] = {}
        self.norm_params: list[nn.Parameter] = []  # counted once globally in the gradient norm
        for name, p in sorted(model.named_parameters()):
            unit = unit_of(name)
            g = topo.sync_group(unit, rank)
            # Embedding and head are split by vocabulary or replicated depending on this stage's TP
            # degree; holders of another degree are handled by the mixed sync, which uses each one's own.
            dim = model.shard_dim(name)
            buckets.setdefault(g.ranks, _Bucket(group=g)).params.append((name, p, dim))
            if topo.owns(unit, rank) and (dim is not None or self.tp_rank == 0):
                self.norm_params.append(p)
        self.buckets = list(buckets.values())
        self.params = [p for _, p in sorted(model.named_parameters())]

    def sync(self, *, global_samples: int) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for b in self.buckets:
            if b.group.mixed:
                self._sync_mixed(b)
            elif len(b.group.ranks) > 1:
                flat = torch.cat([p.grad.reshape(-1) for _, p, _ in b.params])
                self.comm.all_reduce(flat, group=b.group.ranks)
                unflatten_into(flat, [p.grad for _, p, _ in b.params])
        torch._foreach_div_([p.grad for p in self.params], float(global_samples))

    def _sync_mixed(self, b: _Bucket) -> None:
        fulls = []
        for _, p, dim in b.params:
            if dim is None or self.tp == 1:
                fulls.append(p.grad if self.tp_rank == 0 else torch.zeros_like(p.grad))
            else:
                shape = list(p.shape)
                shape[dim] *= self.tp
                full = torch.zeros(shape, dtype=p.grad.dtype, device=p.grad.device)
                full.narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim]).copy_(p.grad)
                fulls.append(full)
        flat = torch.cat([f.reshape(-1) for f in fulls])
        self.comm.all_reduce(flat, group=b.group.ranks)
        offset = 0
        for (_, p, dim), f in zip(b.params, fulls, strict=True):
            full = flat[offset:offset + f.numel()].view_as(f)
            offset += f.numel()
            if dim is not None and self.tp > 1:
                full = full.narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim])
            p.grad.copy_(full)

    def clip(self, *, max_norm: float) -> float:
        """Scale all gradients so the global norm is at most ``max_norm``; return the norm before.

        Same formula as ``torch.nn.utils.clip_grad_norm_`` so a single-device run matches exactly.
        """
        total = self.global_norm()
        self.clip_with(total, max_norm=max_norm)
        return float(total)

    def global_norm(self) -> torch.Tensor:
        """The global gradient norm (each parameter counted once), identical on every rank; inf/nan
        when any gradient anywhere overflowed (what loss scaling checks)."""
        return world_grad_norm([p.grad for p in self.norm_params], comm=self.comm, device=self.device)

    def clip_with(self, total: torch.Tensor, *, max_norm: float) -> None:
        """Scale gradients so that ``total`` (from :meth:`global_norm`) becomes at most ``max_norm``."""
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total.float().reshape(()))

    def unscale(self, scale: float) -> None:
        """Divide every gradient by the loss scale."""
        if scale != 1.0:
            torch._foreach_div_([p.grad for p in self.params], float(scale))

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

