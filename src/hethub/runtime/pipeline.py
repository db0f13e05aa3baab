"""Runs one stage's share of a 1F1B or GPipe schedule over micro-batches with explicit p2p.

Why not ``torch.distributed.pipelining``: it assumes one rank per stage per pipeline group and
sends straight over c10d. Here adjacent stages may have different TP degrees (receiver q of a TP-b
stage reads from sender q % a of the TP-a stage before it; sender j gets its output gradient from
receiver j % b), and every message must go through our Communicator so a later bridge can route
it across device kinds. What is left is small: the op order (shared with the predictor, see
``topology.schedule_ops``), isend + blocking recv with a tag per micro-batch and direction, and
waiting on all sends before the step ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.comm.communicator import Communicator
from hethub.runtime.emulation import Emulator
from hethub.runtime.model import StageModel
from hethub.runtime.topology import RankPlace, schedule_ops


def fwd_tag(mb: int) -> int:
    return 2 * mb


def bwd_tag(mb: int) -> int:
    return 2 * mb + 1


@dataclass
class StepTrace:
    """Per-rank timing of one step, seconds relative to the step start."""

    events: list[dict[str, Any]] = field(default_factory=list)  # {"op","mb","start_s","end_s"}
    busy_s: float = 0.0  # compute incl. emulated sleep
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0


class PipelineExecutor:
    def __init__(self, model: StageModel, *, place: RankPlace, comm: Communicator, schedule: str, seq_len: int,
                 hidden_size: int, emulator: Emulator | None = None, act_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        self.model, self.place, self.comm = model, place, comm
        st = place.stage
        self.first, self.last = st.stage == 0, st.stage == st.num_stages - 1
        self.ops = schedule_ops(schedule, stage=st.stage, num_stages=st.num_stages,
                                num_micro_batches=place.num_micro_batches)
        self.act_shape = (place.micro_batch_size, seq_len, hidden_size)
        self.emulator = emulator or Emulator()
        self.act_dtype, self.device = act_dtype, device or torch.device("cpu")

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, t0: float | None = None,
            ) -> tuple[float, StepTrace]:
        """Forward and backward every micro-batch in schedule order; gradients accumulate in the model.

        ``micro_batches[i]`` is (inputs, targets) of micro-batch i (only the first stage reads the
        inputs, only the last the targets). Returns this rank's summed loss (0 off the head stage).
        """
        t0 = time.perf_counter() if t0 is None else t0
        trace = StepTrace()
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        pending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until sent)
        loss_sum = 0.0
        for op, mb in self.ops:
            if op == "F":
                x = self._recv_activation(mb, micro_batches, trace)
                start = time.perf_counter()
                with self.emulator.chunk():
                    out = self.model(x, micro_batches[mb][1] if self.last else None)
                self._record(trace, "F", mb, start, t0)
                if self.last:
                    loss_sum += float(out.detach())
                else:
                    payload = out.detach().to(self.act_dtype)
                    pending += [(self.comm.isend(payload, dst=d, tag=fwd_tag(mb)), payload)
                                for d in self.place.fwd_send_to]
                inputs[mb], outputs[mb] = x, out
            else:
                grad = None
                if not self.last:
                    grad = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                    w = time.perf_counter()
                    self.comm.recv(grad, src=self.place.bwd_recv_from, tag=bwd_tag(mb))  # type: ignore[arg-type]
                    trace.recv_wait_s += time.perf_counter() - w
                x, out = inputs.pop(mb), outputs.pop(mb)
                start = time.perf_counter()
                with self.emulator.chunk():
                    torch.autograd.backward(out, grad_tensors=None if grad is None else grad.to(out.dtype))
                self._record(trace, "B", mb, start, t0)
                if not self.first:
                    g = x.grad.to(self.act_dtype)
                    pending += [(self.comm.isend(g, dst=d, tag=bwd_tag(mb)), g) for d in self.place.bwd_send_to]
        w = time.perf_counter()
        for work, _ in pending:
            work.wait()
        trace.send_wait_s = time.perf_counter() - w
        return loss_sum, trace

    def _recv_activation(self, mb: int, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         trace: StepTrace) -> torch.Tensor:
        if self.first:
            return micro_batches[mb][0]
        buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
        w = time.perf_counter()
        self.comm.recv(buf, src=self.place.fwd_recv_from, tag=fwd_tag(mb))  # type: ignore[arg-type]
        trace.recv_wait_s += time.perf_counter() - w
        return buf.requires_grad_(True)

    @staticmethod
    def _record(trace: StepTrace, op: str, mb: int, start: float, t0: float) -> None:
        end = time.perf_counter()
        trace.busy_s += end - start
        trace.events.append({"op": op, "mb": mb, "start_s": round(start - t0, 6), "end_s": round(end - t0, 6)})
