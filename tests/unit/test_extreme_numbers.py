"""Extreme but valid numbers: the planner keeps exact integer shares; out-of-range numbers are refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from hethub.errors import SpecError
from hethub.search.combine import Group, allocate
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


@dataclass(frozen=True)
class Affine:
    base_s: float
    per_mb_s: float

    def time_s(self, m: int) -> float:
        return self.base_s + self.per_mb_s * m


SECONDS = st.floats(min_value=1e-15, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(pipes=st.lists(st.tuples(SECONDS, SECONDS, st.integers(1, 8)), min_size=1, max_size=5),
       total=st.integers(1, 5000))
def test_allocation_holds_exactly_the_global_batch(pipes, total):
    groups = [Group(Affine(a, b), c) for a, b, c in pipes]
    got = allocate(groups, total)
    assert got is not None
    counts, makespan = got
    assert sum(map(sum, counts)) == total
    assert all(m >= 1 for cs in counts for m in cs)
    assert all(len(cs) <= g.count for cs, g in zip(counts, groups, strict=True))
    assert makespan == max(g.pipe.time_s(m) for g, cs in zip(groups, counts, strict=True) for m in cs)


def _cluster(tmp_path, fast: str, slow: str, *, nodes: int = 4, net: str = "12.5e9"):
    path = tmp_path / "c.toml"
    path.write_text(f'name = "x"\n[kinds.fast]\nbase = "a100-40gb"\npeak_flops = {fast}\n'
                    f'[kinds.slow]\nbase = "v100-16gb"\npeak_flops = {slow}\n'
                    f'[[group]]\nkind = "fast"\nnodes = {nodes}\ndevices_per_node = 4\n'
                    f'[[group]]\nkind = "slow"\nnodes = {nodes}\ndevices_per_node = 4\n'
                    f"[network]\ninter_node_bw_bytes_per_s = {net}\n")
    return load_cluster(path)


@pytest.mark.parametrize("fast,slow,batch", [("1e17", "1e8", 7), ("1e16", "1e14", 512), ("1e8", "1e17", 1000)])
def test_planner_on_extreme_speeds_gives_a_consistent_plan(tmp_path, fast, slow, batch):
    cluster = _cluster(tmp_path, fast, slow, net="1e6")
    r = make_plan(cluster=cluster, model=get_model("llama-3-8b"),
                  config=PlannerConfig(global_batch=batch, seq_len=2048))
    r.plan.validate()
    assert sum(p.num_samples for p in r.plan.pipelines) == batch
    assert r.prediction.tokens_per_s > 0 and r.prediction.step_time_s > 0


@pytest.mark.parametrize("field,value", [("peak_flops", "1e30"), ("peak_flops", "1e3"), ("mem_bytes", "1e20"),
                                         ("mem_bytes", "1000"), ("intra_node_bw_bytes_per_s", "1e20"),
                                         ("intra_node_latency_s", "5"), ("mem_bw_bytes_per_s", "1e3")])
def test_numbers_outside_physical_ranges_are_refused(tmp_path, field, value):
    path = tmp_path / "c.toml"
    path.write_text(f'name = "x"\n[kinds.k]\nbase = "a100-40gb"\n{field} = {value}\n'
                    '[[group]]\nkind = "k"\nnodes = 1\ndevices_per_node = 4\n')
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert f"'{field}'" in str(err.value) and "physical range" in str(err.value) and "Fix:" in str(err.value)


def test_ten_million_devices_are_refused_at_once(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "x"\n[[group]]\nkind = "a100-40gb"\nnodes = 1250000\ndevices_per_node = 8\n')
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert "10,000,000 devices" in str(err.value) and "'nodes'" in str(err.value)


def test_examples_are_inside_the_ranges():
    for path in EXAMPLES.glob("*.toml"):
        load_cluster(path)
