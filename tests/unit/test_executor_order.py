"""The runtime's pipeline executor runs exactly the schedule registry's op order (the order the
predictor simulates), for every schedule and several pipeline shapes. One process drives each
stage's executor with a fake communicator; the model records what autograd really runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hethub.layout import WHOLE
from hethub.runtime import weight_grad
from hethub.runtime.pipeline import PipelineExecutor
from hethub.schedules import SCHEDULES, get_schedule

MBS, SEQ, HIDDEN = 1, 2, 3


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeComm:
    """Point-to-point that never blocks: every receive gets ones (the values do not matter here)."""

    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> _Done:
        return _Done()

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int, lane: str | None = None) -> _Done:
        tensor.fill_(1.0)
        return _Done()

    def send_completes_alone(self, dst: int, **_: object) -> bool:
        return True


class RecordingStage(nn.Module):
    """One weight GEMM (through runtime/weight_grad.linear, as the model's projections); logs each
    forward it runs and each gradient that reaches its weight (a hook: in B, or in W, which hands
    the deferred gradients to autograd's accumulation)."""

    def __init__(self, *, last: bool, log: list[str]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(HIDDEN))
        self.last, self.log = last, log
        self.w.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.log.append("B")
        return grad

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.log.append("F")
        out = weight_grad.linear(x, self.w)
        return out.sum() if self.last else out


def _run(schedule: str, *, stage: int, num_stages: int, m: int) -> tuple[list[tuple[str, int]], list[str]]:
    log: list[str] = []
    last = stage == num_stages - 1
    place = SimpleNamespace(stage=SimpleNamespace(stage=stage, num_stages=num_stages, ranks=(stage,), tp=1, cp=1,
                                                  sequence_parallel=False),
                            micro_batch_size=MBS, tp_rank=0, tp_group=(stage,), split_in=False, split_out=False,
                            num_micro_batches=m, fwd_recv_from=stage - 1 if stage else None,
                            bwd_recv_from=None if last else stage + 1, fwd_send_to=() if last else (stage + 1,),
                            bwd_send_to=(stage - 1,) if stage else (), hop_in=WHOLE, hop_out=WHOLE,
                            hop_grad_in=WHOLE, hop_grad_out=WHOLE)
    ex = PipelineExecutor(RecordingStage(last=last, log=log), place=place, comm=FakeComm(),  # type: ignore[arg-type]
                          schedule=schedule, seq_len=SEQ, hidden_size=HIDDEN)
    batches = [(torch.ones(MBS, SEQ, HIDDEN), torch.zeros(MBS, SEQ, dtype=torch.long)) for _ in range(m)]
    _, trace = ex.run(batches)
    return [(e["op"], e["mb"]) for e in trace.events], log


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("num_stages", "m"), [(1, 3), (2, 1), (2, 5), (3, 2), (4, 6), (5, 8)])
def test_executor_runs_the_registry_op_order(schedule, num_stages, m):
    sched = get_schedule(schedule)
    for stage in range(num_stages):
        want = [(o.kind, o.micro_batch) for o in sched.ops(stage=stage, num_stages=num_stages, num_micro_batches=m)]
        ran, autograd_log = _run(schedule, stage=stage, num_stages=num_stages, m=m)
        assert ran == want
        # What the model saw is the same sequence of forwards and backwards, not just what was logged.
        # Its weight gradient is computed in B, or, under a split backward, in W (the first stage,
        # which sends no input gradient, runs its whole backward in B and an empty W).
        weight_grad_op = "W" if sched.split_backward and stage > 0 else "B"
        assert autograd_log == [{"F": "F", weight_grad_op: "B"}[kind] for kind, _ in want
                                if kind == "F" or kind == weight_grad_op]
