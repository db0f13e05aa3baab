"""The pure re-balancing parts: the step model, the integer batch split (against exhaustive search),
count caps from the schedules' in-flight rule, decisions on plans, and the policy on synthetic steps."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from hethub.plan import Pipeline, Plan, Stage
from hethub.rebalance import Decision, LayerMove, RebalanceConfig, Rebalancer, rebalanced_of
from hethub.rebalance.step_model import PipeModel, StageSpeed, best_counts, count_cap
from hethub.rebalance.stragglers import StragglerWatch
from hethub.schedules import get_schedule
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

SPEC = ModelSpec(name="t6", num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=256, max_seq_len=32)
KIND = DeviceKind(name="cpu-fast", vendor="cpu", mem_bytes=2**33, peak_flops=1e11, intra_node_bw_bytes_per_s=1e10,
                  intra_node_latency_s=1e-6, backend="gloo")
CLUSTER = Cluster(name="t", kinds={"cpu-fast": KIND}, groups=(NodeGroup("cpu-fast", 1, 8),),
                  inter_node=Link(1e9, 5e-5), cross_kind=Link(1e9, 5e-5))


def _plan(pipes: list[tuple[int, int, list[int]]], *, schedule: str = "1f1b") -> Plan:
    """(micro_batch_size, num_micro_batches, layers per stage) per pipeline; devices in order."""
    dev, out = 0, []
    for mbs, m, layers in pipes:
        start, stages = 0, []
        for i, n in enumerate(layers):
            stages.append(Stage(kind="cpu-fast", devices=(dev,), layers=(start, start + n), embedding=i == 0,
                                head=i == len(layers) - 1))
            dev, start = dev + 1, start + n
        out.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(stages)))
    return Plan(model=SPEC, cluster=CLUSTER, global_batch=sum(p.num_samples for p in out), seq_len=16,
                pipelines=tuple(out), schedule=schedule, precision="fp32").validate()


def _pipe(fb: list[float], *, mbs: int = 1, schedule: str = "1f1b", extra: float = 0.0) -> PipeModel:
    return PipeModel(schedule=schedule, chunks=1, micro_batch_size=mbs, extra_s=extra,
                     stages=tuple(StageSpeed(fwd_s=t / 3, bwd_s=2 * t / 3, layers=2) for t in fb))


def _brute(pipes: list[PipeModel], total: int, caps: list[int]) -> float | None:
    best = None
    for counts in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(k * p.micro_batch_size for k, p in zip(counts, pipes, strict=True)) == total:
            t = max(p.time_s(k) for p, k in zip(pipes, counts, strict=True))
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_best_counts_equals_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    pipes = [_pipe([rng.uniform(0.5, 3.0) for _ in range(rng.randint(1, 3))], mbs=rng.choice([1, 2, 3]),
                   extra=rng.uniform(0.0, 1.0)) for _ in range(n)]
    total = rng.randint(n * 3, 24)
    caps = [max(1, total // p.micro_batch_size - rng.randint(0, 2)) for p in pipes]
    want = _brute(pipes, total, caps)
    got = best_counts(pipes, total_samples=total, caps=caps, prefer=[1] * n)
    if want is None:
        assert got is None
        return
    assert got is not None
    counts, t = got
    assert sum(k * p.micro_batch_size for k, p in zip(counts, pipes, strict=True)) == total
    assert all(1 <= k <= c for k, c in zip(counts, caps, strict=True))
    assert t == pytest.approx(want, rel=1e-12)
    assert max(p.time_s(k) for p, k in zip(pipes, counts, strict=True)) == pytest.approx(t)


def test_one_replica_twice_as_slow_gets_half_the_micro_batches() -> None:
    pipes = [_pipe([1.0]), _pipe([1.0]), _pipe([1.0]), _pipe([2.0])]
    counts, t = best_counts(pipes, total_samples=16, caps=[16] * 4, prefer=[4] * 4)
    assert sorted(counts[:3]) == [4, 5, 5] and counts[3] == 2
    assert t == pytest.approx(5.0)


def test_a_balanced_split_is_kept() -> None:
    pipes = [_pipe([1.0])] * 4
    assert best_counts(pipes, total_samples=16, caps=[16] * 4, prefer=[4] * 4)[0] == (4, 4, 4, 4)


def test_fitted_model_reproduces_the_measured_span_and_follows_the_closed_form() -> None:
    p = _pipe([1.0, 1.5, 0.9]).fitted(span_s=9.0, m=4)
    assert p.time_s(4) == pytest.approx(9.0)
    sched = get_schedule("1f1b")
    per = sched.per_micro_batch_s(fwd_s=[s.fwd_s for s in p.stages], bwd_s=[s.bwd_s for s in p.stages])
    assert p.time_s(7) - p.time_s(4) == pytest.approx(3 * per)


def test_a_moved_layer_costs_its_share_at_each_stage() -> None:
    p = PipeModel(schedule="1f1b", chunks=1, micro_batch_size=1,
                  stages=(StageSpeed(fwd_s=1.0, bwd_s=2.0, layers=4), StageSpeed(fwd_s=3.0, bwd_s=6.0, layers=2,
                                                                                head=True)))
    q = p.with_move(src=1, dst=0, head_layers=1.0)
    assert (q.stages[0].fwd_s, q.stages[0].layers) == (pytest.approx(1.25), 5)
    assert (q.stages[1].fwd_s, q.stages[1].layers) == (pytest.approx(2.0), 1)  # 3 units (2 layers + head), one left


def test_count_cap_follows_the_schedules_in_flight_rule() -> None:
    assert count_cap("gpipe", chunks=1, num_stages=2, planned=3, total=16) == 3
    assert count_cap("1f1b", chunks=1, num_stages=4, planned=4, total=16) == 16
    assert count_cap("1f1b", chunks=1, num_stages=4, planned=2, total=16) == 2  # stage 0 would hold more
    assert count_cap("1f1b", chunks=1, num_stages=1, planned=1, total=16) == 16


def test_decision_applies_encodes_and_is_recognised_as_a_rebalance() -> None:
    plan = _plan([(1, 4, [3, 3]), (1, 4, [6])])
    d = Decision(counts=(5, 3), move=LayerMove(pipeline=0, src=1, dst=0))
    new = d.apply(plan)
    assert [p.num_micro_batches for p in new.pipelines] == [5, 3]
    assert [s.layers for s in new.pipelines[0].stages] == [(0, 4), (4, 6)]
    assert d.move.layer(plan) == 3
    assert Decision.decode(d.encode()) == Decision(counts=(5, 3), move=LayerMove(0, 1, 0))
    assert Decision.decode([0] * Decision.encoded_len(2)) is None
    back = Decision(counts=(5, 3), move=LayerMove(pipeline=0, src=0, dst=1)).apply(new)
    assert [s.layers for s in back.pipelines[0].stages] == [(0, 3), (3, 6)]
    assert rebalanced_of(new, plan) and rebalanced_of(plan, new)
    assert not rebalanced_of(replace(plan, schedule="gpipe"), plan)
    assert not rebalanced_of(_plan([(1, 4, [3, 3]), (1, 4, [3, 3])]), plan)


def _records(fb_by_rank: dict[int, float], plan: Plan, *, rng: random.Random, noise: float = 0.0) -> list[dict]:
    """Synthetic rank records: each rank's time per micro-batch (1/3 forward), spans from the closed form."""
    rank_of = plan.rank_of_device()
    out = []
    for pi, p in enumerate(plan.pipelines):
        pipe = PipeModel(schedule=plan.schedule, chunks=1, micro_batch_size=p.micro_batch_size,
                         stages=tuple(StageSpeed(fwd_s=fb_by_rank[rank_of[s.devices[0]]] / 3,
                                                 bwd_s=2 * fb_by_rank[rank_of[s.devices[0]]] / 3, layers=s.num_layers)
                                      for s in p.stages))
        span = pipe.time_s(p.num_micro_batches)
        for si, s in enumerate(p.stages):
            r = rank_of[s.devices[0]]
            t = fb_by_rank[r] * (1 + rng.uniform(-noise, noise))
            out.append({"rank": r, "pipeline": pi, "stage": si, "mb_fwd_s": t / 3, "mb_bwd_s": 2 * t / 3,
                        "span_s": span})
    return out


def _run(plan: Plan, cfg: RebalanceConfig, speed_at, steps: int, *, noise: float = 0.0):
    """Drive a Rebalancer for ``steps`` steps, applying its decisions; returns (plan, [(step, decision)], last obs)."""
    reb, rng, changes, obs = Rebalancer(cfg, plan), random.Random(0), [], None
    for step in range(steps):
        fb = speed_at(step)
        recs = _records(fb, plan, rng=rng, noise=noise)
        step_s = max(r["span_s"] for r in recs) + 0.1
        obs = reb.observe(step, recs, step_time_s=step_s)
        if obs.decision is not None:
            plan = obs.decision.apply(plan)
            reb.applied(step, obs.decision, plan)
            changes.append((step, obs.decision))
    return plan, changes, obs


def test_policy_re_splits_shares_within_five_steps_of_a_slowdown_and_names_the_straggler() -> None:
    plan = _plan([(1, 4, [6])] * 4)
    plan, changes, obs = _run(plan, RebalanceConfig(), lambda s: {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0 if s >= 10 else 1.0},
                              30)
    assert len(changes) == 1, changes
    step, d = changes[0]
    assert 10 <= step <= 14
    assert d.counts[3] == 2 and sorted(d.counts[:3]) == [4, 5, 5]
    assert 0.1 < d.gain < 0.4 and "rank 3" in d.reason
    assert [s.rank for s in obs.stragglers] == [3]


def test_policy_leaves_a_noisy_balanced_run_alone() -> None:
    plan = _plan([(1, 4, [3, 3])] * 2)
    _, changes, obs = _run(plan, RebalanceConfig(), lambda s: {r: 1.0 for r in range(4)}, 60, noise=0.03)
    assert changes == [] and obs.stragglers == ()


def test_policy_ignores_single_slow_steps() -> None:
    """A rank descheduled for one step (5x) now and then moves nothing: the window's median ignores it."""
    plan = _plan([(1, 4, [6])] * 4)
    spikes = {7: 1, 12: 2, 13: 3, 20: 2}
    speeds = lambda s: {r: 5.0 if spikes.get(s) == r else 1.0 for r in range(4)}  # noqa: E731
    _, changes, _ = _run(plan, RebalanceConfig(), speeds, 30)
    assert changes == []


def test_policy_moves_a_layer_when_that_pays_more_than_shares() -> None:
    """One pipeline: shares cannot help, a layer off the slowed stage can (within its memory limit)."""
    plan = _plan([(1, 8, [3, 3])])
    slow = lambda s: {0: 1.0, 1: 2.0 if s >= 5 else 1.0}  # noqa: E731
    with_limits = plan.with_meta(rebalance={"max_layers": [[5, 5]], "stage_fb_s": [[0.1, 0.1]]})
    moved, changes, _ = _run(with_limits, RebalanceConfig(mode="layers"), slow, 40)
    assert changes and all(d.move == LayerMove(pipeline=0, src=1, dst=0) for _, d in changes)
    assert [s.num_layers for s in moved.pipelines[0].stages] in ([4, 2], [5, 1])
    assert _run(plan, RebalanceConfig(mode="layers"), slow, 40)[1] == []  # no memory limits: no move
    assert _run(with_limits, RebalanceConfig(mode="shares"), slow, 40)[1] == []


def test_straggler_watch_fits_one_scale_and_follows_moves() -> None:
    w = StragglerWatch(factor=1.5, predicted_s={0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0})
    assert w.check({0: 3.0, 1: 3.0, 2: 6.0, 3: 3.0}) == []  # uniformly 3x the prediction: nobody stands out
    assert w.check({0: 9.0, 1: 9.0, 2: 18.0, 3: 9.0}) == []  # and later load on every rank neither
    assert [(s.rank, s.ratio) for s in w.check({0: 3.0, 1: 6.0, 2: 6.0, 3: 3.0})] == [(1, 2.0)]
    w.rescale(1, 2.0)
    assert w.check({0: 3.0, 1: 6.0, 2: 6.0, 3: 3.0}) == []


def test_emulate_slowdown_flag_parses_applies_and_reaches_the_ranks() -> None:
    import argparse

    from hethub.runtime.slowdown import parse_slowdown, slowdown_at
    from hethub.runtime.train_args import parse_rank_args, train_argv

    a, b = parse_slowdown("3:2@10"), parse_slowdown("cpu-slow:1.5@0")
    assert (a.target, a.factor, a.step, str(a)) == ("3", 2.0, 10, "3:2@10")
    assert slowdown_at([a, b], rank=3, kind="cpu-slow", step=9) == 1.5
    assert slowdown_at([a, b], rank=3, kind="cpu-slow", step=10) == 3.0
    assert slowdown_at([a, b], rank=2, kind="cpu-fast", step=50) == 1.0
    for bad in ("3:0.5@1", "3:2", ":2@1", "3:x@1", "3:2@-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="RANK_OR_KIND:FACTOR@STEP"):
            parse_slowdown(bad)
    args = parse_rank_args(["--plan", "p.json", "--emulate-slowdown", "3:2@10", "--emulate-slowdown",
                            "cpu-slow:1.5@0", "--rebalance", "layers"])
    argv = train_argv(args)
    assert argv == ["--rebalance", "layers", "--emulate-slowdown", "3:2@10", "--emulate-slowdown", "cpu-slow:1.5@0"]
    assert parse_rank_args(["--plan", "p.json", *argv]).emulate_slowdown == args.emulate_slowdown
