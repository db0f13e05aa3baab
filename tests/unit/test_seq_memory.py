"""The memory model's sequence- and context-parallel terms against what the runtime's modules save,
to the byte (storage accounting of autograd's saved tensors, as ``test_profiler.py`` does for the
other recipes): SP in fp32 and bf16, flash and math attention, under each recomputation mode; CP 2
and 4, and TP 2 with SP inside CP 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.profiler.stage_memory import measure_stage_memory
from hethub.spec.cluster import load_cluster
from hethub.spec.model import PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def _plan(*, tp: int = 1, cp: int = 1, sp: bool = False, attention: str | None = None, recompute: str = "none",
          precision: str = "fp32", schedule: str = "1f1b") -> Plan:
    """Two stages of the tiny preset on the local CPU kinds (4 devices each): the first with the
    given TP, CP and SP, the second TP 1 with the same CP."""
    cluster = load_cluster(EXAMPLES / "local-cpu.toml")
    cluster = replace(cluster, groups=tuple(replace(g, devices_per_node=4) for g in cluster.groups))
    if precision != "fp32":
        kinds = {n: replace(k, precisions=(precision, "fp32")) for n, k in cluster.kinds.items()}
        cluster = replace(cluster, kinds=kinds)
    fast = [d.id for d in cluster.devices_of_kind("cpu-fast")]
    slow = [d.id for d in cluster.devices_of_kind("cpu-slow")]
    stages = (Stage("cpu-fast", tuple(fast[:tp * cp]), (0, 4), embedding=True, recompute=recompute, cp=cp,
                    sequence_parallel=sp),
              Stage("cpu-slow", tuple(slow[:cp]), (4, 6), head=True, recompute=recompute, cp=cp))
    settings = {k: {"attention": attention} for k in cluster.kind_names} if attention else {}
    return Plan(model=PRESETS["tiny"], cluster=cluster, global_batch=6, seq_len=32, pipelines=(Pipeline(2, 3, stages),),
                schedule=schedule, precision=precision, kind_settings=settings).validate()


def _check(plan: Plan, precision: str = "fp32") -> list[float]:
    out = []
    for sp in predict(plan).stages:
        got = measure_stage_memory(plan, pipeline=sp.pipeline, stage=sp.stage, precision=precision)
        assert sp.activations_bytes == got.activations_bytes, (sp.stage, sp.activations_bytes, got.activations_bytes)
        if precision == "fp32":  # replicated or sharded parameters as without SP/CP
            assert sp.weights_bytes == got.state.weights_bytes
        out.append(sp.activations_bytes)
    return out


SP_CASES = [("fp32", None, "none"), ("fp32", "math", "none"), ("bf16-mixed", None, "none"),
            ("fp32", None, "selective"), ("bf16-mixed", "math", "selective"), ("fp32", None, "full")]


@pytest.mark.parametrize("precision,attention,recompute", SP_CASES)
def test_sequence_parallel_memory_is_byte_exact(precision, attention, recompute):
    sp = _check(_plan(tp=2, sp=True, attention=attention, recompute=recompute, precision=precision), precision)
    plain = predict(_plan(tp=2, attention=attention, recompute=recompute, precision=precision)).stages[0]
    assert sp[0] < plain.activations_bytes  # the norms' inputs and the residual are split


@pytest.mark.parametrize("cp,tp,sp,precision,attention", [(2, 1, False, "fp32", None), (4, 1, False, "fp32", None),
                                                          (2, 1, False, "bf16-mixed", None),
                                                          (2, 1, False, "fp32", "math"), (2, 2, True, "fp32", None)])
def test_context_parallel_memory_is_byte_exact(cp, tp, sp, precision, attention):
    _check(_plan(tp=tp, cp=cp, sp=sp, precision=precision, attention=attention), precision)


def test_context_parallel_divides_activations_by_the_degree():
    """Per rank, CP 2 keeps half of CP 1's activations but for the attention's kernel terms: flash in
    bf16 keeps the same per-token tensors, so exactly half."""
    one, two = (predict(_plan(cp=cp, precision="bf16-mixed")).stages[0].activations_bytes for cp in (1, 2))
    assert two * 2 == one


def test_grid_members():
    plan = _plan(tp=2, cp=2, sp=True)
    st = plan.pipelines[0].stages[0]
    assert st.tp == 2 and st.tp_group(1) == st.devices[2:4] and st.cp_group(1) == (st.devices[1], st.devices[3])
