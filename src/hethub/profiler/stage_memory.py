"""What one rank of a plan's stage really holds at its peak, by storage accounting (any device).

The rank's module is the runtime's (:class:`StageModel`, with its TP shard); training state is read
after one AdamW step; activations are the storages autograd saves for backward while the stage
holds the schedule's peak number of micro-batches in flight (``Schedule.in_flight``), each
forwarded as the pipeline executor does. TP collectives are skipped (they do not change what is
saved: the all-reduce's output is a fresh tensor either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hethub.plan import Plan
from hethub.profiler.tensor_memory import StateBytes, saved_for_backward, training_state_bytes
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.tensor_parallel import TPContext
from hethub.schedules import get_schedule


@dataclass(frozen=True)
class MeasuredMemory:
    state: StateBytes
    activations_bytes: int
    in_flight: int

    @property
    def total_bytes(self) -> int:
        return self.state.total_bytes + self.activations_bytes


class _NoCollectives:
    def all_reduce(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        return tensor


def measure_stage_memory(plan: Plan, *, pipeline: int, stage: int, tp_rank: int = 0, seed: int = 0
                         ) -> MeasuredMemory:
    torch.manual_seed(seed)
    pipe = plan.pipelines[pipeline]
    st = pipe.stages[stage]
    tp = TPContext(size=st.tp, rank=tp_rank, group=tuple(range(st.tp)),
                   comm=_NoCollectives() if st.tp > 1 else None)  # type: ignore[arg-type]
    model = StageModel(plan.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=tp,
                       recompute=st.recompute, seed=seed)
    opt, _ = build_optimizer(model, OptimConfig())
    in_flight = get_schedule(plan.schedule).in_flight(stage=stage, num_stages=len(pipe.stages),
                                                      num_micro_batches=pipe.num_micro_batches)
    mbs, s, v = pipe.micro_batch_size, plan.seq_len, plan.model.vocab_size
    # Model state (parameters, RoPE tables) is not activation memory.
    exclude = [*model.parameters(), *model.buffers()]
    outs = []
    with saved_for_backward(exclude=exclude) as rec:
        for _ in range(in_flight):
            x = (torch.randint(0, v, (mbs, s)) if st.embedding
                 else torch.randn(mbs, s, plan.model.hidden_size).requires_grad_(True))
            outs.append(model(x, torch.randint(0, v, (mbs, s)) if st.head else None))
    acts = rec.nbytes
    for out in outs:
        torch.autograd.backward(out, grad_tensors=None if st.head else torch.ones_like(out))
    opt.step()
    return MeasuredMemory(state=training_state_bytes(model, opt), activations_bytes=acts, in_flight=in_flight)
