import dataclasses
import json

import pytest

from conftest import small_cluster, tiny_model, two_stage_plan
from hethub.errors import PlanError
from hethub.plan import Pipeline, Plan, Recompute, Stage


def test_round_trip_is_exact(tmp_path):
    plan = two_stage_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.to_dict() == plan.to_dict()


def test_ranks_are_dense_in_device_order():
    plan = two_stage_plan()
    d = plan.to_dict()
    assert d["world_size"] == 2
    assert [s["ranks"] for s in d["pipelines"][0]["stages"]] == [[0], [1]]
    assert [s["devices"] for s in d["pipelines"][0]["stages"]] == [[0], [4]]


def _mutate(plan: Plan, **changes) -> dict:
    d = plan.to_dict()
    for path, value in changes.items():
        cur = d
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        last = keys[-1]
        if isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value
    return d


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"training.global_batch": 9}, "global_batch"),
        ({"pipelines.0.stages.0.layers": [0, 3]}, "pipelines[0].stages[1].layers"),
        ({"pipelines.0.stages.1.layers": [4, 5]}, "pipelines[0].stages"),
        ({"pipelines.0.stages.0.kind": "slow"}, "pipelines[0].stages[0].devices"),
        ({"pipelines.0.stages.0.kind": "h100"}, "pipelines[0].stages[0].kind"),
        ({"pipelines.0.stages.1.devices": [0]}, "pipelines[0].stages[1].devices"),
        ({"pipelines.0.stages.1.devices": [99]}, "pipelines[0].stages[1].devices"),
        ({"pipelines.0.stages.0.embedding": False}, "pipelines[0].stages[0].embedding"),
        ({"pipelines.0.stages.0.head": True}, "pipelines[0].stages[0].head"),
        ({"pipelines.0.stages.0.ranks": [5]}, "pipelines[0].stages[0].ranks"),
        ({"pipelines.0.stages.0.tp": 2}, "pipelines[0].stages[0].tp"),
        ({"training.schedule": "zigzag"}, "schedule"),
        ({"training.seq_len": 10_000}, "seq_len"),
        ({"version": 99}, "version"),
        ({"pipelines.0.stages.1.recompute": "attention"}, "pipelines[0].stages[1].recompute"),
        ({"pipelines.0.stages.1.recompute": 1}, "pipelines[0].stages[1].recompute"),
        ({"format": "sailor"}, "format"),
    ],
)
def test_validation_names_the_field(change, field):
    d = _mutate(two_stage_plan(), **change)
    with pytest.raises(PlanError) as err:
        Plan.from_dict(json.loads(json.dumps(d)))
    assert field in str(err.value)
    assert "Fix:" in str(err.value)


def test_tp_must_stay_in_node_and_divide_heads():
    cluster = small_cluster(per_node=2)
    model = tiny_model()
    # devices 1 and 2 sit on different nodes
    bad = Stage("fast", (1, 2), (0, 6), embedding=True, head=True)
    with pytest.raises(PlanError, match="span several nodes"):
        Plan(model=model, cluster=cluster, global_batch=2, seq_len=8, pipelines=(Pipeline(1, 2, (bad,)),)).validate()
    m3 = dataclasses.replace(model, num_heads=6, num_kv_heads=3, hidden_size=96)
    ok_node = Stage("fast", (0, 1), (0, 6), embedding=True, head=True)
    with pytest.raises(PlanError, match=r"stages\[0\]\.tp"):
        Plan(model=m3, cluster=cluster, global_batch=2, seq_len=8, pipelines=(Pipeline(1, 2, (ok_node,)),)).validate()


def test_unequal_replicas_and_splits_are_valid():
    cluster, model = small_cluster(), tiny_model()
    p1 = Pipeline(2, 3, (Stage("fast", (0,), (0, 4), embedding=True), Stage("slow", (4,), (4, 6), head=True)))
    p2 = Pipeline(2, 1, (Stage("fast", (1,), (0, 2), embedding=True), Stage("slow", (5,), (2, 6), head=True)))
    plan = Plan(model=model, cluster=cluster, global_batch=8, seq_len=16, pipelines=(p1, p2)).validate()
    assert plan.world_size == 4
    assert plan.rank_of_device() == {0: 0, 1: 1, 4: 2, 5: 3}


def test_load_reports_missing_file_and_bad_json(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)


def test_recompute_is_a_mode_and_old_booleans_still_load():
    plan = two_stage_plan()
    d = plan.to_dict()
    assert [s["recompute"] for s in d["pipelines"][0]["stages"]] == ["none", "none"]
    for written, mode in ((True, "full"), (False, "none"), ("selective", "selective"), ("full", "full")):
        old = _mutate(plan, **{"pipelines.0.stages.1.recompute": written, "version": 2 if written in (True, False)
                               else d["version"]})
        again = Plan.from_dict(json.loads(json.dumps(old)))
        assert again.pipelines[0].stages[1].recompute is Recompute(mode)
        assert again.to_dict()["pipelines"][0]["stages"][1]["recompute"] == mode  # written as the word
    # In code too: a bool is full or none; only "none" is falsy.
    st = plan.pipelines[0].stages[0]
    assert dataclasses.replace(st, recompute=True).recompute is Recompute.FULL
    assert not dataclasses.replace(st, recompute="none").recompute
    assert dataclasses.replace(st, recompute="selective").recompute
    with pytest.raises(PlanError, match="none, selective, full"):
        dataclasses.replace(st, recompute="some")


# ---- virtual stages (interleaved schedule) -----------------------------------------------------------
def _interleaved_plan(chunk_layers=((1, 2), (2, 1)), schedule="interleaved") -> Plan:
    from hethub.plan import interleave

    plan = two_stage_plan()
    pipe = interleave(plan.pipelines[0], [list(c) for c in chunk_layers])
    return dataclasses.replace(plan, pipelines=(pipe,), schedule=schedule)


def test_chunked_stages_round_trip_and_old_plans_load_unchanged(tmp_path):
    plan = _interleaved_plan().validate()
    s0, s1 = plan.pipelines[0].stages
    # Virtual-stage order: s0 c0 = [0,1), s1 c0 = [1,3), s0 c1 = [3,5), s1 c1 = [5,6): unequal chunks.
    assert s0.layer_ranges == ((0, 1), (3, 5)) and s1.layer_ranges == ((1, 3), (5, 6))
    assert (s0.num_layers, s1.num_layers, plan.pipelines[0].virtual_stages) == (3, 3, 2)
    d = plan.to_dict()
    assert d["version"] == 5 and d["pipelines"][0]["virtual_stages"] == 2
    s0_json = d["pipelines"][0]["stages"][0]
    assert s0_json["chunks"] == [[0, 1], [3, 5]] and "layers" not in s0_json
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    # A plan without chunks is written as before (version 4, 'layers', no 'virtual_stages').
    old = two_stage_plan().to_dict()
    assert old["version"] == 4 and "virtual_stages" not in old["pipelines"][0]
    assert Plan.from_dict(old) == two_stage_plan()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["pipelines"][0].__setitem__("virtual_stages", 3),
         "'pipelines[0].virtual_stages' is 3 but stage 0 lists 2 layer chunk(s)"),
        (lambda d: d["pipelines"][0]["stages"][1].__setitem__("chunks", [[1, 3], [5, 5], [5, 6]]),
         "'pipelines[0].stages[1].chunks' holds 3 chunk(s) but stage 0 holds 2"),
        (lambda d: d["pipelines"][0]["stages"][1].__setitem__("chunks", [[1, 3], [4, 6]]),
         "'pipelines[0].stages[1].chunks[1]' is [4, 6), expected to start at 5"),
        (lambda d: d["pipelines"][0]["stages"][0].__setitem__("chunks", [[0, 1]]),
         "'pipelines[0].stages[0].chunks' lists 1 range(s)"),
        (lambda d: d["pipelines"][0]["stages"][0].__setitem__("layers", [0, 1]),
         "'pipelines[0].stages[0].layers' is given beside 'chunks'"),
        (lambda d: d["pipelines"][0]["stages"][0].__setitem__("chunks", [[0, 1], "3-5"]),
         "'pipelines[0].stages[0].chunks[1]' must be [start, end)"),
        (lambda d: d["training"].__setitem__("schedule", "1f1b"),
         "'pipelines[0].virtual_stages' is 2 but the plan's schedule is '1f1b'"),
    ],
)
def test_chunked_stage_errors_name_the_field(mutate, message):
    d = _interleaved_plan().validate().to_dict()
    mutate(d)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Plan.from_dict(d)


def test_empty_chunks_pass_through_but_empty_stages_and_one_stage_pipelines_are_refused():
    plan = _interleaved_plan(((1, 0), (2, 3))).validate()  # stage 0's chunk 1 holds no layer: a pass-through
    assert plan.pipelines[0].stages[0].layer_ranges == ((0, 1), (3, 3))
    from hethub.plan import interleave

    stages = (Stage("fast", (0,), (0, 3), embedding=True), Stage("fast", (1,), (3, 3)),
              Stage("slow", (4,), (3, 6), head=True))
    pipe = interleave(Pipeline(2, 4, stages), [[3, 0], [0, 0], [0, 3]])
    with pytest.raises(PlanError, match=r"stages\[1\].chunks' is empty and the stage holds no embedding or head"):
        dataclasses.replace(_interleaved_plan(), pipelines=(pipe,)).validate()
    one = dataclasses.replace(two_stage_plan(), pipelines=(Pipeline(2, 4, (
        Stage("fast", (0,), (0, 3), embedding=True, head=True, chunks=((0, 3), (3, 6))),)),), schedule="interleaved")
    with pytest.raises(PlanError, match="virtual_stages' is 2 on a pipeline of one stage"):
        one.validate()


def test_a_laid_stage_is_the_constructors_stage():
    # Stage.laid sets the fields at once (the planner's layouts); it must give the very stage the
    # constructor gives, every field set (a field added to Stage and not to laid fails here).
    names = {f.name for f in dataclasses.fields(Stage)}
    for recompute in (*Recompute, "selective", True):
        for emb, head, sp in ((True, False, False), (False, True, True), (False, False, False)):
            fast = Stage.laid("a100-80gb", (4, 5), (2, 9), embedding=emb, head=head, recompute=recompute,
                              sequence_parallel=sp)
            slow = Stage(kind="a100-80gb", devices=(4, 5), layers=(2, 9), embedding=emb, head=head,
                         recompute=recompute, sequence_parallel=sp)
            assert fast == slow and vars(fast) == vars(slow) and set(vars(fast)) == names
            assert type(fast.recompute) is Recompute and hash(fast) == hash(slow)
