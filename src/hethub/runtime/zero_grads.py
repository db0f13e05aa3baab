"""ZeRO-2 (gradients sharded too) and ZeRO-3 (parameters too) across unequal data-parallel holders.

Both keep ZeRO-1's split (``runtime/zero.py``: each sync group's flat range cut into one consecutive
slice per member, sized by ``hethub.layout.split_elems`` over the plan's weights), its owned pieces,
fp32 masters, AdamW, norm and clipping. What changes is where gradients live:

* no whole gradient buffer: each micro-batch's gradients are handed off bucket by bucket as its
  backward makes them (``runtime/grad_rounds.py``), copied into a bucket-sized fp32 tensor, and each
  piece of it reduced onto its owner (``Communicator.start_reduce``: native inside one vendor island,
  across islands native inside each and only the owner's piece over the bridge), like ZeRO-1's one
  reduction per step but once per micro-batch;
* each owner adds its reduced pieces into one persistent fp32 tensor of its owned elements (the
  pieces' ``.grad``), the gradient shard; at most ``in_flight`` rounds are reduced at once (a rank
  launching one more first finishes its oldest), so the transient is a few buckets, not a buffer.

Every holder of a group runs as many rounds (the plan requires equal micro-batch counts,
``plan._check_zero23``) and launches them in one order, so their collectives pair up.

ZeRO-3 (:class:`Zero3Sync`) also frees the parameters: each owned piece is an fp32 master copy (in
fp32 too), and ``runtime/zero_params.py`` gathers each layer from its owners before each use.

Why not torch's ``fully_shard`` (FSDP2), even for a group of one kind with equal shares: FSDP2
issues a module's all-gathers on one process group in the order each rank runs its modules, and a
group's holders here sit at different pipeline positions, whose 1F1B orders interleave forwards and
backwards differently (stage 0 of four runs F F F F B ..., a last stage F B F B ...): the n-th
gather of one holder would pair with another layer's on the next. This runtime gathers forward and
backward uses on two groups, where each holder's sequence is the same. FSDP2 also cannot reduce
among holders of different TP degrees (their layouts differ), does not see ZB-H1's weight pass
(``runtime/weight_grad.py``, outside autograd's module hooks), divides by its group's size where
unequal replicas need the global sample count, and turns parameters into DTensors, which the
plain-tensor TP layers and the by-name checkpoints do not take. One path for every group keeps the
numbers the same whatever a group's kinds.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from hethub.runtime.data_parallel import backward_passes
from hethub.runtime.grad_buffer import Bucket
from hethub.runtime.grad_rounds import RoundBuffer
from hethub.runtime.zero import ZeroSync
from hethub.runtime.zero_params import ZeroParams

# Rounds reduced at once: one landing while the next is filled (Megatron's overlap keeps about as many
# buckets in flight). Each costs one bucket of fp32 (full size for groups mixing TP degrees).
IN_FLIGHT_ROUNDS = 2


class Zero2Sync(ZeroSync):
    """ZeRO-2 (module doc): the methods of :class:`ZeroSync`, gradients in a shard."""

    stage = 2

    def __init__(self, *args: Any, in_flight: int = IN_FLIGHT_ROUNDS, **kw: Any) -> None:
        self.in_flight = max(1, in_flight)
        self._flight: deque[tuple[int, Any, torch.Tensor, list[Any]]] = deque()
        self.round_bytes = self.round_peak_bytes = 0  # launched rounds' tensors held now / at most
        super().__init__(*args, **kw)
        total = sum(t.numel() for _, t, _ in self.pieces)
        self.grad_shard = torch.zeros(total, dtype=torch.float32, device=self.device)
        at = 0
        for _, t, _ in self.pieces:
            t.grad = self.grad_shard[at:at + t.numel()].view_as(t)
            at += t.numel()
        # per bucket: this rank's pieces in it, (gradient, first element in the bucket's layout)
        self._own: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for bb in self.buffer.buckets:
            zb, at = self._where[bb.index]
            names = {self.buffer.names[k] for k in bb.params}
            self._own[bb.index] = [(t.grad.view(-1), zb.first[s.param] + s.start - at)
                                   for s, t in zb.pieces if zb.params[s.param][0] in names]

    def _make_buffer(self, named: list[tuple[str, nn.Parameter]], *, groups: list[Any], layout_numels: list[int],
                     micro_batches: int, bucket_elems: int, overlap: bool) -> Any:
        return RoundBuffer(named, groups=groups, layout_numels=layout_numels,
                           passes=[backward_passes(self.model, n) for n, _ in named], rounds=micro_batches,
                           num_layers=self.model.spec.num_layers, cap_elems=bucket_elems, overlap=overlap,
                           launch=self._launch_round)

    @property
    def grad_bytes(self) -> int:
        """The persistent gradient shard's bytes (what the memory model predicts)."""
        return self.grad_shard.numel() * self.grad_shard.element_size()

    def _launch_round(self, bb: Bucket, data: torch.Tensor, r: int) -> None:
        """Reduce one micro-batch's bucket onto its owners (module doc)."""
        del r  # rounds arrive in order; the sum does not need their index
        zb, at = self._where[bb.index]
        start = self.timer.mark()
        src = self._full_size(zb, bb, at, self.buffer.bucket_views(bb, data)) if zb.mixed else data
        works = self._reduce_pieces(zb, at, src, eager=True) if len(zb.line) > 1 else []
        self.round_bytes += src.numel() * src.element_size()
        self.round_peak_bytes = max(self.round_peak_bytes, self.round_bytes
                                    + (data.numel() * data.element_size() if src is not data else 0))
        self._flight.append((bb.index, start, src, works))
        while len(self._flight) > self.in_flight:
            self._land()

    def _land(self) -> None:
        """Finish the oldest launched round: its owners add their reduced pieces to their shard."""
        index, start, src, works = self._flight.popleft()
        for w in works:
            w.wait()
        for g, off in self._own[index]:
            g.add_(src[off:off + g.numel()])
        self.round_bytes -= src.numel() * src.element_size()
        self.reductions.append((index, start, self.timer.mark()))

    def sync(self, *, global_samples: int) -> None:
        """Finish every round (in launch order) and divide the shard by the global sample count."""
        self.flush()
        while self._flight:
            self._land()
        self.grad_shard.div_(float(global_samples))

    def zero(self) -> None:
        self.buffer.reset()
        self.grad_shard.zero_()


class Zero3Sync(Zero2Sync):
    """ZeRO-3: :class:`Zero2Sync` with the parameters sharded too (``runtime/zero_params.py``)."""

    stage = 3
    copies_params = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        topo = kw["topo"]
        self.gather = ZeroParams(self, topo=topo)

    def flush(self) -> None:
        self.gather.release_all()
        super().flush()

    def keeps_whole(self, b: Any) -> bool:
        """Groups whose parameters are gathered per use get nothing after the step: the next use gathers
        the updated masters."""
        return not self.gather.gathers(b)

    def refresh_masters(self) -> None:
        self.gather.require_whole("set the masters from the parameters")
        super().refresh_masters()
