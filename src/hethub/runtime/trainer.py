"""One rank's training step: its stage of the plan, the schedule, gradient sync, clipping, AdamW.

Built from a plan, a rank and a Communicator (groups are created here from the topology, on every
rank in the same order). Used by ``hethub.train`` and directly by the distributed tests.

No host synchronisation inside a step: the loss stays a device tensor (summed over micro-batches on
the device, all-reduced there), gradient buckets are reduced while the backward runs, clipping
scales on the device, and the step reads its metrics (loss, gradient norm) to the host once, at its
end; with fp16 loss scaling that one read comes before the update, whose skip it decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.comm.communicator import Communicator
from hethub.layout import DEFAULT_BUCKET_ELEMS, build_topology
from hethub.plan import Plan
from hethub.runtime.compile import compile_blocks
from hethub.runtime.context_parallel import CPContext
from hethub.runtime.data import Share, micro_batches
from hethub.runtime.data_parallel import GradSync
from hethub.runtime.emulated_links import EmulatedLinks, emulated_links_of
from hethub.runtime.metrics import rank_record, step_record
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer_for
from hethub.runtime.pipeline import PipelineExecutor
from hethub.runtime.precision import (
    DynamicLossScaler,
    MasterWeights,
    autocast,
    boundary_dtype,
    compute_dtype,
    kind_precision,
    param_dtype,
)
from hethub.runtime.slowdown import Emulator
from hethub.runtime.tensor_parallel import TPContext
from hethub.runtime.timing import OpTimer
from hethub.runtime.zero import ZeroSync
from hethub.runtime.zero_grads import Zero2Sync, Zero3Sync

_ZERO = {1: ZeroSync, 2: Zero2Sync, 3: Zero3Sync}


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
    # Data-parallel gradient buckets (runtime/grad_buffer.py): their size in elements, and whether each
    # is reduced as soon as its gradients are final in the last backward (else all after the backward).
    grad_bucket_elems: int = DEFAULT_BUCKET_ELEMS
    overlap_grad_reduce: bool = True
    compile: bool = False  # torch.compile each decoder block (runtime/compile.py)


class Trainer:
    def __init__(self, plan: Plan, *, rank: int, comm: Communicator, cfg: TrainerConfig | None = None) -> None:
        self.plan, self.rank, self.comm = plan, rank, comm
        self.cfg = cfg or TrainerConfig()
        self.topo = build_topology(plan)
        comm.create_groups(self.topo.groups)
        comm.create_p2p_lanes(self.topo.p2p_lanes)
        self.place = place = self.topo.place(rank)
        st = place.stage
        self.kind = plan.cluster.kinds[st.kind]
        tp = TPContext(size=st.tp, rank=place.tp_rank, group=tuple(sorted(place.tp_group)),
                       comm=comm if st.tp > 1 else None, sequence_parallel=st.sequence_parallel,
                       order=place.tp_group)
        cp = CPContext(size=st.cp, rank=place.cp_rank, ring=place.cp_group, comm=comm if st.cp > 1 else None)
        self.device = torch.device(self.cfg.device)
        self.precisions = {k: kind_precision(plan, k, override=self.cfg.precision, cpu_autocast=self.cfg.cpu_autocast)
                           for k in plan.cluster.kinds}
        self.precision = self.precisions[st.kind]
        self.model = StageModel(plan.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=tp,
                                recompute=st.recompute, seed=self.cfg.seed, rope_len=plan.seq_len,
                                attention=plan.attention_of(st.kind), chunks=st.chunks,
                                compute_dtype=compute_dtype(self.precision), cp=cp).to(self.device)
        if self.cfg.compile:
            compile_blocks(self.model)
        self.timer = OpTimer(self.device)
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
                                         wrap_dtype=boundary_dtype(self.precisions[stages[-1].kind]),
                                         timer=self.timer)
        used = {plan.cluster.devices[d].kind for d in plan.devices}
        self.scaler = (DynamicLossScaler(scale=self.cfg.init_loss_scale,
                                         growth_interval=self.cfg.loss_scale_growth_interval)
                       if any(self.precisions[k] == "fp16-mixed" for k in used) else None)
        self.last_step_skipped = False
        self.zero: ZeroSync | None = None
        self.masters: MasterWeights | None = None
        buckets = {"bucket_elems": self.cfg.grad_bucket_elems, "overlap": self.cfg.overlap_grad_reduce,
                   "timer": self.timer}
        # Ranks computing in 16 bits store their parameters so; AdamW steps fp32 masters (precision.py).
        if plan.sharded_optimizer:  # ZeRO-1/2/3: this rank's AdamW steps only its slices (runtime/zero.py)
            dtypes = {r: param_dtype(self.precisions[self.topo.place(r).stage.kind]) for r in range(plan.world_size)}
            self.zero = _ZERO[plan.zero_stage](self.model, topo=self.topo, rank=rank, comm=comm,
                                 weights=plan.rank_shard_weights(), param_dtypes=dtypes, **buckets)
            self.grad_sync: GradSync | ZeroSync = self.zero
            self.optimizer, self.scheduler = build_optimizer_for(self.zero.pieces, self.cfg.optim)
        else:
            self.masters = MasterWeights(sorted(self.model.named_parameters()), dtype=param_dtype(self.precision))
            self.grad_sync = GradSync(self.model, topo=self.topo, rank=rank, comm=comm, **buckets)
            self.masters.bind_grads()
            self.optimizer, self.scheduler = build_optimizer_for(self.masters.pieces(), self.cfg.optim)
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.metrics: tuple[float, float] | None = None
        self.backward_end_s = 0.0
        self.share = Share(offset=place.sample_offset, micro_batch_size=place.micro_batch_size,
                           num_micro_batches=place.num_micro_batches)
        self._reports_loss = st.head and place.tp_rank == 0

    def forward_backward(self, batch: torch.Tensor, *, t0: Any = None) -> tuple[torch.Tensor, Any]:
        """Run this rank's schedule on its share of a [global_batch, seq_len+1] batch.

        Returns (global mean loss, trace): the loss a 0-dim float64 tensor on the device (reading it
        synchronises the host), the same on every rank. Every gradient bucket's reduction has been
        started when this returns; :meth:`sync_grads` finishes them. ``t0``: the step's start mark
        (``self.timer``)."""
        t0 = self.timer.mark() if t0 is None else t0
        self.grad_sync.begin_step(t0)
        mbs = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches(batch, self.share)]
        self.executor.loss_scale = self.scaler.scale if self.scaler else 1.0
        with autocast(self.device, self.precision):
            loss_sum, trace = self.executor.run(mbs, t0=t0)
        self.backward_end_s = time.perf_counter()
        self.grad_sync.flush()  # every bucket started, on every rank, before the next collective
        total = (loss_sum.reshape(1) if self._reports_loss
                 else torch.zeros(1, dtype=torch.float64, device=self.device))
        self.comm.all_reduce(total)
        self.loss = (total / self.plan.global_batch).reshape(())
        return self.loss, trace

    def sync_grads(self) -> None:
        self.grad_sync.sync(global_samples=self.plan.global_batch)

    def clip_and_update(self) -> torch.Tensor:
        """Unscale (fp16), clip to the global norm and step; returns the norm before clipping (a 0-dim
        float64 tensor on the device).

        With loss scaling, a non-finite global norm means a gradient overflowed on some rank: every
        rank sees the same norm, so all skip this step together (no update, no LR step) and the scale
        backs off. That decision is the step's one host read (:meth:`read_metrics`)."""
        self.metrics = None
        if self.scaler:
            self.grad_sync.unscale(self.scaler.scale)
        total = self.grad_sync.global_norm()
        if self.scaler:
            norm = self.read_metrics(total)[1]
            self.last_step_skipped = self.scaler.overflowed(norm)
            self.scaler.update(overflow=self.last_step_skipped)
            if self.last_step_skipped:
                self.grad_sync.zero()
                return total.reshape(())
        self.grad_sync.clip_with(total, max_norm=self.cfg.optim.grad_clip)
        self.optimizer.step()
        if self.zero is not None:
            self.zero.after_step()  # all-gather the updated slices into every holder's parameters
        elif self.masters is not None:
            self.masters.copy_to_params()
        self.scheduler.step()
        self.grad_sync.zero()
        return total.reshape(())

    def read_metrics(self, norm: torch.Tensor) -> tuple[float, float]:
        """(loss, gradient norm) on the host: the step's one synchronisation (kept once read)."""
        if self.metrics is None:
            loss, value = torch.cat([self.loss.reshape(1).double(), norm.reshape(1).double()]).tolist()
            self.metrics = (loss, value)
        return self.metrics

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Collective under ZeRO-1: set the fp32 masters from the parameters again, after weights
        were loaded into the model (``--init-from``)."""
        if self.zero is not None:
            self.zero.refresh_masters()
        elif self.masters is not None:
            self.masters.refresh()

    def train_step(self, batch: torch.Tensor, *, step: int) -> dict[str, Any] | None:
        """One optimizer step; returns the step's metrics record on the log rank, None elsewhere."""
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        t0_mark = t0 if not self.timer.device_events else self.timer.mark()
        slept0, cpu0 = self.emulator.slept_s, self.emulator.cpu_s
        loss_scale = self.scaler.scale if self.scaler else 1.0
        _, trace = self.forward_backward(batch, t0=t0_mark)
        t_sync = self.backward_end_s
        self.sync_grads()
        t_opt = time.perf_counter()
        loss, norm = self.read_metrics(self.clip_and_update())
        end = time.perf_counter()
        if self.timer.device_events:
            trace.resolve(self.timer, t0_mark)
        reductions = [{"bucket": k, "start_s": round(self.timer.seconds(t0_mark, a), 6),
                       "end_s": round(self.timer.seconds(t0_mark, b), 6)} for k, a, b in self.grad_sync.reductions]
        rec = rank_record(rank=self.rank, place=self.place, trace=trace, sync_s=t_opt - t_sync,
                          optim_s=end - t_opt, step_s=end - t0, emulated_sleep_s=self.emulator.slept_s - slept0,
                          compute_cpu_s=self.emulator.cpu_s - cpu0, detail=self.cfg.trace,
                          reductions=reductions)
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
