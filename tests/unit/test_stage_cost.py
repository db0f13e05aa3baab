"""One stage cost model (predict/stage_cost.py) for predictor and planner: the planner's stage time,
parameters and memory equal the predictor's exactly, over random stage shapes, kinds, precisions,
attention implementations and TP degrees; the plan's per-kind attention changes predicted time."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.predict.memory import act_bytes_for, usable_bytes
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import predict
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.predict.seq_parallel import cp_ring_s
from hethub.predict.stage_cost import StageJob, StageModel
from hethub.schedules import get_schedule
from hethub.search.split import CostBook, Job
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import get_model

KINDS = ("a100-80gb", "v100-16gb", "h100-sxm", "mi300x", "ascend-910b")
MODELS = ("llama-2-7b", "llama-3-8b")


def _cluster():
    return parse_cluster({"name": "t", "group": [{"kind": k, "nodes": 6, "devices_per_node": 8} for k in KINDS]},
                         where="test")


CLUSTER = _cluster()


def _plan(*, kind: str, model: str, tp: int, mbs: int, seq_len: int, layers: tuple[int, int, int],
          recompute: Recompute, precision: str, attention: str | None, schedule: str = "1f1b", sp: bool = False,
          cp: int = 1) -> Plan:
    """Two identical 3-stage pipelines of one kind (so every stage syncs; the middle one has two
    neighbours, as the planner assumes of every stage before the plan exists)."""
    m = get_model(model)
    devs = [d.id for d in CLUSTER.devices if d.kind == kind]
    pipes, start, w = [], 0, tp * cp
    for r in range(2):
        stages, start = [], 0
        for si, n in enumerate(layers):
            stages.append(Stage(kind=kind, devices=tuple(devs[(r * 3 + si) * w:(r * 3 + si + 1) * w]),
                                layers=(start, start + n), embedding=si == 0, head=si == 2, recompute=recompute,
                                cp=cp, sequence_parallel=sp))
            start += n
        pipes.append(Pipeline(micro_batch_size=mbs, num_micro_batches=4, stages=tuple(stages)))
    m = replace(m, num_layers=start)
    settings_ = {kind: {"attention": attention}} if attention else {}
    return Plan(model=m, cluster=CLUSTER, global_batch=8 * mbs, seq_len=seq_len, pipelines=tuple(pipes),
                schedule=schedule, precision=precision, kind_settings=settings_)


shapes = st.fixed_dictionaries({
    "kind": st.sampled_from(KINDS), "model": st.sampled_from(MODELS), "tp": st.sampled_from((1, 2, 4)),
    "mbs": st.sampled_from((1, 2, 4)), "seq_len": st.sampled_from((512, 2048)),
    "layers": st.tuples(st.integers(0, 6), st.integers(1, 6), st.integers(0, 6)),
    "recompute": st.sampled_from(list(Recompute)), "precision": st.sampled_from(("fp32", "bf16-mixed", "fp16-mixed")),
    "schedule": st.sampled_from(("1f1b", "zb-h1", "gpipe")),
})


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_the_planners_stage_time_and_memory_are_the_predictors(shape):
    # The plans the planner writes carry no per-kind settings: each kind's catalog attention (math on
    # V100, flash elsewhere) and its precision for the plan-wide one.
    plan = _plan(attention=None, **shape).validate()
    pred, costs = predict(plan), PlanCosts(plan, None)
    job = Job(model=plan.model, seq_len=plan.seq_len, precision=plan.precision, schedule=plan.schedule)
    book = CostBook(job, CLUSTER)
    sched = get_schedule(plan.schedule)
    for sp in pred.stages:
        s = plan.pipelines[sp.pipeline].stages[sp.stage]
        sm = book.stage(s.kind, tp=s.tp, mbs=shape["mbs"], recompute=s.recompute)
        step = sm.step(s.num_layers, emb=s.embedding, head=s.head)
        assert (step.fwd_s, step.bwd_s, step.times.update_s) == (sp.fwd_s, sp.bwd_s, sp.update_s)
        assert sm.params(s.num_layers, emb=s.embedding, head=s.head) * _state(plan, s.kind)["weights"] \
            == sp.weights_bytes
        if sp.stage == 1:  # two neighbours and a sync, as the planner assumes
            held = sched.in_flight(stage=1, num_stages=3, num_micro_batches=4)
            # The point-to-point buffers depend on the stage's place in the schedule's order: the
            # plan's (PlanCosts.p2p_bytes) is exact, the search's is the memory model's estimate.
            mem = sm.memory(s.num_layers, emb=False, head=False, in_flight=held, p2p_bytes=costs.p2p_bytes(0, 1))
            assert mem.total_bytes == sp.memory.total_bytes
            assert sm.memory_bytes(s.num_layers, emb=False, head=False, in_flight=held) \
                == _close(sm.memory(s.num_layers, emb=False, head=False, in_flight=held).total_bytes)


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from((1, 2, 4)), st.booleans())
def test_sequence_and_context_parallel_stages_are_one_model(shape, cp, sp):
    # SP (TP > 1) and CP stages: the stage model's time plus the CP ring's passes (device-dependent,
    # seq_parallel.cp_ring_s, as hops are) and its memory are the predictor's exactly.
    cp = min(cp, 8 // shape["tp"]) if shape["tp"] > 1 or cp > 1 else 2  # a node's 8 devices per stage
    sp = sp and shape["tp"] > 1
    plan = _plan(attention=None, sp=sp, cp=cp, **shape).validate()
    pred = predict(plan)
    job = StageJob.of_plan(plan, None)
    sched = get_schedule(plan.schedule)
    for sp_ in pred.stages:
        s = plan.pipelines[sp_.pipeline].stages[sp_.stage]
        sm = StageModel(job, CLUSTER.kinds[s.kind], tp=s.tp, mbs=shape["mbs"], recompute=s.recompute,
                        capacity_bytes=usable_bytes(CLUSTER.kinds[s.kind]), sp=sp, cp=cp)
        step = sm.step(s.num_layers, emb=s.embedding, head=s.head)
        ring_f, ring_b = cp_ring_s(CLUSTER, s, model=plan.model, mbs=shape["mbs"], seq_len=plan.seq_len,
                                   act_bytes=act_bytes_for(plan.precision), layers=s.num_layers)
        assert (step.fwd_s + ring_f, step.bwd_s + ring_b) == (sp_.fwd_s, sp_.bwd_s)
        if sp_.stage == 1:
            held = sched.in_flight(stage=1, num_stages=3, num_micro_batches=4)
            mem = sm.memory(s.num_layers, emb=False, head=False, in_flight=held,
                            p2p_bytes=PlanCosts(plan, None).p2p_bytes(0, 1))
            assert mem.total_bytes == sp_.memory.total_bytes


def test_sequence_parallelism_and_cp_change_the_stage_model():
    # The rules are in the one model: CP divides the compute, SP adds the norms' gradient sums, and
    # both cut the kept activations.
    kind = CLUSTER.kinds["a100-80gb"]
    plan = _plan(attention=None, kind="a100-80gb", model="llama-2-7b", tp=2, mbs=1, seq_len=2048, layers=(2, 2, 2),
                 recompute=Recompute.NONE, precision="bf16-mixed")
    job = StageJob.of_plan(plan, None)

    def model(sp: bool, cp: int) -> StageModel:
        return StageModel(job, kind, tp=2, mbs=1, recompute=Recompute.NONE, capacity_bytes=usable_bytes(kind),
                          sp=sp, cp=cp)

    base, seq, ctx = model(False, 1), model(True, 1), model(False, 2)
    assert ctx.step(4, emb=False, head=False).fwd_s < base.step(4, emb=False, head=False).fwd_s
    assert seq.step(4, emb=False, head=False).bwd_s > base.step(4, emb=False, head=False).bwd_s
    for other in (seq, ctx):
        assert other.memory(4, emb=False, head=False, in_flight=2).activations_bytes \
            < base.memory(4, emb=False, head=False, in_flight=2).activations_bytes


def _state(plan: Plan, kind: str) -> dict[str, int]:
    from hethub.predict.memory import state_bytes_per_param

    return state_bytes_per_param(plan.precision_of(kind))


class _close(float):
    """Equal within the per-part lines' rounding (StageModel.memory_bytes adds the parts' lines)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(other - float(self)) <= 1e-9 * float(self)

    __hash__ = float.__hash__


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(("flash", "math")))
def test_the_plans_per_kind_attention_is_one_model_for_time_and_memory(shape, attention):
    # A plan's training.kinds.<kind>.attention: the stage model of the plan's job (what the predictor
    # prices) gives the predictor's times and memory exactly, whichever implementation is set.
    plan = _plan(attention=attention, **shape).validate()
    pred = predict(plan)
    job = StageJob.of_plan(plan, None)
    sched = get_schedule(plan.schedule)
    for sp in pred.stages:
        s = plan.pipelines[sp.pipeline].stages[sp.stage]
        sm = StageModel(job, CLUSTER.kinds[s.kind], tp=s.tp, mbs=shape["mbs"], recompute=s.recompute,
                        capacity_bytes=usable_bytes(CLUSTER.kinds[s.kind]))
        step = sm.step(s.num_layers, emb=s.embedding, head=s.head)
        assert (step.fwd_s, step.bwd_s) == (sp.fwd_s, sp.bwd_s)
        if sp.stage == 1:
            held = sched.in_flight(stage=1, num_stages=3, num_micro_batches=4)
            assert sm.memory(s.num_layers, emb=False, head=False, in_flight=held,
                             p2p_bytes=PlanCosts(plan, None).p2p_bytes(0, 1)).total_bytes == sp.memory.total_bytes


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_max_layers_is_the_largest_count_the_predictors_memory_fits(shape):
    plan = _plan(attention=None, **shape).validate()
    costs = PlanCosts(plan, None)
    kind = CLUSTER.kinds[shape["kind"]]
    book = CostBook(Job(model=plan.model, seq_len=plan.seq_len, precision=plan.precision, schedule="1f1b"), CLUSTER)
    sm = book.stage(shape["kind"], tp=shape["tp"], mbs=shape["mbs"], recompute=shape["recompute"])
    limit = 12
    for emb, head, held in ((True, False, 3), (False, False, 2), (False, True, 1)):
        fits = [n for n in range(limit + 1) if costs.memory_of(
            (shape["kind"], n, emb, head, shape["tp"], shape["mbs"], shape["recompute"], held, True, False, 2, None,
             False, 1, None)
        ).total_bytes <= usable_bytes(kind)]
        assert sm.max_layers(emb=emb, head=head, in_flight=held, limit=limit) == (max(fits) if fits else -1)


def test_the_plans_per_kind_attention_changes_predicted_time():
    # Math attention keeps and moves the s x s scores: the op model prices it slower than flash on
    # the same kind, and the plan's setting, not the catalog's, decides.
    base = dict(kind="a100-80gb", model="llama-2-7b", tp=1, mbs=2, seq_len=2048, layers=(4, 4, 4),
                recompute=Recompute.NONE, precision="bf16-mixed")
    flash = predict(_plan(attention="flash", **base).validate())
    math_ = predict(_plan(attention="math", **base).validate())
    assert math_.stages[1].fwd_s > flash.stages[1].fwd_s * 1.01
    assert math_.step_time_s > flash.step_time_s
    assert math_.stages[1].attention == "math" and flash.stages[1].attention == "flash"


def test_a_profile_at_another_sequence_length_is_not_used_by_either():
    # The profile rule has one home: a profile measured at 1024 tokens prices neither the predictor's
    # stage nor the planner's at 2048 (both fall back to the analytic model); at 1024 both use it.
    layer = LayerTimes(0.01, 0.02, 0.001)
    entry = ProfileEntry(LayerTimes(0.001, 0.002, 0.0), layer, LayerTimes(0.003, 0.006, 0.0), None, False, (), 1.0)
    for seq_len, source in ((1024, "profile"), (2048, "analytic")):
        prof = ProfileSet({"a100-80gb": KindProfile("a100-80gb", "llama-2-7b", 1024, {(1, 1): entry})})
        plan = _plan(attention=None, kind="a100-80gb", model="llama-2-7b", tp=1, mbs=1, seq_len=seq_len,
                     layers=(2, 2, 2), recompute=Recompute.NONE, precision="bf16-mixed").validate()
        pred = predict(plan, profiles=prof)
        job = Job(model=plan.model, seq_len=seq_len, precision=plan.precision, schedule="1f1b", profiles=prof)
        sm = CostBook(job, CLUSTER).stage("a100-80gb", tp=1, mbs=1, recompute=Recompute.NONE)
        assert sm.step(2, emb=False, head=False).times.source.startswith(source)
        assert pred.stages[1].compute_source.startswith(source)
        assert sm.step(2, emb=False, head=False).fwd_s == pred.stages[1].fwd_s


def test_the_kept_work_lines_are_each_shapes_own():
    # StageModel.work keeps its line per (emb, head): asked in any order and again, each is what a fresh
    # model (nothing kept) gives for that shape, over kinds, TP degrees, sizes, modes and SP.
    plan = _plan(attention=None, kind="a100-80gb", model="llama-2-7b", tp=2, mbs=1, seq_len=2048, layers=(2, 2, 2),
                 recompute=Recompute.NONE, precision="bf16-mixed")
    job = StageJob.of_plan(plan, None)
    shapes = [(e, h) for e in (False, True) for h in (False, True)]
    for i, (kind, tp, mbs, rc, sp) in enumerate((k, t, b, r, s) for k in ("a100-80gb", "mi300x") for t in (1, 4)
                                                  for b in (1, 2) for r in Recompute for s in (False, True)):
        device = CLUSTER.kinds[kind]

        def model(kind=device, tp=tp, mbs=mbs, rc=rc, sp=sp) -> StageModel:
            return StageModel(job, kind, tp=tp, mbs=mbs, recompute=rc, capacity_bytes=usable_bytes(kind), sp=sp)

        kept = model()
        order = shapes[i % 4:] + shapes[:i % 4]
        for emb, head in order + order[::-1]:
            assert kept.work(emb=emb, head=head) == model().work(emb=emb, head=head), (kind, tp, mbs, rc, sp, emb, head)
