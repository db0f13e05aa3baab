"""The predictor prices sequence and context parallelism through predict/seq_parallel.py: SP's
all-gathers and reduce-scatters in place of TP's all-reduces, the CP ring's K/V passes over the
cluster's links, each CP rank's share of the compute, and stage messages as the runtime sends them;
and the plan format's fields, validated and versioned."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hethub.errors import PlanError
from hethub.layout import Hop, hop
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import allreduce_time_s, ring_pass_time_s
from hethub.predict.predictor import predict
from hethub.predict.seq_parallel import cp_ring_link, sp_tp_comm_s
from hethub.spec.cluster import Link, load_cluster
from hethub.spec.model import get_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLUSTER = load_cluster(EXAMPLES / "clusters" / "a100-v100-32.toml")
MODEL = get_model("llama-3.1-8b")  # llama-3-8b's layers at up to 131,072 positions


def _plan(first: dict, second: dict | None = None, *, seq_len: int = 8192, mbs: int = 1) -> Plan:
    a100 = [d.id for d in CLUSTER.devices_of_kind("a100-40gb")]
    v100 = [d.id for d in CLUSTER.devices_of_kind("v100-16gb")]

    def devs(pool: list[int], n: int, *, spread: bool = False) -> tuple[int, ...]:
        per = CLUSTER.groups[CLUSTER.devices[pool[0]].group].devices_per_node
        return tuple(pool[i * per] for i in range(n)) if spread else tuple(pool[:n])

    f = {"tp": 1, "cp": 1, "sp": False, "spread": False, **first}
    s = {"tp": 1, "cp": 1, "sp": False, **(second or {})}
    stages = (Stage("a100-40gb", devs(a100, f["tp"] * f["cp"], spread=f["spread"]), (0, 16), embedding=True,
                    cp=f["cp"], sequence_parallel=f["sp"]),
              Stage("v100-16gb", devs(v100, s["tp"] * s["cp"]), (16, 32), head=True, cp=s["cp"],
                    sequence_parallel=s["sp"]))
    return Plan(model=MODEL, cluster=CLUSTER, global_batch=4 * mbs, seq_len=seq_len,
                pipelines=(Pipeline(mbs, 4, stages),), precision="bf16-mixed").validate()


def test_sp_prices_gathers_and_reduce_scatters_instead_of_all_reduces():
    plain, sp = (predict(_plan({"tp": 4, "sp": on}, {"tp": 4, "sp": on})).stages[0] for on in (False, True))
    k = CLUSTER.kinds["a100-40gb"]
    link = Link(k.intra_node_bw_bytes_per_s, k.intra_node_latency_s, k.intra_node_fabric)
    act = 1 * 8192 * MODEL.hidden_size * 2
    f, b = sp_tp_comm_s(act_bytes_per_layer=act, layers=16, tp=4, hidden_size=MODEL.hidden_size, link=link)
    # Forward: 2 all-gathers + 2 reduce-scatters per layer, each a ring pass of 1/t: the all-reduces'
    # bytes, each pass at its own (half) volume's achievable bandwidth (predict/fabrics.py).
    assert f == pytest.approx(16 * 4 * ring_pass_time_s(chunk_bytes=act / 4, participants=4, link=link))
    plain_f = 16 * 2 * allreduce_time_s(nbytes=act, participants=4, link=link)
    assert f >= plain_f
    assert sp.fwd_s - plain.fwd_s == pytest.approx(f - plain_f)
    assert sp.bwd_s - plain.bwd_s == pytest.approx(b - plain_f) and b > f  # the norms' weight-gradient sums
    assert sp.activations_bytes < plain.activations_bytes


def test_sp_stages_send_sequence_slices_between_them():
    """SP TP 4 -> SP TP 4 sends a quarter per pair and gathers nothing; TP 4 -> TP 4 without SP sends a
    quarter and gathers on arrival (Megatron's scatter-gather): the SP hop is cheaper by the gather."""
    plain, sp = (predict(_plan({"tp": 4, "sp": on}, {"tp": 4, "sp": on})).stages[0].p2p_s for on in (False, True))
    assert 0 < sp < plain
    assert hop(src_tp=4, src_sp=True, dst_tp=4, dst_sp=True, numel=8) == Hop("seq", parts=4)
    # another degree: the sender gathers, each receiver gets its flat half and gathers (one copy on the link)
    assert hop(src_tp=4, src_sp=True, dst_tp=2, dst_sp=False, numel=8) == Hop("flat", source_gathers=True,
                                                                             dest_gathers=True, parts=2)
    assert hop(src_tp=4, src_sp=True, dst_tp=1, dst_sp=False, numel=8) == Hop("whole", source_gathers=True)
    assert hop(src_tp=2, src_sp=False, dst_tp=4, dst_sp=True, numel=8) == Hop("seq", parts=4)


def test_cp_ring_is_priced_through_the_clusters_links():
    """CP 2 within a node vs across nodes: the same compute, the ring's passes slower across the NIC."""
    near = _plan({"cp": 2}, {"cp": 2}, seq_len=16384)
    far = _plan({"cp": 2, "spread": True}, {"cp": 2}, seq_len=16384)
    st_near, st_far = near.pipelines[0].stages[0], far.pipelines[0].stages[0]
    assert cp_ring_link(CLUSTER, st_far).bw_bytes_per_s < cp_ring_link(CLUSTER, st_near).bw_bytes_per_s
    a, b = predict(near).stages[0], predict(far).stages[0]
    assert b.fwd_s > a.fwd_s and b.bwd_s > a.bwd_s


def test_cp_rank_computes_its_share_and_keeps_its_tokens():
    one, two = predict(_plan({}, {}, seq_len=16384)), predict(_plan({"cp": 2}, {"cp": 2}, seq_len=16384))
    # Compute only (the costs' times), before the ring's passes: half of the whole sequence's.
    assert two.stages[0].compute_s == pytest.approx(one.stages[0].compute_s / 2)
    assert two.stages[0].activations_bytes < 0.55 * one.stages[0].activations_bytes
    assert two.tokens_per_s > 0


def test_plan_fields_round_trip_and_version():
    plan = _plan({"tp": 2, "cp": 2, "sp": True}, {"cp": 2})
    data = plan.to_dict()
    assert data["version"] == 8
    st = data["pipelines"][0]["stages"][0]
    assert (st["tp"], st["cp"], st["sequence_parallel"]) == (2, 2, True)
    assert "cp" not in data["pipelines"][0]["stages"][1] or data["pipelines"][0]["stages"][1]["cp"] == 2
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    plain = _plan({}, {})
    assert plain.to_dict()["version"] == 4 and "cp" not in plain.to_dict()["pipelines"][0]["stages"][0]


@pytest.mark.parametrize("first,second,seq,field", [
    ({"sp": True}, {}, 8192, "stages[0].sequence_parallel"),  # SP on TP 1
    ({"cp": 2}, {}, 8192, "stages[1].cp"),  # CP degrees differ within a pipeline
    ({"cp": 3}, {"cp": 3}, 8192, "stages[0].cp"),  # 8192 not in 6 equal chunks
])
def test_plan_validation_names_the_field(first, second, seq, field):
    with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]")):
        _plan(first, second, seq_len=seq)


def test_plan_refuses_cp_not_dividing_devices_and_tp_spanning_nodes():
    plan = _plan({"cp": 2}, {"cp": 2})
    st = plan.pipelines[0].stages[0]
    with pytest.raises(PlanError, match="does not divide"):
        replace(plan, pipelines=(replace(plan.pipelines[0], stages=(replace(st, devices=(*st.devices, 9)),
                                                                   plan.pipelines[0].stages[1])),)).validate()
    # CP-major: with tp 2 the devices [0, 4, 1, 5] put TP groups across nodes.
    bad = replace(st, devices=(0, 4, 1, 5), cp=2)
    with pytest.raises(PlanError, match="span several nodes"):
        replace(plan, pipelines=(replace(plan.pipelines[0], stages=(bad, replace(plan.pipelines[0].stages[1],
                                                                                  devices=(16, 17, 18, 19)))),
                                 )).validate()
