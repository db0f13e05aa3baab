"""A local emulation host as the predictor's hook (:class:`hethub.predict.host.HostModel`).

On such a host every device of the cluster is a process of hethub's runtime on one machine
(``host_cores`` in the cluster file). Three things differ from a real cluster, and this model adds
them to the plain prediction:

* all-reduces among p local ranks cost what ``hethub bench comm`` measured on the host (gloo on
  one machine is bound by CPU copies and reductions, not by the loopback "link"); without a
  measurement the plain ring model stands;
* the ranks share the host's cores: the step is replayed with processor sharing, an emulated
  kind's extra time being a sleep that needs no core (:mod:`hethub.emulation.contention`), work
  after an idle gap paying the measured wake penalty;
* core speeds wander (stragglers): with a measured spread the replay runs with drawn speeds and
  the median step is the prediction (:mod:`hethub.emulation.stragglers`);
* ranks computing at the same time each take more CPU time for the same work than the profile's
  lone process (the measured co-run factor by micro-batch size, :mod:`hethub.emulation.measure.corun`).

``host_cores = "auto"`` means the cores the predicting process may use; it is read here, when a
prediction is made, never when the cluster file is loaded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hethub.emulation.contention import StageWork, simulate_shared_cores
from hethub.emulation.effects import HostEffects
from hethub.emulation.stragglers import SpeedDraws, SpeedSpread, median_over_draws
from hethub.plan import Plan
from hethub.predict.host import HostStep, ReplayEvent, StageId, StageStep
from hethub.predict.profiles import KindProfile, ProfileSet
from hethub.predict.stage_cost import usable_profile
from hethub.predict.sync_records import SyncGroup
from hethub.spec.cluster import Cluster, Link


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class EmulationModel:
    """One local emulation host: its cores, its measured all-reduce by participant count, the host
    effects measured with the profiles (by kind) and busy processes of others sharing its cores."""

    cores: int
    allreduce: Mapping[int, Link] = field(default_factory=dict)
    effects: Mapping[str, HostEffects] = field(default_factory=dict)
    # Busy processes of others on the host, sharing its cores with the plan's ranks (a measured
    # input; 0 on a quiet machine).
    background_procs: float = 0.0

    def price_collectives(self, groups: Sequence[SyncGroup]) -> list[SyncGroup]:
        out = []
        for g in groups:
            measured = self.allreduce.get(g.participants)
            if measured is not None and g.participants > 1 and g.nbytes > 0:
                g = replace(g, time_s=measured.time_s(g.nbytes))
            out.append(g)
        return out

    def replay_step(self, plan: Plan, *, profiles: ProfileSet | None, stages: Mapping[StageId, StageStep],
                    groups: Sequence[SyncGroup], world: Sequence[SyncGroup], record: bool) -> HostStep:
        """Replay the step with its world barriers (loss and gradient-norm all-reduces) and, with more
        ranks than cores, cores shared among them; the median over speed draws where the profiles
        measured a speed spread. The recorded timeline is the replay's own (of the median draw)."""
        work = {sid: self._stage_work(plan, st, profiles, first=sid[1] == 0) for sid, st in stages.items()}

        def replay(speeds: SpeedDraws | None, rec: list[ReplayEvent] | None = None) -> tuple[float, list[float]]:
            return simulate_shared_cores(stages=work, schedule=plan.schedule, cores=self.cores, groups=groups,
                                         world=world, num_micro_batches=[p.num_micro_batches for p in plan.pipelines],
                                         background_procs=self.background_procs, speeds=speeds, record=rec)

        recorded: list[ReplayEvent] | None = [] if record else None
        step, pipes = replay(None, recorded)
        spread = self._speed_spread(plan, profiles, step_s=step) if plan.world_size > 1 else None
        if spread is not None and spread.sigma > 0:  # sigma 0: the plain replay above is the answer
            step, pipes, draw = median_over_draws(replay, spread=spread)
            if recorded is not None:
                recorded = []
                replay(draw, recorded)
        return HostStep(step_time_s=step, pipeline_times_s=tuple(pipes), events=tuple(recorded or ()))

    def _profile(self, plan: Plan, profiles: ProfileSet | None, kind: str) -> KindProfile | None:
        """The kind's profile where the predictor used it (measured at the plan's sequence length)."""
        return usable_profile(profiles, kind, seq_len=plan.seq_len)

    def _speed_spread(self, plan: Plan, profiles: ProfileSet | None, *, step_s: float) -> SpeedSpread | None:
        """The host's measured speed spread (one host: the first of the plan's kinds' profiles that has
        one) over the window nearest the step: ranks meet at least once a step, so speed differences
        that last about a step are what make them wait."""
        for kind in plan.cluster.kind_names:
            eff = self.effects.get(kind)
            if self._profile(plan, profiles, kind) is not None and eff is not None and eff.speed_spread:
                return min(eff.speed_spread, key=lambda sp: abs(math.log(sp.window_s / max(step_s, 1e-9))))
        return None

    def _stage_work(self, plan: Plan, st: StageStep, profiles: ProfileSet | None, *, first: bool = False) -> StageWork:
        """Split a stage's times into CPU work and emulation sleep (the part no core is needed for).

        The runtime sleeps (k-1) x a chunk's thread CPU time on a kind emulated k times slower. A
        profile measured real speed, of which the CPU share (``cpu_fraction``, below 1 where TP
        collectives wait) is stretched: the sleep is ``stretch / (1 + stretch)`` of the stretched
        compute time. The roofline of an emulated kind already includes its slowdown: the sleep
        is ``1 - 1/k`` of it.

        Under a split backward, B and W take the shares of the backward the host measured
        (``HostEffects.split_backward``), except on a pipeline's first stage, whose B the runtime runs
        as one whole backward (it sends no input gradient) and whose W is empty."""
        k = plan.cluster.kinds[st.kind].emulated_slowdown
        profile = self._profile(plan, profiles, st.kind)
        if st.compute_source == "profile" and profile is not None:
            entry = profile.lookup(mbs=st.micro_batch_size, tp=st.tp)
            stretch = (k - 1.0) * (entry.cpu_fraction if entry is not None else 1.0)
            idle = stretch / (1.0 + stretch)
        else:
            idle = 1.0 - 1.0 / k
        fwd_idle, bwd_idle = st.compute_fwd_s * idle, st.compute_bwd_s * idle
        eff = self.effects.get(st.kind)
        wake = eff.wake_extra_s if profile is not None and eff is not None and eff.wake_penalty else None
        split = {}
        if first and st.chunk_fwd_shares == (1.0,):
            split = {"split_b_share": 1.0, "split_w_share": 0.0}
        elif profile is not None and eff is not None and eff.split_backward:
            split = {"split_b_share": eff.split_backward[0], "split_w_share": eff.split_backward[1]}
        # Co-running ranks take more CPU time for the same work than the profile's lone process did
        # (HostEffects.corun), by micro-batch size; measured with the profiles, so used with them.
        corun = eff.corun_factor(st.micro_batch_size) if profile is not None and eff is not None else 1.0
        return StageWork(**split, corun=corun, fwd_cpu_s=st.fwd_s - fwd_idle, fwd_idle_s=fwd_idle,
                         bwd_cpu_s=st.bwd_s - bwd_idle, bwd_idle_s=bwd_idle, p2p_s=st.p2p_s,
                         update_cpu_s=st.update_s, ranks=st.tp, slowdown=k,
                         wake_extra_s=wake, chunk_fwd_shares=st.chunk_fwd_shares,
                         chunk_bwd_shares=st.chunk_bwd_shares, wrap_p2p_s=st.wrap_p2p_s)


def host_model(cluster: Cluster, *, effects: Mapping[str, HostEffects] | None = None,
               background_procs: float = 0.0) -> EmulationModel | None:
    """The hook for ``predict(plan, host=...)`` and ``make_plan(..., host=...)``: an EmulationModel
    when `cluster` is a local emulation host (``host_cores`` set), else None (a real cluster).

    `effects`: the host effects measured with the profiles, by kind
    (:func:`hethub.profile.format.load_host_effects`)."""
    spec = cluster.host
    if spec is None:
        return None
    cores = usable_cores() if spec.cores == "auto" else int(spec.cores)
    return EmulationModel(cores=cores, allreduce=dict(spec.allreduce), effects=dict(effects or {}),
                          background_procs=background_procs)
