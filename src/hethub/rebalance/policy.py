"""When to re-balance: each step's measurements in, at most one decision out.

Every step after the warm-up, the log rank feeds the gathered rank records to :meth:`Rebalancer.observe`:
the times are smoothed, stragglers named, and the step model (``step_model``) prices the best
re-split of the micro-batch counts and, in ``layers`` mode, every single layer move. A change is
returned only when the best one is predicted to cut the step by more than ``min_gain`` on
``patience`` consecutive steps (the newest step's best is applied: ties among equally fast
replicas may alternate); after one, nothing is decided for
``cooldown_steps`` steps (and a moved layer's ranks are measured afresh after ``warmup_steps``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hethub.plan import Plan
from hethub.rebalance.config import RebalanceConfig
from hethub.rebalance.decision import Decision, LayerMove, shares_of
from hethub.rebalance.measure import RankTimes, Smoothed, rank_times
from hethub.rebalance.step_model import PipeModel, StageSpeed, best_counts, count_cap
from hethub.rebalance.stragglers import Straggler, StragglerWatch

META_KEY = "rebalance"  # plan.meta[META_KEY]: {"stage_fb_s": [[s per stage] per pipeline], "max_layers": same}


@dataclass(frozen=True)
class Observation:
    stragglers: tuple[Straggler, ...] = ()
    decision: Decision | None = None
    best_gain: float = 0.0  # the best change's predicted gain this step (0: none priced)
    streak: int = 0  # consecutive steps it paid more than min_gain


@dataclass
class _State:
    measure_from: int
    decide_from: int
    streak: int = 0
    # The step after the slowest pipeline's last op (gradient sync, optimizer), the newest ``window``.
    tail_s: deque[float] = field(default_factory=deque)
    extra_s: dict[int, deque[float]] = field(default_factory=dict)  # per pipeline (step_model.PipeModel.extra_s)


class Rebalancer:
    def __init__(self, cfg: RebalanceConfig, plan: Plan) -> None:
        self.cfg, self.plan = cfg, plan
        meta = plan.meta.get(META_KEY) or {}
        self.max_layers: list[list[int]] | None = meta.get("max_layers")
        fb = meta.get("stage_fb_s")
        rank_of = plan.rank_of_device()
        predicted = ({rank_of[d]: float(fb[pi][si]) for pi, p in enumerate(plan.pipelines)
                      for si, s in enumerate(p.stages) for d in s.devices} if fb else None)
        self.watch = StragglerWatch(factor=cfg.straggler_factor, predicted_s=predicted)
        self.smooth = Smoothed(window=cfg.window)
        self.state = _State(measure_from=cfg.warmup_steps, decide_from=cfg.warmup_steps)
        self.caps = [count_cap(plan.schedule, chunks=p.virtual_stages, num_stages=len(p.stages),
                               planned=p.num_micro_batches, total=plan.global_batch // p.micro_batch_size)
                     for p in plan.pipelines]
        m = plan.model
        self.head_layers = m.head_fwd_flops(tokens=plan.seq_len) / m.layer_fwd_flops(tokens=plan.seq_len,
                                                                                      seq_len=plan.seq_len)

    @property
    def moves_layers(self) -> bool:
        """Layer moves need the plan's memory limits per stage (``meta.rebalance.max_layers``)."""
        return self.cfg.moves_layers and self.max_layers is not None

    # ---- measurements ---------------------------------------------------------------------------------
    def observe(self, step: int, ranks: Sequence[Mapping[str, Any]], *, step_time_s: float) -> Observation:
        st = self.state
        if step < st.measure_from:
            return Observation()
        times = rank_times(ranks, emulated_host=self.plan.cluster.host is not None)
        if len(times) < self.plan.world_size:
            return Observation()
        self.smooth.add(times)
        # In the times' own units (an emulated device's: measure.rank_times), like the pipelines'.
        scale = statistics.median(t.scale for t in times)
        _push(st.tail_s, max(0.0, step_time_s - max(t.span_s / t.scale for t in times)) * scale, self.cfg.window)
        raw = {t.rank: t for t in times}
        for pi in range(len(self.plan.pipelines)):
            _push(st.extra_s.setdefault(pi, deque()), self._pipe(pi, raw).extra_s, self.cfg.window)
        stragglers = tuple(self.watch.check({r: t.fb_s for r, t in self.smooth.by_rank.items()}))
        if not self.cfg.changes or step < st.decide_from:
            return Observation(stragglers=stragglers)
        best = self._best(stragglers)
        gain = best.gain if best is not None else 0.0
        st.streak = st.streak + 1 if best is not None and gain > self.cfg.min_gain else 0
        if st.streak < self.cfg.patience:
            return Observation(stragglers=stragglers, best_gain=gain, streak=st.streak)
        return Observation(stragglers=stragglers, decision=best, best_gain=gain, streak=st.streak)

    def applied(self, step: int, decision: Decision, plan: Plan) -> None:
        """``decision`` took effect after step ``step``; ``plan`` is the plan from the next step on."""
        st, old = self.state, self.plan
        self.plan = plan
        st.streak = 0
        st.decide_from = step + 1 + self.cfg.cooldown_steps
        mv = decision.move
        if mv is None:
            return
        # The two stages' work changed: their ranks are measured afresh, their references scaled.
        for si in (mv.src, mv.dst):
            before, after = old.pipelines[mv.pipeline].stages[si], plan.pipelines[mv.pipeline].stages[si]
            ratio = self._work(after.num_layers, after.head) / self._work(before.num_layers, before.head)
            ranks = [plan.rank_of_device()[d] for d in after.devices]
            self.smooth.forget(ranks)
            for r in ranks:
                self.watch.rescale(r, ratio)
        st.extra_s.pop(mv.pipeline, None)
        st.measure_from = step + 1 + self.cfg.warmup_steps
        st.decide_from = max(st.decide_from, st.measure_from + self.cfg.patience)

    # ---- the step model ---------------------------------------------------------------------------------
    def _work(self, layers: int, head: bool) -> float:
        return layers + (self.head_layers if head else 0.0)

    def _pipe(self, pi: int, times: Mapping[int, RankTimes]) -> PipeModel:
        """Pipeline ``pi`` from ``times`` (each stage at its slowest TP rank), fitted to its measured span."""
        p = self.plan.pipelines[pi]
        rank_of = self.plan.rank_of_device()
        stages, span = [], 0.0
        for s in p.stages:
            ts = [times[rank_of[d]] for d in s.devices]
            stages.append(StageSpeed(fwd_s=max(t.fwd_s for t in ts), bwd_s=max(t.bwd_s for t in ts),
                                     layers=s.num_layers, head=s.head))
            span = max([span, *(t.span_s for t in ts)])
        model = PipeModel(schedule=self.plan.schedule, chunks=p.virtual_stages, micro_batch_size=p.micro_batch_size,
                          stages=tuple(stages))
        return model.fitted(span_s=span, m=p.num_micro_batches)

    def _best(self, stragglers: Sequence[Straggler]) -> Decision | None:
        plan, st = self.plan, self.state
        if len(self.smooth.by_rank) < plan.world_size or not st.tail_s:
            return None
        pipes = [replace(self._pipe(pi, self.smooth.by_rank),
                         extra_s=statistics.median(st.extra_s[pi]) if st.extra_s.get(pi) else 0.0)
                 for pi in range(len(plan.pipelines))]
        counts = shares_of(plan)
        now_s = max(p.time_s(m) for p, m in zip(pipes, counts, strict=True))
        tail_s = statistics.median(st.tail_s)  # gradient sync, optimizer: the same under any split
        why = self._reason(stragglers, pipes, counts)
        best: Decision | None = None
        found = best_counts(pipes, total_samples=plan.global_batch, caps=self.caps, prefer=counts)
        if found is not None and list(found[0]) != counts:
            best = Decision(counts=found[0], reason=why, step_s=tail_s + now_s, new_step_s=tail_s + found[1])
        for mv in self._moves() if self.moves_layers else ():
            moved = list(pipes)
            moved[mv.pipeline] = pipes[mv.pipeline].with_move(src=mv.src, dst=mv.dst, head_layers=self.head_layers)
            new_s = tail_s + max(p.time_s(m) for p, m in zip(moved, counts, strict=True))
            if new_s < (best.new_step_s if best is not None else tail_s + now_s):
                best = Decision(counts=tuple(counts), move=mv, reason=why, step_s=tail_s + now_s, new_step_s=new_s)
        return best

    def _moves(self) -> list[LayerMove]:
        """Every single-layer move between adjacent stages that leaves the sender a layer and keeps the
        receiver within its memory limit (pipelines with one model chunk per stage)."""
        assert self.max_layers is not None
        out = []
        for pi, p in enumerate(self.plan.pipelines):
            if p.virtual_stages > 1:
                continue
            for src, s in enumerate(p.stages):
                for dst in (src - 1, src + 1):
                    if 0 <= dst < len(p.stages) and s.num_layers > 1 \
                            and p.stages[dst].num_layers + 1 <= self.max_layers[pi][dst]:
                        out.append(LayerMove(pipeline=pi, src=src, dst=dst))
        return out

    def _reason(self, stragglers: Sequence[Straggler], pipes: Sequence[PipeModel], counts: Sequence[int]) -> str:
        times = ", ".join(f"{p.time_s(m):.3g}" for p, m in zip(pipes, counts, strict=True))
        slow = "; ".join(f"rank {s.rank} at {s.ratio:.2f}x {self.watch.basis}" for s in stragglers[:3])
        return (f"{slow}; " if slow else "") + f"pipelines finish at {times} s under shares {list(counts)}"


def _push(values: deque[float], value: float, window: int) -> None:
    values.append(value)
    while len(values) > window:
        values.popleft()
