"""The predictor's shortcuts (hethub/memo.py) give exactly the plain rules' numbers: the whole
`predict()` result (step time, every stage's memory parts, with and without the timeline, whose
simulations differ: records or finish only) and `stage_memory_fits` under every recomputation mode,
on plans covering each schedule (interleaved, ZB-H1, GPipe, 1F1B), ZeRO 0-3, sequence and context
parallelism (replicas whose hops price alike), recomputation modes, unequal TP, blocking and
DeepSpeed's lock-step sends (interleaved too), several replicas and a local emulation host; the slow
tier adds every example cluster's planned plan."""

from __future__ import annotations

import dataclasses
import glob

import pytest

from conftest import EXAMPLES, small_cluster, tiny_model
from hethub.emulation.host import host_model
from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.plan_parts import interleave
from hethub.predict.host import HostModel
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import may_fit_below, predict, step_floor_s
from hethub.predict.stage_fits import StageFits
from hethub.spec.cluster import EmulationHost

NONE, SELECTIVE, FULL = Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL


def _plan(pipes: list[Pipeline], *, schedule: str = "1f1b", sharding: str = "none", p2p: str | None = None,
          gb: int | None = None) -> Plan:
    extra = {} if p2p is None else {"p2p": p2p}
    return Plan(model=tiny_model(), cluster=small_cluster(), global_batch=gb or sum(p.num_samples for p in pipes),
                seq_len=32, pipelines=tuple(pipes), schedule=schedule, optimizer_sharding=sharding,
                **extra).validate()


def _two_replicas(*, recompute: Recompute = NONE, mbs: int = 2, m: int = 4) -> list[Pipeline]:
    return [Pipeline(mbs, m, (Stage("fast", (0,), (0, 3), embedding=True, recompute=recompute),
                              Stage("slow", (4,), (3, 6), head=True, recompute=recompute))),
            Pipeline(mbs - 1, m, (Stage("fast", (1,), (0, 4), embedding=True),
                                  Stage("slow", (5,), (4, 6), head=True, recompute=recompute)))]


def _plans() -> dict[str, Plan]:
    three = (Stage("fast", (0,), (0, 2), embedding=True), Stage("fast", (2,), (2, 4)),
             Stage("slow", (4,), (4, 6), head=True))
    out = {f"{s}-three-stages": _plan([Pipeline(2, 8, three)], schedule=s) for s in ("1f1b", "zb-h1", "gpipe")}
    out["blocking"] = _plan([Pipeline(2, 8, three)], p2p="blocking")
    out["interleaved-v2"] = _plan([interleave(Pipeline(1, 8, (Stage("fast", (0,), (0, 1), embedding=True),
                                                              Stage("slow", (4,), (1, 2), head=True))),
                                              [[2, 1], [1, 2]])], schedule="interleaved")
    out["interleaved-v3-replicas"] = _plan(
        [interleave(Pipeline(1, 9 + 4 * i, (Stage("fast", (i,), (0, 1), embedding=True),
                                            Stage("slow", (4 + i,), (1, 2), head=True))), [[1, 1, 1]] * 2)
         for i in range(2)], schedule="interleaved", sharding="zero1")
    out["interleaved-three-stages"] = _plan(
        [interleave(Pipeline(1, 14, three), [[1, 1]] * 3)], schedule="interleaved", sharding="zero2")
    for z in ("none", "zero1", "zero2", "zero3"):
        out[f"{z}-replicas"] = _plan(_two_replicas(), sharding=z)
    out["selective"] = _plan(_two_replicas(recompute=SELECTIVE), sharding="zero1")
    out["full"] = _plan(_two_replicas(recompute=FULL), schedule="zb-h1")
    out["unequal-tp-sp"] = _plan([Pipeline(2, 6, (Stage("fast", (0, 1), (0, 4), embedding=True, sequence_parallel=True),
                                                  Stage("slow", (4,), (4, 6), head=True)))], sharding="zero2")
    out["cp"] = _plan([Pipeline(1, 6, (Stage("fast", (0, 1), (0, 3), embedding=True, cp=2),
                                       Stage("slow", (4, 5), (3, 6), head=True, cp=2)))])
    out["interleaved-blocking"] = _plan(
        [interleave(Pipeline(1, 8, three), [[1, 1]] * 3)], schedule="interleaved", p2p="blocking")
    out["lockstep-deepspeed"] = dataclasses.replace(_plan(_two_replicas(), p2p="lockstep"),
                                                    runtime="deepspeed").validate()
    sp = [Pipeline(1, 4, (Stage("fast", (2 * i, 2 * i + 1), (0, 3), embedding=True, sequence_parallel=True),
                          Stage("slow", (4 + 2 * i, 5 + 2 * i), (3, 6), head=True, sequence_parallel=True)))
          for i in range(2)]
    out["sp-replicas"] = _plan(sp, sharding="zero1")
    out["cp-replicas-interleaved"] = _plan(
        [interleave(Pipeline(1, 6, (Stage("fast", (2 * i, 2 * i + 1), (0, 3), embedding=True, cp=2),
                                    Stage("slow", (4 + 2 * i, 5 + 2 * i), (3, 6), head=True, cp=2))), [[2, 1], [1, 2]])
         for i in range(2)], schedule="interleaved")
    out["tp-replicas-zero3"] = _plan(
        [Pipeline(1, 4, (Stage("fast", (0, 1), (0, 3), embedding=True), Stage("slow", (4,), (3, 6), head=True))),
         Pipeline(1, 4, (Stage("fast", (2,), (0, 2), embedding=True), Stage("slow", (6, 7), (2, 6), head=True)))],
        sharding="zero3")
    return out


PLANS = _plans()


def _same(plan: Plan, *, host: HostModel | None = None) -> None:
    with reference_path():
        refs = [predict(plan, timeline=t, host=host) for t in (True, False)]
        fits_ref = StageFits(plan)
        ref_fits = {mode: fits_ref.under(mode) for mode in (None, *Recompute)}
    clear_caches()
    for ref, timeline in zip(refs, (True, False), strict=True):
        fast = predict(plan, timeline=timeline, host=host)
        again = predict(plan, timeline=timeline, host=host)  # served from the memos the first call filled
        for got in (fast, again):
            for f in dataclasses.fields(ref):
                assert getattr(got, f.name) == getattr(ref, f.name), f.name
    fits = StageFits(plan)
    assert {mode: fits.under(mode) for mode in (None, *Recompute)} == ref_fits


@pytest.mark.parametrize("name", sorted(PLANS))
def test_shortcuts_give_the_plain_rules_prediction(name: str) -> None:
    _same(PLANS[name])


@pytest.mark.parametrize("name", sorted(PLANS))
def test_memory_screen_answers_as_the_prediction(name: str) -> None:
    # may_fit_below's memory half is StageFits: each stage fits exactly where predict() says it does, at the
    # default headroom (all fit) and at one that leaves the stage of the largest peak share just out (the
    # optimizer split moves with the headroom: a sharded plan's peaks then differ).
    plan = PLANS[name]
    top = max(s.peak_mem_bytes / s.device_mem_bytes for s in predict(plan).stages)
    for headroom in (0.1, 1 - top * (1 - 1e-6)):
        pred = predict(plan, mem_headroom=headroom)
        fits = {(s.pipeline, s.stage): s.fits for s in pred.stages}
        assert StageFits(plan, mem_headroom=headroom).under() == fits
        assert may_fit_below(plan, mem_headroom=headroom) == pred.fits_memory
        assert pred.fits_memory == (headroom == 0.1) or plan.sharded_optimizer
        costs = PlanCosts(plan, None)
        assert not may_fit_below(plan, mem_headroom=headroom, bar_s=step_floor_s(plan), costs=costs)
        assert may_fit_below(plan, mem_headroom=headroom, bar_s=pred.step_time_s * 2, costs=costs) == pred.fits_memory


@pytest.mark.parametrize("name", ["interleaved-three-stages", "zero1-replicas", "zb-h1-three-stages"])
def test_shortcuts_give_the_plain_rules_prediction_on_an_emulation_host(name: str) -> None:
    plan = PLANS[name]
    host = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, host=EmulationHost(cores=2)))
    _same(host, host=host_model(host.cluster))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(glob.glob(str(EXAMPLES / "*.toml"))))
def test_every_example_clusters_plan_predicts_alike(path: str) -> None:
    # The planner's plan (its default search: 1F1B, unsharded; `auto` runs six searches, minutes on the
    # larger clusters) and the same stages under ZB-H1 with ZeRO-1 and under GPipe with ZeRO-2.
    from hethub.search import PlannerConfig, make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    cluster = load_cluster(path)
    small = cluster.num_devices <= 8
    plan = make_plan(cluster=cluster, model=get_model("small" if small else "llama-3-8b"),
                     config=PlannerConfig(global_batch=16 if small else 256, seq_len=128 if small else 2048)).plan
    _same(plan)
    _same(dataclasses.replace(plan, schedule="zb-h1", optimizer_sharding="zero1").validate())
    if len({p.num_micro_batches for p in plan.pipelines}) == 1:  # ZeRO-2 needs one micro-batch count
        _same(dataclasses.replace(plan, schedule="gpipe", optimizer_sharding="zero2").validate())
