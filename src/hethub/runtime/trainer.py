"""One rank's training step: its stage of the plan, the schedule, gradient sync, clipping, AdamW.

Built from a plan, a rank and a Communicator (groups are created here from the topology, on every
rank in the same order). Used by ``hethub.train`` and directly by the distributed tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.comm.communicator import Communicator
from hethub.layout import build_topology
from hethub.plan import Plan
from hethub.runtime.data import Share, micro_batches
from hethub.runtime.data_parallel import GradSync
from hethub.runtime.emulated_links import EmulatedLinks, emulated_links_of
from hethub.runtime.metrics import rank_record, step_record
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer, build_optimizer_for
from hethub.runtime.pipeline import PipelineExecutor
from hethub.runtime.precision import DynamicLossScaler, autocast, boundary_dtype, compute_dtype, kind_precision
from hethub.runtime.slowdown import Emulator
from hethub.runtime.tensor_parallel import TPContext
from hethub.runtime.zero import ZeroSync


@dataclass(frozen=True)
class TrainerConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    device: str = "cpu"
    # Each stage trains in its kind's precision as the plan gives it (runtime/precision.kind_precision), except
    # that kinds computing on the CPU stay fp32 unless ``cpu_autocast`` (tests of mixed precision on
    # a CPU host). ``precision`` overrides the plan for every rank.
    precision: str | dict[str, str] | None = None  # one for all kinds, or per kind
    cpu_autocast: bool = False
    # fp16 loss scaling (used when any kind trains in fp16-mixed): the initial scale and the good
    # steps before it doubles; torch.amp.GradScaler's defaults.
    init_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    trace: bool = False  # log every micro-batch's forward/backward interval, not just per-step totals


class Trainer:
    def __init__(self, plan: Plan, *, rank: int, comm: Communicator, cfg: TrainerConfig | None = None) -> None:
        self.plan, self.rank, self.comm = plan, rank, comm
        self.cfg = cfg or TrainerConfig()
        self.topo = build_topology(plan)
        comm.create_groups(self.topo.groups)
        self.place = place = self.topo.place(rank)
        st = place.stage
        self.kind = plan.cluster.kinds[st.kind]
        tp = TPContext(size=st.tp, rank=place.tp_rank, group=tuple(sorted(st.ranks)),
                       comm=comm if st.tp > 1 else None)
        self.device = torch.device(self.cfg.device)
        self.precisions = {k: kind_precision(plan, k, override=self.cfg.precision, cpu_autocast=self.cfg.cpu_autocast)
                           for k in plan.cluster.kinds}
        self.precision = self.precisions[st.kind]
        self.model = StageModel(plan.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=tp,
                                recompute=st.recompute, seed=self.cfg.seed, rope_len=plan.seq_len,
                                attention=plan.attention_of(st.kind), chunks=st.chunks,
                                compute_dtype=compute_dtype(self.precision)).to(self.device)
        self.emulator = Emulator(self.kind.emulated_slowdown)
        stages = plan.pipelines[st.pipeline].stages
        upstream = stages[st.stage - 1].kind if st.stage > 0 else st.kind
        # Emulated slow links (local emulation only) hold back the pipeline's p2p messages.
        host = plan.cluster.host
        p2p = (EmulatedLinks(comm, link_of=emulated_links_of(plan.cluster, plan.devices))
               if host is not None and host.links else comm)
        self.executor = PipelineExecutor(self.model, place=place, comm=p2p, schedule=plan.schedule,
                                         seq_len=plan.seq_len, hidden_size=plan.model.hidden_size,
                                         emulator=self.emulator, device=self.device,
                                         in_dtype=boundary_dtype(self.precisions[upstream]),
                                         out_dtype=boundary_dtype(self.precision),
                                         # virtual stages: the last stage sends chunk c's output to the first's
                                         wrap_dtype=boundary_dtype(self.precisions[stages[-1].kind]))
        used = {plan.cluster.devices[d].kind for d in plan.devices}
        self.scaler = (DynamicLossScaler(scale=self.cfg.init_loss_scale,
                                         growth_interval=self.cfg.loss_scale_growth_interval)
                       if any(self.precisions[k] == "fp16-mixed" for k in used) else None)
        self.last_step_skipped = False
        self.zero: ZeroSync | None = None
        if plan.sharded_optimizer:  # ZeRO-1: this rank's AdamW steps only its slices (runtime/zero.py)
            # Ranks computing in 16 bits store their parameters so and shard the fp32 masters.
            dtypes = {r: compute_dtype(self.precisions[self.topo.place(r).stage.kind]) or torch.float32
                      for r in range(plan.world_size)}
            self.zero = ZeroSync(self.model, topo=self.topo, rank=rank, comm=comm,
                                 weights=plan.rank_shard_weights(), param_dtypes=dtypes)
            self.grad_sync: GradSync | ZeroSync = self.zero
            self.optimizer, self.scheduler = build_optimizer_for(self.zero.pieces, self.cfg.optim)
        else:
            self.grad_sync = GradSync(self.model, topo=self.topo, rank=rank, comm=comm)
            self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim)
        self.share = Share(offset=place.sample_offset, micro_batch_size=place.micro_batch_size,
                           num_micro_batches=place.num_micro_batches)
        self._reports_loss = st.head and place.tp_rank == 0

    def forward_backward(self, batch: torch.Tensor, *, t0: float | None = None) -> tuple[float, Any]:
        """Run this rank's schedule on its share of a [global_batch, seq_len+1] batch.

        Returns (global mean loss, trace); gradients are left *unsynchronised* in the model.
        """
        mbs = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches(batch, self.share)]
        self.executor.loss_scale = self.scaler.scale if self.scaler else 1.0
        with autocast(self.device, self.precision):
            loss_sum, trace = self.executor.run(mbs, t0=t0)
        total = torch.tensor([loss_sum if self._reports_loss else 0.0], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(total)
        return float(total) / self.plan.global_batch, trace

    def sync_grads(self) -> None:
        self.grad_sync.sync(global_samples=self.plan.global_batch)

    def clip_and_update(self) -> float:
        """Unscale (fp16), clip to the global norm and step; returns the norm before clipping.

        With loss scaling, a non-finite global norm means a gradient overflowed on some rank: every
        rank sees the same norm, so all skip this step together (no update, no LR step) and the scale
        backs off."""
        if self.scaler:
            self.grad_sync.unscale(self.scaler.scale)
        total = self.grad_sync.global_norm()
        norm = float(total)
        self.last_step_skipped = bool(self.scaler and self.scaler.overflowed(norm))
        if self.scaler:
            self.scaler.update(overflow=self.last_step_skipped)
        if self.last_step_skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.grad_sync.zero()
            return norm
        self.grad_sync.clip_with(total, max_norm=self.cfg.optim.grad_clip)
        self.optimizer.step()
        if self.zero is not None:
            self.zero.after_step()  # all-gather the updated slices into every holder's parameters
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_sync.zero()
        return norm

    def train_step(self, batch: torch.Tensor, *, step: int) -> dict[str, Any] | None:
        """One optimizer step; returns the step's metrics record on the log rank, None elsewhere."""
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        slept0, cpu0 = self.emulator.slept_s, self.emulator.cpu_s
        loss_scale = self.scaler.scale if self.scaler else 1.0
        loss, trace = self.forward_backward(batch, t0=t0)
        t_sync = time.perf_counter()
        self.sync_grads()
        t_opt = time.perf_counter()
        norm = self.clip_and_update()
        end = time.perf_counter()
        rec = rank_record(rank=self.rank, place=self.place, trace=trace, sync_s=t_opt - t_sync, optim_s=end - t_opt,
                          step_s=end - t0, emulated_sleep_s=self.emulator.slept_s - slept0,
                          compute_cpu_s=self.emulator.cpu_s - cpu0, detail=self.cfg.trace)
        gathered = self.comm.gather_objects(rec, dst=self.topo.log_rank)
        if gathered is None:
            return None
        out = step_record(plan=self.plan, topo=self.topo, step=step, loss=loss, lr=lr, grad_norm=norm,
                          ranks=gathered)
        out["precision"] = {k: self.precisions[k] for k in out["kinds"]}
        if self.scaler:
            # The scale used for this step's backward, and whether the step was skipped for overflow.
            out["loss_scale"], out["skipped"] = loss_scale, self.last_step_skipped
        return out
