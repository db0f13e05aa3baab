"""Stragglers: the shared-core replay with drawn core speeds (hethub.emulation.stragglers)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import pytest

from hethub.emulation.contention import StageWork, simulate_shared_cores
from hethub.emulation.effects import HostEffects
from hethub.emulation.host import host_model
from hethub.emulation.stragglers import SpeedDraws, SpeedSpread, median_over_draws
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.spec.cluster import EmulationHost, load_cluster
from hethub.spec.model import PRESETS

WORK = StageWork(fwd_cpu_s=1.0, fwd_idle_s=0.0, bwd_cpu_s=2.0, bwd_idle_s=0.0, p2p_s=0.0, update_cpu_s=0.0, ranks=1)


class FixedSpeeds(SpeedDraws):
    """Each key's speed fixed for the whole step."""

    def __init__(self, by_key: dict[Hashable, float]) -> None:
        super().__init__(SpeedSpread(sigma=0.0, window_s=1.0), draw=0)
        self.by_key = by_key

    def speed(self, key: Hashable, k: int) -> float:
        return self.by_key.get(key, 1.0)


def run(stages: dict, *, cores: int, speeds: SpeedDraws | None, m: int = 1) -> float:
    return simulate_shared_cores(stages=stages, num_micro_batches=[m] * (1 + max(p for p, _ in stages)),
                                 schedule="1f1b", cores=cores, groups=[], speeds=speeds)[0]


def test_draws_are_reproducible_and_independent_of_the_order_asked():
    spread = SpeedSpread(sigma=0.1, window_s=0.1)
    a, b = SpeedDraws(spread, draw=3), SpeedDraws(spread, draw=3)
    first = [a.speed(("core", 0), k) for k in range(5)]
    assert [b.speed(("core", 0), k) for k in reversed(range(5))][::-1] == first
    assert SpeedDraws(spread, draw=4).speed(("core", 0), 0) != first[0]
    assert len(set(first)) == 5 and all(0.5 < f < 2.0 for f in first)
    assert a.window(0.25) == 2 and a.window_end(2) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="sigma"):
        SpeedSpread(sigma=-0.1, window_s=0.1)


def test_replicas_wait_for_the_slowest_while_shared_cores_average():
    dp = {(0, 0): WORK, (1, 0): WORK}
    assert run(dp, cores=2, speeds=None) == pytest.approx(3.0)
    # A rank per core: the world barriers make both replicas wait for the one at half speed.
    assert run(dp, cores=2, speeds=FixedSpeeds({((1, 0), 0): 0.5})) == pytest.approx(6.0)
    # More busy ranks than cores: the OS spreads them over both cores, each gets the cores' mean.
    assert run(dp, cores=1, speeds=FixedSpeeds({("core", 0): 0.5})) == pytest.approx(12.0)
    # A TP stage is as fast as its slowest rank.
    tp = {(0, 0): replace(WORK, ranks=2)}
    assert run(tp, cores=2, speeds=FixedSpeeds({((0, 0), 1): 0.5})) == pytest.approx(6.0)


def test_median_over_draws_slows_replicas_more_than_a_pipeline():
    spread = SpeedSpread(sigma=0.15, window_s=100.0)  # a window longer than the step: one speed each
    dp = {(0, 0): WORK, (1, 0): WORK}
    pipe = {(0, 0): WORK, (0, 1): WORK}

    def median(stages: dict) -> float:
        return median_over_draws(lambda sp: simulate_shared_cores(
            stages=stages, num_micro_batches=[4] * (1 + max(p for p, _ in stages)), schedule="1f1b", cores=2,
            groups=[], speeds=sp), spread=spread)[0]

    def plain(stages: dict) -> float:
        return run(stages, cores=2, speeds=None, m=4)

    dp_slower, pipe_slower = median(dp) / plain(dp) - 1, median(pipe) / plain(pipe) - 1
    assert 0.03 < dp_slower < 0.2  # about 0.56 sigma: the expected maximum of two
    assert abs(pipe_slower) < dp_slower / 2
    assert median_over_draws(lambda sp: (1.0 if sp is None else 2.0, []), spread=None)[0] == 1.0
    # Windows much shorter than the step: the slow spells average out within each replica.
    short = SpeedSpread(sigma=0.15, window_s=0.1)
    averaged = median_over_draws(lambda sp: simulate_shared_cores(
        stages=dp, num_micro_batches=[4, 4], schedule="1f1b", cores=2, groups=[], speeds=sp), spread=short)[0]
    assert averaged / plain(dp) - 1 < dp_slower / 2


def test_predict_applies_a_profiled_spread_only_on_emulation_hosts_with_several_ranks():
    cluster = load_cluster("examples/clusters/local-cpu.toml")
    model = PRESETS["tiny"]
    entry = ProfileEntry(embedding=LayerTimes(0.001, 0.002, 0.0), layer=LayerTimes(0.01, 0.02, 0.001),
                         head=LayerTimes(0.002, 0.004, 0.0))
    base = KindProfile(kind="cpu-fast", model="tiny", seq_len=64, entries={(2, 1): entry})
    prof = ProfileSet({"cpu-fast": base})
    # Ranks meet once a step: the spread over the window nearest the step (~0.2 s here) applies.
    curve = (SpeedSpread(sigma=0.0, window_s=0.01), SpeedSpread(sigma=0.15, window_s=0.2), SpeedSpread(0.0, 10.0))
    host = replace(cluster, host=EmulationHost(cores=2))
    spread, plain = host_model(host, effects={"cpu-fast": HostEffects(speed_spread=curve)}), host_model(host)
    n = model.num_layers

    def plan(pipes: list[Pipeline]) -> Plan:
        return Plan(model=model, cluster=host, pipelines=tuple(pipes),
                    seq_len=64, global_batch=sum(p.micro_batch_size * p.num_micro_batches for p in pipes),
                    schedule="1f1b")

    one = plan([Pipeline(2, 2, (Stage("cpu-fast", (0,), (0, n), embedding=True, head=True),))])
    dp = plan([Pipeline(2, 2, (Stage("cpu-fast", (d,), (0, n), embedding=True, head=True),)) for d in (0, 1)])
    def step(pl: Plan, host: object) -> float:
        return predict(pl, profiles=prof, host=host).step_time_s

    assert step(one, spread) == step(one, plain)
    assert step(dp, spread) > 1.03 * step(dp, plain)
    # The timeline is the median draw's: it ends at that draw's step, at most the median of the draws.
    drawn = predict(dp, profiles=prof, timeline=True, host=spread)
    assert drawn.step_time_s * 0.97 < max(e.end_s for e in drawn.timeline) <= drawn.step_time_s + 1e-12
    # A real cluster has no emulation hook, so no spread.
    assert host_model(replace(cluster, host=None), effects={"cpu-fast": HostEffects(speed_spread=curve)}) is None
