"""The predictor prices only the gradient reduction left after the last backward
(predict.sync_overlap.exposed_sync_groups): buckets ready through the backward in reverse layer order, run
back to back, the part after the backward's end counted."""

from __future__ import annotations

import pytest

from conftest import small_cluster, tiny_model
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import allreduce_time_s
from hethub.predict.predictor import predict
from hethub.predict.sync import sync_groups
from hethub.predict.sync_overlap import exposed_sync_groups
from hethub.spec.model import ModelSpec


def _two_replicas() -> Plan:
    model = tiny_model(layers=8)
    one = (Stage("fast", (0,), (0, 8), embedding=True, head=True),)
    two = (Stage("fast", (2,), (0, 8), embedding=True, head=True),)  # another node: the inter-node link
    return Plan(model=model, cluster=small_cluster(), global_batch=8, seq_len=32,
                pipelines=(Pipeline(2, 2, one), Pipeline(2, 2, two)), precision="fp32").validate()


def _elems(plan: Plan) -> int:
    (g,) = sync_groups(plan)
    return round(g.nbytes / ModelSpec.state_bytes_per_param(plan.precision)["grads"])


def test_one_bucket_is_all_exposed_and_a_long_backward_hides_all_but_the_last():
    plan = _two_replicas()
    (g,) = sync_groups(plan)
    stages = list(g.holders)
    # One bucket: ready only when the backward ends, so all of it is exposed.
    (one,) = exposed_sync_groups(plan, [g], backward_s=dict.fromkeys(stages, 1.0), bucket_elems=10**9)
    assert one.time_s == pytest.approx(g.time_s)
    # Eight buckets and a backward far longer than their reductions: only the last bucket (ready at
    # the backward's end) is left.
    n = 8
    bucket = -(-_elems(plan) // n)
    last = allreduce_time_s(nbytes=g.nbytes / n, participants=2, link=g.link)
    (hidden,) = exposed_sync_groups(plan, [g], backward_s=dict.fromkeys(stages, 10.0), bucket_elems=bucket)
    assert hidden.time_s == pytest.approx(last)
    assert hidden.time_s < g.time_s
    # No backward to hide behind: every bucket is exposed, each paying its own latency.
    (bare,) = exposed_sync_groups(plan, [g], backward_s=dict.fromkeys(stages, 0.0), bucket_elems=bucket)
    assert bare.time_s == pytest.approx(n * last) and bare.time_s > g.time_s


def test_a_short_backward_leaves_the_backlog():
    plan = _two_replicas()
    (g,) = sync_groups(plan)
    n = 4
    bucket = -(-_elems(plan) // n)
    d = allreduce_time_s(nbytes=g.nbytes / n, participants=2, link=g.link)
    # A backward of two bucket times: buckets are ready at -1.5d, -d, -0.5d and 0 (relative to its end)
    # but run back to back from the first, so the chain ends at 2.5d: that much is exposed.
    b = 2.0 * d
    (got,) = exposed_sync_groups(plan, [g], backward_s=dict.fromkeys(g.holders, b), bucket_elems=bucket)
    start = -b * (1 - 1 / n)  # the first bucket's ready time
    assert got.time_s == pytest.approx(start + n * d)


def test_predict_prices_the_exposed_part():
    plan = _two_replicas()
    pred = predict(plan)
    (g,) = sync_groups(plan)
    backward = {(s.pipeline, s.stage): s.bwd_s for s in pred.stages}
    (exposed,) = exposed_sync_groups(plan, [g], backward_s=backward)
    for sp in pred.stages:
        assert sp.sync_s == pytest.approx(exposed.time_s)
        assert sp.sync_s <= g.time_s
