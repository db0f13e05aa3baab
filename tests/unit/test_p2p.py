"""Pipeline transfer modes (training.p2p): asynchronous sends (hethub's runtime) against blocking ones
(Megatron-LM), in the event simulation, the plan, the predictor and the CLI. The lock-step mode
(DeepSpeed's pipeline engine) has its own tests, tests/unit/test_lockstep.py."""

import json
import random
from dataclasses import replace

import pytest

from conftest import small_cluster, three_stage_plan, tiny_model, two_stage_plan
from hethub import cli
from hethub.errors import PlanError
from hethub.interop import import_sailor_plan
from hethub.plan import PLAN_VERSION, PLAN_VERSION_P2P, Plan
from hethub.predict.predictor import predict
from hethub.schedules import DEFAULT_P2P, P2P_MODES
from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time

SCHEDULES_ONE_CHUNK = ("1f1b", "gpipe", "zb-h1")


def _random_pipeline(rng: random.Random, *, zero_p2p: bool = False) -> dict:
    p = rng.randint(1, 6)
    return {"fwd_s": [rng.uniform(0.5, 2.0) for _ in range(p)], "bwd_s": [rng.uniform(1.0, 4.0) for _ in range(p)],
            "p2p_s": [0.0 if zero_p2p else rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(1.0, 6.0)])
                      for _ in range(p - 1)],
            "num_micro_batches": rng.randint(1, 12)}


def test_modes_and_default():
    assert P2P_MODES == ("async", "blocking", "lockstep") and DEFAULT_P2P == "async"
    with pytest.raises(ValueError, match=r"unknown p2p mode 'eager'.*async, blocking, lockstep"):
        simulate_pipeline_time(fwd_s=[1.0], bwd_s=[2.0], p2p_s=[], num_micro_batches=1, p2p="eager")


@pytest.mark.parametrize("schedule", SCHEDULES_ONE_CHUNK)
def test_blocking_never_finishes_a_stage_earlier(schedule):
    rng = random.Random(schedule)
    for _ in range(60):
        kw = _random_pipeline(rng)
        a = simulate_pipeline_time(**kw, schedule=schedule)
        b = simulate_pipeline_time(**kw, schedule=schedule, p2p="blocking")
        assert all(y >= x for x, y in zip(a, b, strict=True)), (kw, a, b)


def test_blocking_interleaved_is_never_faster():
    rng = random.Random(7)
    for _ in range(30):
        p, v = rng.randint(2, 4), 2
        m = p * rng.randint(1, 3)  # interleaved 1F1B runs multiples of the stage count
        kw = {"fwd_s": [rng.uniform(0.5, 2.0) for _ in range(p * v)], "bwd_s": [rng.uniform(1.0, 4.0)] * (p * v),
              "p2p_s": [rng.uniform(0.0, 3.0) for _ in range(p * v - 1)], "num_micro_batches": m}
        a = simulate_pipeline_time(**kw, schedule="interleaved", chunks=v)
        b = simulate_pipeline_time(**kw, schedule="interleaved", chunks=v, p2p="blocking")
        assert max(b) >= max(a), (kw, a, b)


@pytest.mark.parametrize("schedule", SCHEDULES_ONE_CHUNK)
def test_without_transfers_blocking_is_async(schedule):
    rng = random.Random(f"zero {schedule}")
    for _ in range(30):
        kw = _random_pipeline(rng, zero_p2p=True)
        assert (simulate_pipeline_time(**kw, schedule=schedule)
                == simulate_pipeline_time(**kw, schedule=schedule, p2p="blocking"))
        a = simulate_pipeline(**kw, schedule=schedule)
        b = simulate_pipeline(**kw, schedule=schedule, p2p="blocking")
        assert [[(o.kind, o.micro_batch, o.start_s, o.end_s) for o in st.ops] for st in a] == \
            [[(o.kind, o.micro_batch, o.start_s, o.end_s) for o in st.ops] for st in b]
        assert all(st.send_blocked_s == 0.0 for st in b)


def test_without_transfers_blocking_is_async_interleaved():
    kw = {"fwd_s": [1.0, 1.5, 0.5, 1.0], "bwd_s": [2.0, 3.0, 1.0, 2.5], "p2p_s": [0.0, 0.0, 0.0],
          "num_micro_batches": 4, "schedule": "interleaved", "chunks": 2}
    assert simulate_pipeline_time(**kw) == simulate_pipeline_time(**kw, p2p="blocking")


def _period_s(*, p: int, f: float, b: float, t: float, p2p: str, m: int = 240) -> float:
    """Steady-state time per micro-batch of a uniform 1F1B pipeline: the step's growth per micro-batch
    (m a multiple of p: the steady state repeats every p micro-batches)."""
    def step(n: int) -> float:
        return max(simulate_pipeline_time(fwd_s=[f] * p, bwd_s=[b] * p, p2p_s=[t] * (p - 1), num_micro_batches=n,
                                          schedule="1f1b", p2p=p2p))
    return (step(2 * m) - step(m)) / m


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("t", [0.5, 5.0])  # a fast link, and a slow one (transfer > forward + backward)
def test_uniform_1f1b_periods_match_closed_forms(p, t):
    f, b = 1.0, 2.0
    # Async: 1F1B lets stage 0 run p micro-batches ahead of its oldest backward, whose round trip is
    # p (F + B) + 2 (p - 1) T: the pace is one round trip per p micro-batches (>= F + B and >= T).
    assert _period_s(p=p, f=f, b=b, t=t, p2p="async") == pytest.approx(f + b + 2 * (p - 1) * t / p)
    # Blocking: a stage is also busy for each message it sends, one transfer each. On 2 stages each
    # stage sends one message per micro-batch (the two cross the link at once, in opposite directions):
    # F + B + T, the same pace as async; inner stages of 3 or more send both ways: F + B + 2 T.
    sends = 1 if p == 2 else 2
    assert _period_s(p=p, f=f, b=b, t=t, p2p="blocking") == pytest.approx(f + b + sends * t)


def test_two_stages_blocking_costs_only_in_the_fill():
    # On 2 uniform stages blocking sends hold each stage in the steady state exactly while it would
    # wait for its input anyway; what they add is in the fill and drain, the same for any m.
    def step(m: int, p2p: str) -> float:
        return max(simulate_pipeline_time(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], p2p_s=[5.0], num_micro_batches=m,
                                          p2p=p2p))
    extra = [step(m, "blocking") - step(m, "async") for m in (4, 16, 64)]
    assert extra[0] > 0 and extra == pytest.approx([extra[0]] * 3)


@pytest.mark.parametrize("schedule", SCHEDULES_ONE_CHUNK)
def test_blocking_records_hold_the_stage_until_delivery(schedule):
    rng = random.Random(f"records {schedule}")
    for _ in range(20):
        kw = _random_pipeline(rng)
        fast = simulate_pipeline_time(**kw, schedule=schedule, p2p="blocking")
        stages = simulate_pipeline(**kw, schedule=schedule, p2p="blocking")
        p = len(kw["fwd_s"])
        assert [st.finish_s for st in stages] == fast
        for s, st in enumerate(stages):
            for op, nxt in zip(st.ops, [*st.ops[1:], None], strict=True):
                sends = (op.kind == "F" and s < p - 1) or (op.kind == "B" and s > 0)
                assert (op.send_done_s is not None) == sends, (s, op)
                free = op.end_s if op.send_done_s is None else op.send_done_s
                assert free >= op.end_s
                if nxt is not None:
                    assert nxt.start_s >= free
                if op.kind == "F" and s < p - 1:  # the receiver starts no earlier than delivery
                    assert op.send_done_s >= op.end_s + kw["p2p_s"][s]
                    peer = next(o for o in stages[s + 1].ops if o.kind == "F" and o.micro_batch == op.micro_batch)
                    assert peer.start_s >= op.send_done_s
            assert st.send_blocked_s >= 0.0


def test_zb_h1_sends_after_b_not_w():
    stages = simulate_pipeline(fwd_s=[1.0, 1.0, 1.0], bwd_s=[2.0, 2.0, 2.0], p2p_s=[3.0, 3.0], num_micro_batches=6,
                               schedule="zb-h1", p2p="blocking")
    for st in stages[1:]:
        assert all(op.send_done_s is None for op in st.ops if op.kind == "W")
        assert all(op.send_done_s is not None for op in st.ops if op.kind == "B")


# ---- the plan ---------------------------------------------------------------------------------------
def test_plan_round_trip_and_version():
    async_plan = two_stage_plan()
    data = async_plan.to_dict()
    assert "p2p" not in data["training"] and data["version"] == PLAN_VERSION  # unchanged for hethub's runtime
    assert Plan.from_dict(data).p2p == "async"
    blocking = replace(async_plan, p2p="blocking").validate()
    data = json.loads(blocking.to_json())
    assert data["training"]["p2p"] == "blocking" and data["version"] == PLAN_VERSION_P2P
    back = Plan.from_dict(data)
    assert back.p2p == "blocking" and back == blocking


def test_plan_rejects_an_unknown_p2p_mode_naming_the_field():
    data = replace(two_stage_plan(), p2p="blocking").to_dict()
    data["training"]["p2p"] = "sync"
    with pytest.raises(PlanError, match=r"'training\.p2p' is 'sync'.*Fix: use one of async, blocking"):
        Plan.from_dict(data)
    data["training"]["p2p"] = True
    with pytest.raises(PlanError, match=r"'training\.p2p' must be a string"):
        Plan.from_dict(data)


# ---- the predictor ----------------------------------------------------------------------------------
def test_prediction_with_blocking_sends():
    plan = three_stage_plan()
    a = predict(plan, timeline=True)
    b = predict(replace(plan, p2p="blocking"), timeline=True)
    assert b.step_time_s > a.step_time_s
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert sb.compute_s == sa.compute_s
        # Held sends are exposed communication; the step's parts still add up to it.
        assert sb.exposed_comm_s >= sa.exposed_comm_s
        assert sb.compute_s + sb.exposed_comm_s + sb.update_s + sb.bubble_s == pytest.approx(b.step_time_s)
    assert b.stages[1].exposed_comm_s > a.stages[1].exposed_comm_s  # the inner stage sends both ways
    # The inner stage's blocking sends last at least their transfer, and its next op starts after.
    sends = [e for e in b.timeline if e.category == "p2p" and e.stage == 1]
    starts = sorted(e.start_s for e in b.timeline if e.category in ("forward", "backward") and e.stage == 1)
    assert len(sends) == 2 * plan.pipelines[0].num_micro_batches
    for e in sends:
        transfer = b.stages[1 if e.name.startswith("send act") else 0].p2p_s
        assert e.end_s - e.start_s >= transfer * (1 - 1e-12)
        assert all(t >= e.end_s for t in starts if t > e.start_s)


def test_async_prediction_is_unchanged_by_the_field():
    plan = three_stage_plan()
    assert predict(replace(plan, p2p="async")).step_time_s == predict(plan).step_time_s


# ---- interop and the CLI ----------------------------------------------------------------------------
def test_sailor_import_sets_lockstep_and_says_why():
    data = {"pipeline_list": [{"num_stages": 2, "layers_per_stage": [[0, 1, 2, 3], [4, 5, 6, 7]],
                               "tmp_per_stage": [[[[["fast", 1, "z"]], 1]], [[[["slow", 1, "z"]], 1]]],
                               "dp": [1, 1]}], "mbs": 1, "gbs": 4}
    plan = import_sailor_plan(data, cluster=small_cluster(), model=tiny_model(), seq_len=32)
    assert plan.p2p == "lockstep"
    assert "DeepSpeed" in plan.meta["sailor"]["p2p_note"] and "lockstep" in plan.meta["sailor"]["p2p_note"]


def test_predict_cli_overrides_the_plans_p2p(tmp_path, capsys):
    path = tmp_path / "plan.json"
    three_stage_plan().save(path)
    got = {}
    for mode in (None, "async", "blocking"):
        code = cli.main(["predict", "--plan", str(path), "--json", *(["--p2p", mode] if mode else [])])
        assert code == 0
        out = json.loads(capsys.readouterr().out)
        got[mode] = (out["p2p"], out["step_time_s"])
    assert got[None] == got["async"] and got["async"][0] == "async"
    assert got["blocking"][0] == "blocking" and got["blocking"][1] > got["async"][1]
    assert cli.main(["predict", "--plan", str(path), "--p2p", "blocking"]) == 0
    assert "blocking sends between stages" in capsys.readouterr().out
