"""Interleaved plans through the layout and the predictor: chunk placement, the wrap routing from
the last stage back to the first, per-chunk costs in the simulation, and weighted in-flight memory."""

import dataclasses

import pytest

from conftest import small_cluster, tiny_model
from hethub.layout import build_topology, stage_places, stage_units
from hethub.plan import Pipeline, Plan, Recompute, Stage, interleave, split_evenly
from hethub.predict.memory import stage_memory
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import predict
from hethub.schedules import get_schedule
from hethub.schedules.simulate import simulate_pipeline_time


def _plan(*, chunk_layers, m=4, tp_last=1) -> Plan:
    """4 stages fast, slow, fast, slow (the last one TP ``tp_last``) on an 8-layer model."""
    model, cluster = tiny_model(layers=8), small_cluster()
    stages = (Stage("fast", (0,), (0, 2), embedding=True), Stage("slow", (4,), (2, 4)),
              Stage("fast", (1,), (4, 6)), Stage("slow", tuple(range(6, 6 + tp_last)), (6, 8), head=True))
    base = Plan(model=model, cluster=cluster, global_batch=2 * m, seq_len=32, pipelines=(Pipeline(2, m, stages),),
                schedule="interleaved")
    return dataclasses.replace(base, pipelines=(interleave(base.pipelines[0], chunk_layers),)).validate()


def test_chunks_place_every_layer_once_and_route_the_wrap():
    plan = _plan(chunk_layers=[[1, 1], [1, 1], [1, 1], [2, 0]], tp_last=2)
    places = stage_places(plan)
    # Virtual order: s0 [0,1) s1 [1,2) s2 [2,3) s3 [3,5) | s0 [5,6) s1 [6,7) s2 [7,8) s3 [8,8) (head only).
    assert [st.layer_ranges for st in places] == [((0, 1), (5, 6)), ((1, 2), (6, 7)), ((2, 3), (7, 8)),
                                                  ((3, 5), (8, 8))]
    units = [stage_units(st, tied=False, learned_pos=False) for st in places]
    assert units[0] == ("embed", "layer.0", "layer.5") and units[3] == ("layer.3", "layer.4", "final_norm", "head")
    topo = build_topology(plan)
    first, last = topo.place(0), [topo.place(r) for r in places[3].ranks]
    # The last stage (TP 2) sends chunk 0's output to the first (TP 1) from its TP rank 0 only, and
    # both its ranks get the gradient back from it.
    assert last[0].wrap_send_to == (0,) and last[1].wrap_send_to == ()
    assert first.wrap_recv_from == places[3].ranks[0] and first.wrap_grad_send_to == places[3].ranks
    assert all(p.wrap_grad_recv_from == 0 for p in last)
    assert first.fwd_peers(0) == (None, first.fwd_send_to) and first.fwd_peers(1) == (places[3].ranks[0],
                                                                                        first.fwd_send_to)
    assert last[0].fwd_peers(0)[1] == (0,) and last[0].fwd_peers(1)[1] == ()  # the head's chunk sends nothing
    assert last[0].bwd_peers(1)[0] is None and last[0].bwd_peers(0)[0] == 0
    assert first.bwd_peers(0)[1] == () and first.bwd_peers(1)[1] == places[3].ranks
    # A middle stage routes every chunk to its neighbours.
    mid = topo.place(places[1].ranks[0])
    assert mid.fwd_peers(0) == mid.fwd_peers(1) and mid.wrap_send_to == () and mid.wrap_recv_from is None


def test_prediction_simulates_each_chunk_and_weighs_in_flight_memory():
    plan = _plan(chunk_layers=[[1, 1], [1, 1], [1, 1], [1, 1]], m=6)
    pred = predict(plan)
    sched = get_schedule("interleaved", chunks=2)
    for sp in pred.stages:
        assert sp.in_flight == sched.in_flight(stage=sp.stage, num_stages=4, num_micro_batches=6)
        # Equal one-layer chunks, the first carrying the embedding, the last the head: the peak is the
        # order's walk with each chunk's own activation bytes.
        s = plan.pipelines[0].stages[sp.stage]
        weights = [stage_memory(plan.model, layers=b - a, embedding=s.embedding and c == 0, head=s.head and c == 1,
                                tp=1, mbs=2, seq_len=32, recompute=False, precision=plan.precision_of(s.kind),
                                in_flight=1, attention=plan.attention_of(s.kind)).activations_bytes
                   for c, (a, b) in enumerate(s.layer_ranges)]
        want = sched.peak_held(stage=sp.stage, num_stages=4, num_micro_batches=6, chunk_weights=weights)
        assert sp.activations_bytes == pytest.approx(want, rel=1e-9)
    # The pipeline's time is the simulation over the 8 virtual stages, each chunk costed on its own,
    # the hop from the last stage back to the first included.
    costs = PlanCosts(plan, None)
    fwd, bwd, hops = costs.chunk_times(plan.pipelines[0], p2p=[sp.p2p_s for sp in pred.stages])
    assert len(fwd) == len(bwd) == 8 and len(hops) == 7 and hops[3] > 0
    assert pred.pipeline_times_s[0] == pytest.approx(max(simulate_pipeline_time(
        fwd_s=fwd, bwd_s=bwd, p2p_s=hops, num_micro_batches=6, schedule="interleaved", chunks=2)))
    # A middle stage's two one-layer chunks cost what its whole two layers do.
    assert fwd[1] + fwd[5] == pytest.approx(pred.stages[1].fwd_s)


def test_split_evenly_and_interleave_helpers():
    assert split_evenly(5, 2) == [3, 2] and split_evenly(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="need 4 stages x 2 chunk layer counts"):
        interleave(_plan(chunk_layers=[[2]] * 4).pipelines[0], [[1, 1]] * 3)


def test_planner_chooses_virtual_stages_where_they_pay_under_memory():
    # 16 Ascend 910B + 16 A100-80GB, llama-3-70b, batch 8 x 8192 (long enough sequences that activation
    # memory limits the stages: every stage recomputes in full): "auto" picks interleaved (v = 3) over
    # 1F1B and ZB-H1 (with the calibrated catalog ZB-H1 wins on nvidia-amd-32 at 16 x 8192). The
    # cross-vendor hop at 10 GB/s (a transport faster than gloo/TCP, comm/transport.py): at the file's
    # cited gloo figure every extra chunk boundary crosses a 1 GB/s hop and interleaving does not pay.
    from dataclasses import replace
    from pathlib import Path

    from hethub.search.config import PlannerConfig
    from hethub.search.planner import make_plan
    from hethub.spec.cluster import Link, load_cluster
    from hethub.spec.model import get_model

    cluster = replace(load_cluster(Path(__file__).resolve().parents[2] / "examples/clusters/nvidia-ascend-32.toml"),
                      cross_kind=Link(10e9, 50e-6), cross_kind_source="test: a 10 GB/s cross-vendor transport")
    model = get_model("llama-3-70b")
    # Without sequence parallelism: with it the TP stages keep their activations split and no longer
    # recompute in full, and ZB-H1 wins (test_planner_memory_modes covers SP's choice).
    cfg = PlannerConfig(global_batch=8, seq_len=8192, sequence_parallel=False)
    one = make_plan(cluster=cluster, model=model, config=replace(cfg, schedule="1f1b"))
    auto = make_plan(cluster=cluster, model=model, config=replace(cfg, schedule="auto"))
    assert auto.plan.schedule == "interleaved" and max(p.virtual_stages for p in auto.plan.pipelines) > 1
    assert all(s.recompute != Recompute.NONE for p in auto.plan.pipelines for s in p.stages)
    assert auto.prediction.step_time_s < one.prediction.step_time_s
    assert auto.notes[0].startswith("schedule interleaved chosen")
    assert all(sp.fits for sp in auto.prediction.stages)
    # What the planner reports is what the predictor says of the plan it wrote, which round-trips.
    assert predict(auto.plan).step_time_s == pytest.approx(auto.prediction.step_time_s, rel=1e-12)
    assert Plan.from_dict(auto.plan.to_dict()) == auto.plan


def test_shared_core_replay_runs_the_chunked_order():
    # With as many cores as ranks (no contention, no measured host effects) the emulation host's
    # replay of an interleaved plan is the plain prediction: same chunk shares, hops and wrap.
    from pathlib import Path

    from hethub.emulation.host import host_model
    from hethub.spec.cluster import EmulationHost, load_cluster
    from hethub.spec.model import get_model

    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples/clusters/local-cpu.toml")
    ids = {k: [d.id for d in cluster.devices_of_kind(k)] for k in cluster.kind_names}
    stages = (Stage("cpu-fast", (ids["cpu-fast"][0],), (0, 3), embedding=True),
              Stage("cpu-fast", (ids["cpu-fast"][1],), (3, 6)),
              Stage("cpu-slow", (ids["cpu-slow"][0],), (6, 8), head=True))
    base = Plan(model=get_model("small"), cluster=cluster, global_batch=16, seq_len=128,
                pipelines=(Pipeline(2, 8, stages),), precision="fp32", schedule="interleaved")
    plan = dataclasses.replace(base, pipelines=(interleave(base.pipelines[0], [[1, 2], [2, 1], [1, 1]]),)).validate()
    host_plan = dataclasses.replace(plan, cluster=dataclasses.replace(cluster, host=EmulationHost(cores=3)))
    free = predict(dataclasses.replace(plan, cluster=dataclasses.replace(cluster, host=None)))
    replay = predict(host_plan, host=host_model(host_plan.cluster), timeline=True)
    assert replay.step_time_s == pytest.approx(free.step_time_s, rel=1e-9)
    assert len([e for e in replay.timeline if e.category == "forward"]) == 3 * 2 * 8  # every chunk's F
    # Fewer cores than ranks: the ranks share them, and the replay is slower.
    two = dataclasses.replace(cluster, host=EmulationHost(cores=2))
    shared = predict(dataclasses.replace(plan, cluster=two), host=host_model(two)).step_time_s
    assert shared > free.step_time_s
