"""The point-to-point buffers a pipeline stage holds beside its activations.

The runtime (``runtime/p2p.py``) posts, after each op of the stage's schedule, one batch of that
op's sends and the receive the next op needs, and waits for it before the next op runs; a sent
stage output keeps no values. So besides the saved activations (a received input is one of them
once its forward runs) a device holds at most one op's send buffer (one per op whatever the number
of receivers) and one receive buffer: the term is the largest sum, over consecutive ops, of what
the first sends and the second receives. Messages are the stage's activation or its gradient, a
TP rank's slice of it on a split hop (``layout.split_hop``), in the sending stage's boundary dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.schedules import Op


@dataclass(frozen=True)
class StageMessages:
    """Bytes of one stage's messages on each boundary (0 where there is none): the input boundary
    (activation in, its gradient out) and the output boundary (activation out, gradient in), and,
    for virtual stages, the wrap hop between the last stage and the first (whole tensors)."""

    stage: int
    num_stages: int
    chunks: int
    in_bytes: float
    out_bytes: float
    wrap_bytes: float = 0.0

    def input_bytes(self, chunk: int) -> float:
        """Bytes of chunk ``chunk``'s input boundary (0 for the pipeline's first virtual stage)."""
        if self.stage > 0:
            return self.in_bytes
        return self.wrap_bytes if chunk > 0 else 0.0

    def output_bytes(self, chunk: int) -> float:
        """Bytes of chunk ``chunk``'s output boundary (0 for the last virtual stage)."""
        if self.stage < self.num_stages - 1:
            return self.out_bytes
        return self.wrap_bytes if chunk < self.chunks - 1 else 0.0


def p2p_buffer_bytes(ops: Sequence[Op], msgs: StageMessages) -> float:
    """Peak bytes of the point-to-point buffers a device of the stage holds at once (module doc)."""
    def sent(op: Op) -> float:
        if op.kind == "F":
            return msgs.output_bytes(op.chunk)
        return msgs.input_bytes(op.chunk) if op.kind == "B" else 0.0

    def received(op: Op) -> float:
        if op.kind == "F":
            return msgs.input_bytes(op.chunk)
        return msgs.output_bytes(op.chunk) if op.kind == "B" else 0.0

    if not ops:
        return 0.0
    peak = max(received(ops[0]), sent(ops[-1]))
    for a, b in itertools.pairwise(ops):
        peak = max(peak, sent(a) + received(b))
    return peak
