"""Sample-weighted gradient sync among the ranks that hold each parameter, and global-norm clipping.

Every replica's loss is a *sum* of per-sample losses, so summing gradients over holders and dividing
by the global sample count gives exactly the single-device gradient of the mean loss, however
unequal the replicas' shares and however differently they split the layers.

Gradients live in one contiguous fp32 buffer, cut into buckets per sync group
(``runtime/grad_buffer.py``); a bucket is all-reduced as soon as its gradients are final in the last
micro-batch's backward, asynchronously, while the backward goes on (:meth:`GradSync.flush` starts
the rest after the backward, :meth:`GradSync.sync` waits for all of them). Holders with equal TP
degree all-reduce each bucket in place among corresponding TP ranks. Holders with different TP
degrees cannot match shards, so each contributes a full-size bucket (its shards in place, zeros
elsewhere; a replicated parameter from TP rank 0 only), all of them all-reduce it, and each copies
its slices back. Across vendor islands a bucket is reduced natively inside each island while the
backward runs and over the bridge after it (``comm/hierarchical.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from hethub.comm.communicator import Communicator
from hethub.layout import DEFAULT_BUCKET_ELEMS, GradGroup, Topology, unit_of
from hethub.runtime.grad_buffer import Bucket, GradBuffer
from hethub.runtime.grad_clip import clip_coefficient, total_norm
from hethub.runtime.model import StageModel
from hethub.runtime.timing import Mark, OpTimer


def world_grad_norm(grads: list[torch.Tensor], *, comm: Communicator, device: torch.device) -> torch.Tensor:
    """The L2 norm over every rank's ``grads`` (each rank passing the gradients it alone counts):
    local norms squared in float64, summed over the world, identical on every rank."""
    local = total_norm(grads) if grads else torch.zeros((), device=device)
    sq = local.double().pow(2).reshape(1)
    comm.all_reduce(sq)
    return sq.sqrt()


def backward_passes(model: StageModel, name: str) -> int:
    """Backward passes per micro-batch that accumulate into parameter ``name``: one, except a tied
    embedding matrix that the embedding (chunk 0) and the head (the last chunk) of one stage's
    virtual stages both use, each in its own backward."""
    tied = unit_of(name) == "embed" and model.has_embedding and model.has_head and model.spec.tied_embeddings
    return 2 if tied and len(model.chunk_layers) > 1 else 1


def bucket_layout(model: StageModel, topo: Topology, rank: int) -> tuple[
        list[tuple[str, nn.Parameter]], list[GradGroup], list[int], list[int | None]]:
    """Per parameter (sorted by name): its sync group, its elements in the group's reduction layout
    (full size where the holders' TP degrees differ) and its TP shard dimension."""
    named = sorted(model.named_parameters())
    tp = topo.place(rank).stage.tp
    groups, numels, dims = [], [], []
    for name, p in named:
        g = topo.sync_group(unit_of(name), rank)
        # Embedding and head are split by vocabulary or replicated depending on this stage's TP
        # degree; holders of another degree are handled by the mixed layout, which uses each one's own.
        dim = model.shard_dim(name)
        groups.append(g)
        numels.append(p.numel() * (tp if g.mixed and dim is not None else 1))
        dims.append(dim)
    return named, groups, numels, dims


class GradSync:
    """The unsharded gradient sync (module doc). ``bucket_elems``: bucket size in elements;
    ``overlap``: start each bucket's reduction in the backward (else all after it); ``timer``: the
    step's marks for the trace's reduction events."""

    def __init__(self, model: StageModel, *, topo: Topology, rank: int, comm: Communicator,
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS, overlap: bool = True, timer: OpTimer | None = None,
                 micro_batches: int | None = None) -> None:
        self.device = next(model.parameters()).device
        self.comm, self.rank = comm, rank
        place = topo.place(rank)
        self.tp, self.tp_rank = place.stage.tp, place.tp_rank
        self.timer = timer or OpTimer(self.device)
        named, groups, numels, dims = bucket_layout(model, topo, rank)
        self._dim = {n: d for (n, _), d in zip(named, dims, strict=True)}
        m = place.num_micro_batches if micro_batches is None else micro_batches
        self.buffer = GradBuffer(named, groups=groups, layout_numels=numels,
                                 finals=[m * backward_passes(model, n) for n, _ in named],
                                 num_layers=model.spec.num_layers, cap_elems=bucket_elems, overlap=overlap,
                                 launch=self._launch)
        self.buckets = self.buffer.buckets
        # Counted once globally in the gradient norm: the first holder's copy, a replicated one on TP rank 0.
        self.norm_grads = [p.main_grad for n, p in named  # type: ignore[attr-defined]
                           if topo.owns(unit_of(n), rank) and (self._dim[n] is not None or self.tp_rank == 0)]
        self.params = [p for _, p in named]
        self.t0: Mark = None
        self.reductions: list[tuple[int, Mark, Mark]] = []  # (bucket, started, found done) this step

    def begin_step(self, t0: Mark) -> None:
        self.t0, self.reductions = t0, []

    # ---- reductions ------------------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        ranks = b.group.ranks
        if len(ranks) <= 1:
            return
        b.extra["start"] = self.timer.mark()
        if b.group.mixed:
            full = self._full_size(b)
            b.extra["full"] = full
            b.extra["work"] = self.comm.start_all_reduce(full, group=ranks)
        else:
            b.extra["work"] = self.comm.start_all_reduce(self.buffer.data[b.lo:b.hi], group=ranks)

    def _full_size(self, b: Bucket) -> torch.Tensor:
        """A mixed bucket's contribution: each parameter at full size, this rank's shard in place."""
        full = torch.zeros(b.layout_numel, dtype=torch.float32, device=self.device)
        offset = 0
        for (name, p), g in zip(self.buffer.bucket_params(b), self.buffer.bucket_grads(b), strict=True):
            dim = self._dim[name]
            if dim is None or self.tp == 1:
                n = p.numel()
                if self.tp_rank == 0:
                    full[offset:offset + n].copy_(g.reshape(-1))
            else:
                shape = list(p.shape)
                shape[dim] *= self.tp
                n = p.numel() * self.tp
                full[offset:offset + n].view(shape).narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim]).copy_(g)
            offset += n
        return full

    def _copy_back(self, b: Bucket, full: torch.Tensor) -> None:
        offset = 0
        for (name, p), g in zip(self.buffer.bucket_params(b), self.buffer.bucket_grads(b), strict=True):
            dim = self._dim[name]
            if dim is None or self.tp == 1:
                g.copy_(full[offset:offset + p.numel()].view_as(g))
                offset += p.numel()
            else:
                shape = list(p.shape)
                shape[dim] *= self.tp
                g.copy_(full[offset:offset + p.numel() * self.tp].view(shape)
                        .narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim]))
                offset += p.numel() * self.tp

    def flush(self) -> None:
        """Start the reductions the backward did not (call once the rank's last backward is done,
        before any other collective)."""
        self.buffer.flush()

    def sync(self, *, global_samples: int) -> None:
        """Finish every bucket's reduction (in bucket order) and divide by the global sample count."""
        self.flush()
        for b in self.buckets:
            work = b.extra.pop("work", None)
            if work is None:
                continue
            work.wait()
            full = b.extra.pop("full", None)
            if full is not None:
                self._copy_back(b, full)
            self.reductions.append((b.index, b.extra.pop("start"), self.timer.mark()))
        self.buffer.data.div_(float(global_samples))

    # ---- norm, clipping, loss scale ----------------------------------------------------------------
    def global_norm(self) -> torch.Tensor:
        """The global gradient norm (each parameter counted once), identical on every rank; inf/nan
        when any gradient anywhere overflowed (what loss scaling checks)."""
        return world_grad_norm(self.norm_grads, comm=self.comm, device=self.device)

    def clip_with(self, total: torch.Tensor, *, max_norm: float) -> None:
        """Scale gradients so that ``total`` (from :meth:`global_norm`) becomes at most ``max_norm``."""
        if max_norm > 0:
            self.buffer.data.mul_(clip_coefficient(total, max_norm=max_norm))

    def unscale(self, scale: float) -> None:
        """Divide every gradient by the loss scale."""
        if scale != 1.0:
            self.buffer.data.div_(float(scale))

    def zero(self) -> None:
        self.buffer.reset()
