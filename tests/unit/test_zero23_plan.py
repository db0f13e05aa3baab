"""ZeRO-2/3 in the pure core: the plan field, its checks, the memory model's parts and the sync's prices."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hethub.errors import PlanError
from hethub.layout import gathers_params
from hethub.plan import Pipeline, Plan, Stage, interleave
from hethub.predict.predictor import predict, with_shard_weights
from hethub.predict.sharding import rank_shards
from hethub.predict.sync import sync_groups
from hethub.predict.sync_overlap import exposed_sync_groups
from hethub.predict.zero23_bytes import zero23_rank_bytes
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def pipeline(devices: list[tuple[int, ...]], *, layers: int = 32) -> Pipeline:
    """Stages over ``devices`` (one tuple per stage, TP = its length) splitting ``layers`` evenly, 128
    micro-batches of 1 (ZeRO-2/3 need equal counts)."""
    n, kinds = len(devices), CLUSTER.devices
    per = layers // n
    return Pipeline(micro_batch_size=1, num_micro_batches=128, stages=tuple(
        Stage(kind=kinds[d[0]].kind, devices=d, layers=(i * per, (i + 1) * per), embedding=i == 0, head=i == n - 1)
        for i, d in enumerate(devices)))


CLUSTER = load_cluster(EXAMPLES / "a100-v100-32.toml")
A100 = [d.id for d in CLUSTER.devices_of_kind("a100-40gb")]
V100 = [d.id for d in CLUSTER.devices_of_kind("v100-16gb")]


def make(*pipes: Pipeline) -> Plan:
    return Plan(model=get_model("llama-3-8b"), cluster=CLUSTER, global_batch=sum(p.num_samples for p in pipes),
                seq_len=2048, pipelines=pipes).validate()


@pytest.fixture(scope="module")
def plan() -> Plan:
    """Two pipelines of different depths and kinds: four A100 stages; two TP-4 V100 stages."""
    return make(pipeline([(d,) for d in A100[:4]]), pipeline([tuple(V100[:4]), tuple(V100[4:8])]))


def sharded(plan: Plan, how: str) -> Plan:
    return with_shard_weights(replace(plan, optimizer_sharding=how).validate())


@pytest.mark.parametrize("how", ["zero2", "zero3"])
def test_plan_round_trips_at_version_9(plan: Plan, how: str) -> None:
    data = json.loads(sharded(plan, how).to_json())
    assert data["version"] == 9 and data["training"]["optimizer_sharding"] == how
    back = Plan.from_dict(data)
    assert back.optimizer_sharding == how and back.zero_stage == int(how[-1])
    assert back.shard_weights == sharded(plan, how).shard_weights
    data["training"]["optimizer_sharding"] = "zero1"
    data["version"] = 7  # older files load as before
    assert Plan.from_dict(data).zero_stage == 1


def test_unequal_micro_batch_counts_are_refused_naming_the_fix(plan: Plan) -> None:
    p0, p1 = plan.pipelines
    uneven = replace(plan, pipelines=(replace(p0, num_micro_batches=160), replace(p1, num_micro_batches=96)))
    with pytest.raises(PlanError, match=r"training\.optimizer_sharding") as err:
        replace(uneven, optimizer_sharding="zero2").validate()
    assert "96, 160 micro-batches" in str(err.value) and "same num_micro_batches" in str(err.value)
    replace(uneven, optimizer_sharding="zero1").validate()  # ZeRO-1 reduces once per step: any counts


def test_zero3_refuses_virtual_stages(plan: Plan) -> None:
    p0 = plan.pipelines[0]
    chunked = replace(plan, schedule="interleaved", pipelines=(interleave(p0, [[4, 4]] * 4), *plan.pipelines[1:]))
    with pytest.raises(PlanError, match="virtual stages"):
        replace(chunked, optimizer_sharding="zero3").validate()


def test_gathered_only_where_holders_share_a_position() -> None:
    assert gathers_params([(1, 4), (1, 4), (1, 4)])
    assert not gathers_params([(1, 4), (1, 3)])  # a different depth: another op order
    assert not gathers_params([(0, 2), (1, 2)])  # a tied embedding's first and last stage
    assert not gathers_params([(0, 2)])  # one holder: nothing to shard


def test_memory_shrinks_stage_by_stage(plan: Plan) -> None:
    # Equal shares: with proportional ones the full V100s own (nearly) nothing.
    z1 = with_shard_weights(replace(plan, optimizer_sharding="zero1", optimizer_shares="equal").validate())
    z2, z3 = (replace(z1, optimizer_sharding=h) for h in ("zero2", "zero3"))  # one split for all three
    owned = rank_shards(z1, z1.rank_shard_weights()).moment_elems
    assert all(x.grad_bytes == 4 * owned[r] for r, x in zero23_rank_bytes(z2, z1.rank_shard_weights()).items())
    for a, b, c in zip(*(predict(x).stages for x in (z1, z2, z3)), strict=True):
        assert b.grads_bytes < a.grads_bytes  # the fp32 shard, not the whole buffer
        assert b.grads_bytes == c.grads_bytes
        assert c.memory is not None and b.memory is not None
        # The pipelines differ in depth: no group is gathered, every parameter kept whole.
        assert c.weights_bytes == b.weights_bytes and c.memory.gathered_bytes == 0


def test_identical_replicas_gather_every_layer(plan: Plan) -> None:
    # Two pipelines of four A100 stages: every group's holders share their positions.
    two = make(pipeline([(d,) for d in A100[:4]]), pipeline([(d,) for d in A100[4:8]]))
    z2 = sharded(two, "zero2")
    z3 = replace(z2, optimizer_sharding="zero3")
    for b, c in zip(predict(z2).stages, predict(z3).stages, strict=True):
        assert c.memory is not None and c.memory.gathered_bytes > 0
        assert c.weights_bytes == 0 < b.weights_bytes  # every unit has two holders at one position
        assert c.memory.parts["gathered_weights"] == c.memory.gathered_bytes
    # The sync: ZeRO-3 gathers per use (2 x 128 passes of each group's bytes) instead of after the update.
    weights = z2.rank_shard_weights()
    g2, g3 = sync_groups(z2, shard_weights=weights), sync_groups(z3, shard_weights=weights)
    for a, b in zip(g2, g3, strict=True):
        if a.participants > 1:
            assert b.round_s == a.round_s > 0 and a.gather_s == 0
            assert b.gather_s == pytest.approx(2 * 128 * (a.time_s - a.round_s))
    # Rounds that outlast a backward show; ones that fit are hidden.
    stages = [(pi, si) for pi in range(2) for si in range(4)]
    fast = exposed_sync_groups(z2, g2, backward_s=dict.fromkeys(stages, 1e3))
    slow = exposed_sync_groups(z2, g2, backward_s=dict.fromkeys(stages, 0.0))
    assert fast[0].time_s == g2[0].time_s
    assert slow[0].time_s == pytest.approx(g2[0].time_s + 127 * g2[0].round_s)
