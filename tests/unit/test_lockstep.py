"""training.p2p "lockstep": DeepSpeed's pipeline engine (TrainSchedule's instruction order, each send and
its receive one rendezvous), in the simulation (hethub.schedules.lockstep), the plan, the predictor and
the CLI. The closed forms and the hand-computed step are in hethub/schedules/lockstep.py's docstring."""

import json
import random
from dataclasses import replace

import pytest

from conftest import three_stage_plan, two_stage_plan
from hethub import cli
from hethub.errors import PlanError
from hethub.plan import PLAN_VERSION_P2P, Plan
from hethub.predict.predictor import predict
from hethub.schedules import OneFOneB
from hethub.schedules.lockstep import (
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    simulate_lockstep,
    train_instructions,
)
from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 13)]


def _random_pipeline(rng: random.Random, *, p: int | None = None, m: int | None = None, zero_p2p: bool = False) -> dict:
    p = rng.randint(1, 6) if p is None else p
    return {"fwd_s": [rng.uniform(0.5, 2.0) for _ in range(p)], "bwd_s": [rng.uniform(1.0, 4.0) for _ in range(p)],
            "p2p_s": [0.0 if zero_p2p else rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(1.0, 6.0)])
                      for _ in range(p - 1)],
            "num_micro_batches": rng.randint(1, 12) if m is None else m}


def _ops(stages) -> list[list[tuple]]:
    return [[(o.kind, o.micro_batch, o.start_s, o.end_s) for o in st.ops] for st in stages]


# ---- the instruction order ---------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_compute_order_is_hethubs_1f1b_and_every_message_has_both_ends(p, m):
    progs = [train_instructions(stage=s, num_stages=p, num_micro_batches=m) for s in range(p)]
    for s, prog in enumerate(progs):
        compute = [(i.kind, i.micro_batch) for i in prog if i.kind in ("F", "B")]
        assert compute == [(o.kind, o.micro_batch) for o in OneFOneB().ops(stage=s, num_stages=p, num_micro_batches=m)]
    for h in range(p - 1):  # each hop carries every micro-batch's activations down and gradients up, once
        for send, recv, a, b in ((SEND_ACT, RECV_ACT, h, h + 1), (SEND_GRAD, RECV_GRAD, h + 1, h)):
            sent = [i.micro_batch for i in progs[a] if i.kind == send]
            got = [i.micro_batch for i in progs[b] if i.kind == recv]
            assert sent == got == list(range(m)), (h, send)
    assert not any(i.kind in (RECV_ACT, SEND_GRAD) for i in progs[0])
    assert not any(i.kind in (SEND_ACT, RECV_GRAD) for i in progs[-1])


def test_a_result_is_sent_in_the_next_step_paired_with_its_receive():
    # DeepSpeed's TrainSchedule on 2 stages, 2 micro-batches (deepspeed/runtime/pipe/schedule.py):
    # stage 0 sends F1's activations before it receives B0's gradients; stage 1 receives micro-batch 1's
    # activations before it sends B0's gradients.
    names = [[f"{i.kind}{i.micro_batch}" for i in train_instructions(stage=s, num_stages=2, num_micro_batches=2)]
             for s in range(2)]
    assert names[0] == ["F0", "send_act0", "F1", "send_act1", "recv_grad0", "B0", "recv_grad1", "B1"]
    assert names[1] == ["recv_act0", "F0", "B0", "recv_act1", "send_grad0", "F1", "B1", "send_grad1"]


# ---- the simulation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_no_deadlock_and_records_are_consistent(p, m):
    rng = random.Random(f"{p} {m}")
    kw = _random_pipeline(rng, p=p, m=m)
    stages = simulate_pipeline(**kw, p2p="lockstep")
    assert [st.finish_s for st in stages] == simulate_pipeline_time(**kw, p2p="lockstep")
    for s, st in enumerate(stages):
        assert sorted((o.kind, o.micro_batch) for o in st.ops) == sorted([("F", i) for i in range(m)]
                                                                         + [("B", i) for i in range(m)])
        for op, nxt in zip(st.ops, [*st.ops[1:], None], strict=True):
            sends = (op.kind == "F" and s < p - 1) or (op.kind == "B" and s > 0)
            assert (op.send_done_s is not None) == sends
            if sends:  # a send lasts its transfer at least, and holds the stage until delivery
                hop = s if op.kind == "F" else s - 1
                assert op.send_done_s >= op.end_s + kw["p2p_s"][hop]
            free = op.end_s if op.send_done_s is None else op.send_done_s
            assert (nxt.start_s if nxt else st.finish_s) >= free
        # Every transfer the stage is an end of: 2 per micro-batch and neighbour.
        hops = ([kw["p2p_s"][s - 1]] if s > 0 else []) + ([kw["p2p_s"][s]] if s < p - 1 else [])
        assert st.transfer_s == pytest.approx(2 * m * sum(hops))
        assert st.exposed_p2p_s == st.transfer_s
    for s in range(1, p):  # a receiver computes only after the delivery
        for op in stages[s].ops:
            if op.kind == "F":
                sender = next(o for o in stages[s - 1].ops if o.kind == "F" and o.micro_batch == op.micro_batch)
                assert op.start_s >= sender.send_done_s


def test_lockstep_is_never_faster_than_blocking_which_is_never_faster_than_async():
    # Lockstep adds constraints to blocking's (a transfer also waits for the receiver to arrive; a
    # send may wait behind the step's receive) and none of its durations is shorter; blocking adds the
    # sender's hold to async. Max-plus times only grow with added constraints: per stage, not just the step.
    rng = random.Random(11)
    for _ in range(300):
        kw = _random_pipeline(rng)
        a = simulate_pipeline_time(**kw)
        b = simulate_pipeline_time(**kw, p2p="blocking")
        lock = simulate_pipeline_time(**kw, p2p="lockstep")
        assert all(x <= y + 1e-9 for x, y in zip(a, b, strict=True)), kw
        assert all(x <= y + 1e-9 for x, y in zip(b, lock, strict=True)), kw


def test_without_transfers_the_step_is_the_async_step():
    # With no transfer time only the rendezvous remains: a stage may be held until its neighbour
    # reaches the matching call (so a later stage can finish later than under async sends), but the
    # step, the first stage's finish, is the async one; with uniform stages nothing is held at all.
    rng = random.Random(5)
    for _ in range(200):
        kw = _random_pipeline(rng, zero_p2p=True)
        a = simulate_pipeline_time(**kw)
        lock = simulate_pipeline(**kw, p2p="lockstep")
        assert lock[0].finish_s == a[0] and max(st.finish_s for st in lock) == max(a)
        assert all(st.finish_s >= x for st, x in zip(lock, a, strict=True))
        assert all(st.transfer_s == 0.0 for st in lock)
        p = len(kw["fwd_s"])
        uniform = {**kw, "fwd_s": [kw["fwd_s"][0]] * p, "bwd_s": [kw["bwd_s"][0]] * p}
        assert _ops(simulate_pipeline(**uniform, p2p="lockstep")) == _ops(simulate_pipeline(**uniform))


def _period_s(*, p: int, f: float, b: float, t: float, m: int = 240) -> float:
    def step(n: int) -> float:
        return max(simulate_pipeline_time(fwd_s=[f] * p, bwd_s=[b] * p, p2p_s=[t] * (p - 1), num_micro_batches=n,
                                          p2p="lockstep"))
    return (step(2 * m) - step(m)) / m


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("t", [0.5, 5.0])
def test_uniform_steady_state_closed_forms(p, t):
    # 2 stages: between two computes each stage takes part in two transfers, one each way, one after
    # the other: F + B + 2T (blocking: F + B + T). From 3 stages an inner stage is an end of four
    # transfers per micro-batch: F + B + 4T (blocking: F + B + 2T).
    f, b = 1.0, 2.0
    assert _period_s(p=p, f=f, b=b, t=t) == pytest.approx(f + b + (2 if p == 2 else 4) * t)


def test_two_stage_step_by_hand():
    # F = 1, B = 2, T = 0.5, 2 micro-batches (instruction lists above). Stage 0: F0 [0, 1], its send
    # meets stage 1's receive (posted at 0) and is delivered at 1.5; F1 [1.5, 2.5]; its send waits
    # for stage 1 (F0 [1.5, 2.5], B0 [2.5, 4.5]) to post recv_act1 at 4.5: delivered 5.0; then B0's
    # gradients 5.0-5.5; B0 [5.5, 7.5]. Stage 1: F1 [5.5, 6.5], B1 [6.5, 8.5], sends B1's gradients
    # 8.5-9.0, while stage 0 waits from 7.5; B1 [9, 11].
    stages = simulate_lockstep(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], p2p_s=[0.5], num_micro_batches=2)
    assert [[(o.kind, o.micro_batch, o.start_s, o.end_s, o.send_done_s) for o in st.ops] for st in stages] == [
        [("F", 0, 0.0, 1.0, 1.5), ("F", 1, 1.5, 2.5, 5.0), ("B", 0, 5.5, 7.5, None), ("B", 1, 9.0, 11.0, None)],
        [("F", 0, 1.5, 2.5, None), ("B", 0, 2.5, 4.5, 5.5), ("F", 1, 5.5, 6.5, None), ("B", 1, 6.5, 8.5, 9.0)]]
    assert [st.finish_s for st in stages] == [11.0, 9.0]
    assert [st.transfer_s for st in stages] == [2.0, 2.0]
    # Generally on 2 uniform stages: (m + 1)(F + B) + 2 m T (async: (m + 1)(F + B) + (m + 1) T).
    for m in range(1, 9):
        step = max(simulate_pipeline_time(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], p2p_s=[0.5], num_micro_batches=m,
                                          p2p="lockstep"))
        assert step == (m + 1) * 3.0 + 2 * m * 0.5


@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_other_schedules_are_refused_with_the_fix(schedule, chunks):
    kw = {"fwd_s": [1.0] * 4, "bwd_s": [2.0] * 4, "p2p_s": [0.5] * 3, "num_micro_batches": 4}
    with pytest.raises(ValueError, match=rf"training\.p2p is 'lockstep'.*training\.schedule '{schedule}'.*"
                                         r"Fix: set training\.schedule to '1f1b'.*training\.p2p to 'blocking'"):
        simulate_pipeline_time(**kw, schedule=schedule, chunks=chunks, p2p="lockstep")


# ---- the plan, the predictor, the CLI ------------------------------------------------------------------
def test_plan_round_trip_and_refusal():
    plan = replace(two_stage_plan(), p2p="lockstep").validate()
    data = json.loads(plan.to_json())
    assert data["training"]["p2p"] == "lockstep" and data["version"] == PLAN_VERSION_P2P
    assert Plan.from_dict(data) == plan
    data["training"]["schedule"] = "gpipe"
    with pytest.raises(PlanError, match=r"'training\.p2p' is 'lockstep'.*not training\.schedule 'gpipe'.*"
                                        r"Fix: set training\.schedule to '1f1b'"):
        Plan.from_dict(data)


def test_prediction_in_lockstep():
    plan = three_stage_plan()
    b = predict(replace(plan, p2p="blocking"), timeline=True)
    lock = predict(replace(plan, p2p="lockstep"), timeline=True)
    assert lock.step_time_s > b.step_time_s
    m = plan.pipelines[0].num_micro_batches
    for si, (sb, sl) in enumerate(zip(b.stages, lock.stages, strict=True)):
        assert sl.compute_s == sb.compute_s
        assert sl.compute_s + sl.exposed_comm_s + sl.update_s + sl.bubble_s == pytest.approx(lock.step_time_s)
        # Exposed communication holds every transfer the stage is an end of, 2 per micro-batch and hop.
        hops = (lock.stages[si - 1].p2p_s if si > 0 else 0.0) + sl.p2p_s
        assert sl.exposed_comm_s >= 2 * m * hops * (1 - 1e-12)
    sends = [e for e in lock.timeline if e.category == "p2p" and e.stage == 1]
    assert len(sends) == 2 * m


def test_predict_cli_lockstep(tmp_path, capsys):
    path = tmp_path / "plan.json"
    three_stage_plan().save(path)
    steps = {}
    for mode in ("blocking", "lockstep"):
        assert cli.main(["predict", "--plan", str(path), "--json", "--p2p", mode]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["p2p"] == mode
        steps[mode] = out["step_time_s"]
    assert steps["lockstep"] > steps["blocking"]
    assert cli.main(["predict", "--plan", str(path), "--p2p", "lockstep"]) == 0
    assert "lockstep sends between stages" in capsys.readouterr().out
