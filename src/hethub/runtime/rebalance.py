"""Online re-balancing inside a run: measure, decide once, apply on every rank at a step boundary.

After each step the log rank (which already gathers every rank's record for the metrics) feeds the
records to the pure policy (``hethub.rebalance``); a decision it returns is sent to every rank as a
few integers in one all-reduce (only the log rank contributes non-zeros), so all ranks apply the same
change between the same two steps: no restart, no new process.

* **Shares** (new micro-batch counts): nothing moves. Each rank takes its new slice of every global
  batch, its schedule's ops and its gradient buckets' accumulation counts for the new count;
  parameters, optimizer state and groups stay. The
  gradient of the mean loss over the same global batch is unchanged (the sync divides by the global
  sample count), so training stays that of one device.
* **A layer move**: every rank rebuilds its trainer from the new plan, carrying its state over by
  parameter name the way a checkpoint does (``checkpoint.full_states`` / ``load_full_state``, in
  memory): full-size tensors are copied to host memory first and the old stage released, so the
  device holds one stage at a time; the moved layer's parameters and AdamW state travel from the
  sending stage (gathered over its TP group) to every rank of the receiving stage, which slices its
  TP shard. Every rank rebuilds because the layer's gradient-sync group changes for its replicas in
  other pipelines too, and new groups are created collectively.

``--emulate-slowdown`` (local emulation) slows ranks from a given step through their emulator.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from hethub.errors import RuntimeSetupError
from hethub.layout import build_topology, unit_param_prefix
from hethub.plan import Plan
from hethub.rebalance import Decision, LayerMove, Observation, RebalanceConfig, Rebalancer
from hethub.rebalance.decision import shares_of, stage_layers_of
from hethub.runtime.checkpoint import full_states, load_full_state, restore_schedule
from hethub.runtime.data import Share
from hethub.runtime.slowdown import SlowdownAt, slowdown_at
from hethub.runtime.trainer import Trainer
from hethub.schedules import get_schedule

# The optimizer shardings whose share changes and layer moves the parity tests cover.
UNDER_TEST = ("none", "zero1")
# Tags of the moved layer's messages: far above the pipeline's (2 x micro-batches x chunks).
_MOVE_TAG = 1 << 24


class LiveRebalance:
    """One run's re-balancing: call :meth:`before_step` and :meth:`after_step` around every step on
    every rank (``after_step`` is collective when the mode may change anything)."""

    def __init__(self, trainer: Trainer, *, cfg: RebalanceConfig, slowdowns: Sequence[SlowdownAt] = (),
                 say: Callable[[str], None] | None = None) -> None:
        self.say = say or (lambda text: print(f"hethub.train: {text}", flush=True))
        logs = trainer.rank == trainer.topo.log_rank
        if cfg.changes and trainer.plan.optimizer_sharding not in UNDER_TEST:
            # Not yet proven to keep one device's numerics there (tests/dist/test_rebalance_parity.py).
            if logs:
                self.say(f"--rebalance {cfg.mode}: not offered under optimizer sharding "
                         f"{trainer.plan.optimizer_sharding!r} yet; measuring and naming stragglers only")
            cfg = replace(cfg, mode="off")
        self.trainer, self.cfg, self.slowdowns = trainer, cfg, tuple(slowdowns)
        self.policy = Rebalancer(cfg, trainer.plan) if logs else None
        self._named: tuple[int, ...] = ()
        if self.policy is not None and cfg.mode == "layers" and not self.policy.moves_layers:
            self.say("--rebalance layers: the plan carries no per-stage memory limits (meta.rebalance.max_layers, "
                     "which 'python -m hethub.train' computes), so only shares are re-balanced")

    @staticmethod
    def from_args(args: argparse.Namespace, trainer: Trainer) -> LiveRebalance:
        slow = tuple(args.emulate_slowdown or ())
        plan = trainer.plan
        for s in slow:
            if s.target not in plan.cluster.kinds and not (s.target.isdigit() and int(s.target) < plan.world_size):
                raise RuntimeSetupError(f"--emulate-slowdown {s}: {s.target!r} is neither a rank "
                                        f"(0..{plan.world_size - 1}) nor a kind of the plan's cluster "
                                        f"({', '.join(plan.cluster.kinds)}). Fix: name one of those.")
        cfg = RebalanceConfig(mode=args.rebalance, min_gain=args.rebalance_min_gain,
                              patience=args.rebalance_patience, straggler_factor=args.straggler_factor)
        return LiveRebalance(trainer, cfg=cfg, slowdowns=slow)

    def before_step(self, step: int) -> None:
        """Emulated slowdowns that start at ``step`` (``--emulate-slowdown``)."""
        if self.slowdowns:
            t = self.trainer
            t.emulator.drift = slowdown_at(self.slowdowns, rank=t.rank, kind=t.place.stage.kind, step=step)

    def after_step(self, step: int, rec: dict[str, Any] | None, *,
                   before_change: Callable[[], None] | None = None) -> Decision | None:
        """Measure (log rank: ``rec`` is its step record, annotated here), decide, and apply the decision
        on every rank; returns the decision applied, if any. ``before_change`` runs on every rank just
        before a change (the run commits a checkpoint in flight there, so it records the plan it saved)."""
        t = self.trainer
        obs = self._observe(step, rec)
        if not self.cfg.changes:
            return None
        vec = torch.zeros(Decision.encoded_len(len(t.plan.pipelines)), dtype=torch.int64, device=t.device)
        if obs is not None and obs.decision is not None:
            vec.copy_(torch.tensor(obs.decision.encode(), dtype=torch.int64))
        t.comm.all_reduce(vec)  # the log rank's decision (or zeros), on every rank
        decision = Decision.decode(vec.tolist())
        if decision is None:
            return None
        if before_change is not None:
            before_change()
        old = t.plan
        plan = decision.apply(old)
        if decision.move is None:
            set_shares(t, plan)
        else:
            move_layer(t, plan, decision.move, old_plan=old)
        if self.policy is not None and obs is not None and obs.decision is not None:
            self.policy.applied(step, obs.decision, plan)
            change = obs.decision.to_record(old)
            if rec is not None:
                rec.setdefault("rebalance", {})["change"] = change
            what = (f"moved {decision.move.describe(old)}" if decision.move is not None
                    else f"shares {shares_of(old)} -> {list(decision.counts)}")
            self.say(f"re-balanced after step {step}: {what}; predicted step {obs.decision.step_s:.4g} s -> "
                     f"{obs.decision.new_step_s:.4g} s ({obs.decision.gain:.1%} faster). Why: {obs.decision.reason}")
        return decision

    def _observe(self, step: int, rec: dict[str, Any] | None) -> Observation | None:
        if self.policy is None or rec is None:
            return None
        plan = self.trainer.plan
        obs = self.policy.observe(step, rec["ranks"], step_time_s=rec["step_time_s"])
        rec["rebalance"] = {"mode": self.cfg.mode, "shares": shares_of(plan), "stage_layers": stage_layers_of(plan),
                            "stragglers": [{"rank": s.rank, "ratio": round(s.ratio, 3)} for s in obs.stragglers],
                            "best_gain": round(obs.best_gain, 4), "streak": obs.streak}
        named = tuple(s.rank for s in obs.stragglers)
        if named != self._named:
            self._named = named
            kinds = {r["rank"]: r["kind"] for r in rec["ranks"]}
            self.say(f"step {step}: " + ("stragglers: " + ", ".join(
                f"rank {s.rank} ({kinds.get(s.rank, '?')}) at {s.ratio:.2f}x {self.policy.watch.basis}"
                for s in obs.stragglers) if named else "no stragglers any more"))
        return obs


def set_shares(trainer: Trainer, plan: Plan) -> None:
    """New micro-batch counts (``plan`` differs from the trainer's in those only): this rank's slice of
    the global batch, its schedule's ops for its new count, and the number of gradient accumulations
    after which each bucket's reduction starts (``GradBuffer.finals``: micro-batches x backward passes);
    nothing else changes."""
    old_m = trainer.place.num_micro_batches
    topo = build_topology(plan)
    place = topo.place(trainer.rank)
    buffer = trainer.grad_sync.buffer
    buffer.finals = [f // old_m * place.num_micro_batches for f in buffer.finals]
    trainer.plan, trainer.topo, trainer.place = plan, topo, place
    trainer.share = Share(offset=place.sample_offset, micro_batch_size=place.micro_batch_size,
                          num_micro_batches=place.num_micro_batches)
    ex = trainer.executor
    ex.place = place
    st = place.stage
    ex.ops = get_schedule(plan.schedule, chunks=ex.chunks).ops(stage=st.stage, num_stages=st.num_stages,
                                                              num_micro_batches=place.num_micro_batches)


def move_layer(trainer: Trainer, plan: Plan, move: LayerMove, *, old_plan: Plan) -> None:
    """Collective over every rank: rebuild ``trainer`` (in place: the run's other parts hold it) under
    ``plan``, in which one layer moved as ``move`` says, carrying every parameter and its AdamW state."""
    rank, comm, cfg, scaler = trainer.rank, trainer.comm, trainer.cfg, trainer.scaler
    steps_done = trainer.scheduler.last_epoch
    prefix = unit_param_prefix(f"layer.{move.layer(old_plan)}") + "."
    old_pipe = old_plan.pipelines[move.pipeline]
    rank_of = old_plan.rank_of_device()
    src = [rank_of[d] for d in old_pipe.stages[move.src].devices]
    dst = [rank_of[d] for d in old_pipe.stages[move.dst].devices]
    full = {name: {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in st.items()}
            for name, st in full_states(trainer)}
    stepped = any("exp_avg" in st for st in full.values())
    trainer.__dict__.clear()  # the old stage's device memory goes before the new one is built
    gc.collect()
    Trainer.__init__(trainer, plan, rank=rank, comm=comm, cfg=cfg)  # creates any new group, on every rank
    keys = ("param", "exp_avg", "exp_avg_sq", "step") if stepped else ("param",)
    if rank == src[0]:
        _send_layer(trainer, full, prefix=prefix, keys=keys, to=dst)
    elif rank in dst:
        full |= _recv_layer(trainer, prefix=prefix, keys=keys, frm=src[0])
    load_full_state(trainer, full)
    restore_schedule(trainer, steps_done)
    trainer.scaler = scaler


def _send_layer(trainer: Trainer, full: dict[str, dict[str, torch.Tensor]], *, prefix: str, keys: Sequence[str],
                to: Sequence[int]) -> None:
    works, keep = [], []
    names = sorted(n for n in full if n.startswith(prefix))
    for i, (name, key) in enumerate((n, k) for n in names for k in keys):
        t = full[name][key].reshape(-1 if key == "step" else full[name][key].shape).to(trainer.device)
        keep.append(t)
        works += [trainer.comm.isend(t, dst=r, tag=_MOVE_TAG + i) for r in to]
    for w in works:
        w.wait()


def _recv_layer(trainer: Trainer, *, prefix: str, keys: Sequence[str], frm: int) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    names = sorted(n for n, _ in trainer.model.named_parameters() if n.startswith(prefix))
    params = dict(trainer.model.named_parameters())
    posted = []
    for i, (name, key) in enumerate((n, k) for n in names for k in keys):
        shape = list(params[name].shape)
        dim = trainer.model.shard_dim(name)
        if dim is not None:
            shape[dim] *= trainer.place.stage.tp
        buf = torch.empty([1] if key == "step" else shape, dtype=torch.float32, device=trainer.device)
        posted.append((name, key, buf, trainer.comm.irecv(buf, src=frm, tag=_MOVE_TAG + i)))
    for name, key, buf, work in posted:
        work.wait()
        out.setdefault(name, {})[key] = buf.cpu().reshape(()) if key == "step" else buf.cpu()
    return out
