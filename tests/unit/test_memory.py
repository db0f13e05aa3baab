"""Memory model: named parts that add up to the peak, training state per precision, TP splits,
activations in flight and per attention implementation, recomputation, headroom."""

import json

import pytest

from hethub.cli import main
from hethub.errors import MemoryFitError
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.fit import check_memory_fit
from hethub.predict.memory import (
    PARTS,
    stage_memory,
    stage_params,
    state_bytes_per_param,
)
from hethub.predict.memory.activations import scores_bytes_per_token
from hethub.predict.predictor import predict
from hethub.search.config import PlannerConfig
from hethub.search.split import CostBook, Job
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import catalog
from hethub.spec.model import PRESETS

M = PRESETS["llama-2-7b"]
OPT = PRESETS["opt-350m"]


def test_state_bytes_per_precision():
    assert sum(state_bytes_per_param("fp32").values()) == 16  # fp32 Adam: 4 + 4 + 8
    # bf16 compute copy + fp32 master + fp32 gradients + two fp32 moments.
    assert state_bytes_per_param("bf16-mixed") == {"weights": 2, "master_weights": 4, "grads": 4, "optimizer": 8}
    with pytest.raises(ValueError, match="precision"):
        state_bytes_per_param("fp8")


def test_state_bytes_follow_params():
    mem = stage_memory(M, layers=4, embedding=False, head=False, tp=1, mbs=1, seq_len=1024, recompute=False,
                       precision="bf16-mixed", in_flight=1)
    params = 4 * M.layer_params
    assert (mem.weights_bytes, mem.master_weights_bytes) == (2 * params, 4 * params)
    assert (mem.grads_bytes, mem.optimizer_bytes) == (4 * params, 8 * params)


def test_whole_model_on_one_stage_counts_every_parameter():
    # An untied model on one device holds exactly num_params.
    n = stage_params(M, layers=M.num_layers, embedding=True, head=True, tp=1)
    assert n == M.num_params


def test_tp_splits_matmuls_and_vocab_but_not_norms():
    h = M.hidden_size
    one = stage_params(M, layers=1, embedding=False, head=False, tp=1)
    four = stage_params(M, layers=1, embedding=False, head=False, tp=4)
    norms = M.layer_params - M.layer_matmul_params
    assert four == pytest.approx(M.layer_matmul_params / 4 + norms)
    assert one / four == pytest.approx(4, rel=0.01)
    emb = stage_params(M, layers=0, embedding=True, head=False, tp=2)
    assert emb == M.vocab_size * h / 2
    head = stage_params(M, layers=0, embedding=False, head=True, tp=2)
    assert head == M.vocab_size * h / 2 + M.final_norm_params


def test_activations_scale_with_in_flight():
    kw = dict(layers=8, embedding=False, head=False, tp=1, mbs=1, seq_len=2048, recompute=False,
              precision="bf16-mixed")
    one = stage_memory(M, in_flight=1, **kw).activations_bytes
    four = stage_memory(M, in_flight=4, **kw).activations_bytes
    assert four == pytest.approx(4 * one)


def test_recompute_reduces_activations_a_lot():
    kw = dict(layers=16, embedding=False, head=False, tp=1, mbs=2, seq_len=4096, precision="bf16-mixed",
              in_flight=4)
    full = stage_memory(M, recompute=False, **kw)
    recomputed = stage_memory(M, recompute=True, **kw)
    assert recomputed.activations_bytes < full.activations_bytes / 5
    # ...but the recomputed layer is held transiently, with its gradients.
    assert recomputed.fb_temporaries_bytes == pytest.approx(2 * full.fb_temporaries_bytes)
    assert recomputed.weights_bytes == full.weights_bytes


def test_tp_reduces_activations_but_not_the_replicated_part():
    kw = dict(layers=4, embedding=False, head=False, mbs=1, seq_len=2048, recompute=False, precision="bf16-mixed",
              in_flight=1)
    a1 = stage_memory(M, tp=1, **kw).activations_bytes
    a8 = stage_memory(M, tp=8, **kw).activations_bytes
    assert a1 / 8 < a8 < a1


def test_head_keeps_the_fp32_log_softmax_and_its_logits_pass_through():
    kw = dict(layers=1, embedding=False, tp=1, mbs=1, seq_len=2048, recompute=False, precision="bf16-mixed",
              in_flight=1)
    with_head, without = stage_memory(M, head=True, **kw), stage_memory(M, head=False, **kw)
    # The fp32 log-softmax (4 bytes per vocab entry per token) is kept for backward...
    assert with_head.activations_bytes - without.activations_bytes >= 2048 * M.vocab_size * 4
    # ...and backward briefly holds two fp32 logit gradients plus the bf16 one.
    assert with_head.fb_temporaries_bytes == pytest.approx(2048 * M.vocab_size * (4 + 4 + 2))


@pytest.mark.parametrize("kind", ["a100-40gb", "v100-16gb", "cpu"])
def test_parts_add_up_to_the_peak(kind):
    k = catalog()[kind]
    mem = stage_memory(OPT, layers=6, embedding=True, head=False, tp=2, mbs=2, seq_len=2048, recompute=False,
                       precision="fp32", in_flight=3, kind=k, synced=True, communicators=4, attention=k.attention)
    assert set(mem.parts) == set(PARTS)
    assert sum(mem.parts.values()) == pytest.approx(mem.total_bytes)
    assert mem.total_bytes == pytest.approx(mem.reserved_bytes + k.context_bytes + 4 * k.comm_buffer_bytes)
    assert mem.parts["fragmentation"] == pytest.approx(mem.allocated_bytes * k.fragmentation)


def test_the_binding_moment_sets_the_transient_part():
    # A thin stage with a small micro-batch peaks in the optimizer step (foreach AdamW's scratch) or in
    # the gradient sync (full-size buckets of holders with another TP degree), not in forward/backward.
    k = catalog()["a100-80gb"]
    kw = dict(layers=2, embedding=False, head=False, tp=1, mbs=1, seq_len=16, recompute=True, precision="fp32",
              in_flight=1, kind=k)
    alone = stage_memory(M, **kw)
    assert alone.peak_phase == "optimizer_step" and alone.parts["activations"] == 0
    synced = stage_memory(M, synced=True, mixed_sync=True, **{**kw, "tp": 2})
    assert synced.peak_phase == "grad_sync"
    assert synced.parts["grad_sync_buffer"] == pytest.approx(2 * synced.grads_bytes)  # full size, TP 2
    # Holders of the same TP degree reduce in place in the gradient buffer: no transient.
    assert stage_memory(M, synced=True, **{**kw, "tp": 2}).grad_sync_buffer_bytes == 0


def test_math_attention_keeps_the_scores():
    kw = dict(layers=4, embedding=False, head=False, tp=2, mbs=2, seq_len=1024, recompute=False,
              precision="fp32", in_flight=3)
    flash = stage_memory(OPT, attention="flash", **kw).activations_bytes
    math = stage_memory(OPT, attention="math", **kw).activations_bytes
    tokens = 3 * 2 * 1024
    scores = 4 * tokens * scores_bytes_per_token(OPT, tp=2, seq_len=1024)
    assert scores == 4 * 3 * 2 * (16 // 2) * 1024 * 1024 * 4  # layers x in flight x mbs x heads/t x s x s x 4 B
    lse = 4 * tokens * (16 // 2) * 4  # the fp32 log-sum-exp flash keeps instead
    assert math - flash == pytest.approx(scores - lse)


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_selective_recomputation_sits_between_none_and_full(attention):
    # Llama-3-8B has GQA (8 KV heads of 32): the selective stage keeps K and V before their repeat.
    m = PRESETS["llama-3-8b"]
    kw = dict(layers=8, embedding=False, head=False, tp=2, mbs=2, seq_len=4096, precision="bf16-mixed",
              in_flight=3, attention=attention)
    none, sel, full = (stage_memory(m, recompute=rc, **kw) for rc in ("none", "selective", "full"))
    assert none.activations_bytes > sel.activations_bytes > full.activations_bytes
    # What selective drops per token and layer: what the kernel saves beyond Q, K, V and the output.
    # Flash (mixed precision: K and V at their own width, native GQA): the fp32 log-sum-exp. Math:
    # the fp32 s x s softmax output and the fp32 Q, K, V it computes with (K, V at full width),
    # instead of the bf16 Q, K, V the projections made.
    tokens = 3 * 2 * 4096
    heads, h, kv = m.num_heads // 2, m.hidden_size // 2, m.kv_dim // 2
    if attention == "math":
        dropped = scores_bytes_per_token(m, tp=2, seq_len=4096) + 3 * h * 4 - (h + 2 * kv) * 2
    else:
        dropped = heads * 4
    assert none.activations_bytes - sel.activations_bytes == pytest.approx(8 * tokens * dropped)
    # Booleans from plans before format 3 still mean none / full.
    assert stage_memory(m, recompute=True, **kw) == full and stage_memory(m, recompute=False, **kw) == none
    # The re-run core's saved tensors are held on top of one layer's gradients in backward.
    assert none.fb_temporaries_bytes < sel.fb_temporaries_bytes < full.fb_temporaries_bytes


def _catalog_cluster(*kinds: str) -> Cluster:
    return Cluster(name="c", kinds={k: catalog()[k] for k in kinds},
                   groups=tuple(NodeGroup(k, 1, 4) for k in kinds), inter_node=Link(12.5e9, 1e-5),
                   cross_kind=Link(12.5e9, 1e-5))


def _one_kind_plan(cluster: Cluster, kind: str, *, mbs: int = 1, **kw) -> Plan:
    base = 0 if kind == cluster.kind_names[0] else 4
    stages = (Stage(kind, (base,), (0, 12), embedding=True), Stage(kind, (base + 1,), (12, 24), head=True))
    return Plan(model=OPT, cluster=cluster, global_batch=8 * mbs, seq_len=2048, precision="fp32",
                pipelines=(Pipeline(mbs, 8, stages),), **kw).validate()


def test_pre_ampere_math_attention_predicts_more_activations_by_the_scores():
    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    on_a100 = predict(_one_kind_plan(cluster, "a100-40gb"))
    on_v100 = predict(_one_kind_plan(cluster, "v100-16gb"))
    assert [s.attention for s in on_a100.stages] == ["flash", "flash"]
    assert [s.attention for s in on_v100.stages] == ["math", "math"]
    for a, v in zip(on_a100.stages, on_v100.stages, strict=True):
        layers = a.layers[1] - a.layers[0]
        scores = a.in_flight * layers * 2048 * scores_bytes_per_token(OPT, tp=1, seq_len=2048)
        lse = a.in_flight * layers * 2048 * OPT.num_heads * 4
        assert v.memory.activations_bytes - a.memory.activations_bytes == pytest.approx(scores - lse)
    # A per-kind override in the plan wins over the catalog default.
    flash_v100 = predict(_one_kind_plan(cluster, "v100-16gb", kind_settings={"v100-16gb": {"attention": "flash"}}))
    assert flash_v100.stages[0].memory.activations_bytes == on_a100.stages[0].memory.activations_bytes


def test_predict_json_parts_add_up_to_each_stages_peak(tmp_path, capsys):
    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    path = tmp_path / "plan.json"
    _one_kind_plan(cluster, "v100-16gb").save(path)
    assert main(["predict", "--plan", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for st in out["stages"]:
        mem = st["memory"]
        assert sum(mem["parts"].values()) == pytest.approx(mem["peak_bytes"])
        assert mem["peak_bytes"] == pytest.approx(st["peak_mem_bytes"])
        assert mem["attention"] == "math" and mem["precision"] == "fp32"
        assert mem["parts"]["framework_context"] > 0 and mem["parts"]["comm_buffers"] > 0


def test_refuses_a_plan_over_memory_minus_headroom_naming_the_largest_part():
    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    plan = _one_kind_plan(cluster, "v100-16gb", mbs=2)  # math attention at s=2048: ~18 GiB on stage 0
    pred = predict(plan)
    assert not pred.fits_memory
    with pytest.raises(MemoryFitError, match=r"stages\[0\] on v100-16gb.*activations .* exceeds .*10% headroom"
                                             r".*\"recompute\": \"selective\" or \"full\" on it"):
        check_memory_fit(plan, pred)
    assert any("will run out of memory" in w for w in pred.warnings)


def test_headroom_decides_what_fits_and_predict_warns_inside_it():
    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    plan = _one_kind_plan(cluster, "a100-40gb")
    peak = max(s.peak_mem_bytes for s in predict(plan).stages)
    room = 1 - peak / catalog()["a100-40gb"].mem_bytes  # the headroom this plan leaves
    assert predict(plan, mem_headroom=room * 0.9).fits_memory
    tight = predict(plan, mem_headroom=room * 1.1)
    assert not tight.fits_memory
    assert any("within the" in w and "headroom" in w for w in tight.warnings)
    # The planner's stage model uses the same budget: more headroom, fewer layers fit.
    job = dict(model=OPT, seq_len=2048, precision="fp32", schedule="1f1b")
    loose = CostBook(Job(**job, mem_headroom=0.0), cluster).stage("v100-16gb", tp=1, mbs=1, recompute=True)
    strict = CostBook(Job(**job, mem_headroom=0.6), cluster).stage("v100-16gb", tp=1, mbs=1, recompute=True)
    n_loose = loose.max_layers(emb=True, head=False, in_flight=4, limit=24)
    n_strict = strict.max_layers(emb=True, head=False, in_flight=4, limit=24)
    assert 0 <= n_strict < n_loose
    assert strict.memory_bytes(n_strict + 1, emb=True, head=False, in_flight=4) > strict.capacity_bytes
    with pytest.raises(Exception, match="mem_headroom"):
        PlannerConfig(global_batch=8, seq_len=2048, mem_headroom=1.5)


def test_report_and_cli_show_the_breakdown_and_warn(tmp_path, capsys):
    from hethub.report.summary import summary_markdown

    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    plan = _one_kind_plan(cluster, "v100-16gb")
    pred = predict(plan)
    md = summary_markdown(plan=plan, prediction=pred, measured=None)
    assert "## Memory per device" in md and "fp32 / math" in md
    assert f"{pred.stages[0].peak_mem_bytes / 1024**3:.2f} / " in md
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["predict", "--plan", str(path), "--mem-headroom", "0.01"]) == 0
    assert "within the" not in capsys.readouterr().err  # 14.65 GiB fits 14.90 GiB less 1%
    assert main(["predict", "--plan", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "within the 10% headroom" in captured.err
    assert json.loads(captured.out)["warnings"]


def test_a_sailor_plan_records_what_sailors_runs_used():
    from hethub.interop.sailor import import_sailor_plan

    cluster = _catalog_cluster("a100-40gb", "v100-16gb")
    data = {"pipeline_list": [{"num_stages": 2, "layers_per_stage": [list(range(0, 13)), list(range(13, 26))],
                               "tmp_per_stage": [[[[["A100-40", 1, "z"]], 1]], [[[["V100-16", 1, "z"]], 1]]],
                               "dp": [1, 1]}], "mbs": 1, "gbs": 4}
    plan = import_sailor_plan(data, cluster=cluster, model=OPT, seq_len=2048)
    assert plan.precision == "fp32"
    assert {plan.attention_of(k) for k in ("a100-40gb", "v100-16gb")} == {"math"}
    again = Plan.from_dict(json.loads(plan.to_json()))  # per-kind settings survive the file (format v2)
    assert again.kind_settings == plan.kind_settings and again.to_dict()["version"] >= 2
    assert all(s.attention == "math" and s.precision == "fp32" for s in predict(again).stages)


def test_grad_sync_buffer_is_the_full_size_of_the_groups_mixing_tp_degrees():
    from conftest import small_cluster, tiny_model
    from hethub.predict.memory import runtime_vocab_parallel

    model = tiny_model(layers=8)
    cluster = small_cluster(fast=4, slow=4)
    # Replica 0: one TP-2 stage; replica 1: two TP-1 stages. Every group mixes TP degrees.
    whole = Pipeline(2, 2, (Stage("fast", (0, 1), (0, 8), embedding=True, head=True),))
    split = Pipeline(2, 2, (Stage("slow", (4,), (0, 5), embedding=True), Stage("slow", (5,), (5, 8), head=True)))
    plan = Plan(model=model, cluster=cluster, global_batch=8, seq_len=32, pipelines=(whole, split),
                precision="fp32").validate()
    stages = {(s.pipeline, s.stage): s.memory for s in predict(plan).stages}

    def n(layers: int, emb: bool = False, head: bool = False, tp: int = 1) -> float:
        return stage_params(model, layers=layers, embedding=emb, head=head, tp=tp,
                            vocab_parallel=runtime_vocab_parallel(model, tp))

    # Both groups of the TP-2 stage are built at full size (x2) and in flight together.
    assert stages[(0, 0)].grad_sync_buffer_bytes == 4 * 2 * n(8, emb=True, head=True, tp=2)
    assert stages[(1, 0)].grad_sync_buffer_bytes == 4 * n(5, emb=True)
    assert stages[(1, 1)].grad_sync_buffer_bytes == 4 * n(3, head=True)
    # Same TP degree everywhere: the buckets are reduced in place in the gradient buffer.
    same = Plan(model=model, cluster=cluster, global_batch=8, seq_len=32,
                pipelines=(Pipeline(2, 2, (Stage("fast", (0,), (0, 8), embedding=True, head=True),)), split),
                precision="fp32").validate()
    assert all(s.memory.grad_sync_buffer_bytes == 0 for s in predict(same).stages)
