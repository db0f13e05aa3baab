"""What one rank sends to, and makes of what it receives from, an adjacent stage, per ``layout.Hop``.

A message is one CP rank's part of a micro-batch's activation or gradient, [b, s/cp, h]. A stage
holds it whole on every TP rank, or, under sequence parallelism, TP rank q holds its sequence slice
q ([b, s/(cp t), h]). The hop says what travels (the whole tensor, the receiver's flat 1/t, or its
sequence slice; t the receiving stage's TP degree) and who all-gathers over a TP group: the sender
before sending (a sequence-parallel stage facing another TP degree), or the receiver on arrival.
The TP gathers run on the stage's own TP group, usually the fast intra-node (native) link; the
inter-stage link, across kinds the bridge, carries one copy whatever the two TP degrees.
"""

from __future__ import annotations

import torch

from hethub.comm.communicator import Communicator
from hethub.layout import Hop, RankPlace


class StageMessages:
    def __init__(self, *, place: RankPlace, comm: Communicator, micro_batch_size: int, seq_len: int,
                 hidden_size: int) -> None:
        st = place.stage
        self.place, self.comm = place, comm
        self.tp, self.tp_rank = st.tp, place.tp_rank
        self.order = place.tp_group  # TP rank order
        self.sp = st.sequence_parallel
        self.shape = (micro_batch_size, seq_len // st.cp, hidden_size)  # this CP rank's whole message

    def outgoing(self, t: torch.Tensor, hop: Hop, *, dests: int) -> list[torch.Tensor]:
        """The payload for each of ``dests`` receivers (in the layout's order: TP ranks q = j, j + t,
        ...) of this rank's tensor ``t`` (its slice under sequence parallelism)."""
        if hop.source_gathers:
            t = self.gather_seq(t)
        whole = not self.sp or hop.source_gathers
        if hop.piece == "whole":
            return [t] * dests
        # Pieces are copies: a view would keep the whole tensor's storage until the send is released.
        if hop.piece == "flat":  # receivers q = j, j + a, ... get slices q of t (the receiving degree)
            flat = t.reshape(-1).chunk(hop.parts)
            return [flat[self.tp_rank + i * self.tp].clone() for i in range(dests)]
        if not whole:  # a sequence-parallel sender facing its own TP degree: its slice is the receiver's
            return [t.contiguous()] * dests
        parts = hop.parts
        return [t.chunk(parts, dim=1)[self.tp_rank + i * self.tp].clone(memory_format=torch.contiguous_format)
                for i in range(dests)]

    def recv_shape(self, hop: Hop) -> tuple[int, ...]:
        """The buffer a receive of ``hop`` posts."""
        if hop.piece == "flat":
            return (self.shape[0] * self.shape[1] * self.shape[2] // hop.parts,)
        if hop.piece == "seq":
            return (self.shape[0], self.shape[1] // self.tp, self.shape[2])
        return self.shape

    def arrived(self, buf: torch.Tensor, hop: Hop) -> torch.Tensor:
        """What the receiving rank works on: the buffer, or the pieces all-gathered over its TP group."""
        if not hop.dest_gathers:
            return buf
        if hop.piece == "seq":
            return self.gather_seq(buf)
        ranks = tuple(sorted(self.order))
        pieces = self.comm.all_gather(buf, group=ranks).chunk(len(ranks))
        return torch.cat([pieces[ranks.index(r)] for r in self.order]).view(self.shape)

    def gather_seq(self, t: torch.Tensor) -> torch.Tensor:
        """TP rank q's sequence slice at q: the whole (CP-local) sequence, outside autograd."""
        ranks = tuple(sorted(self.order))
        parts = self.comm.all_gather(t.contiguous(), group=ranks, dim=1).chunk(len(ranks), dim=1)
        return torch.cat([parts[ranks.index(r)] for r in self.order], dim=1)
