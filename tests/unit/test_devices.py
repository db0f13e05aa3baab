"""The runtime's device map: each kind on its device type, its extension imported by name, and a clear
stop at start-up when the extension or device is missing (no accelerator needed for any of this)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hethub.errors import RuntimeSetupError
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime import train
from hethub.runtime.devices import device_types_of_kinds, place_rank, plan_placement, world_backend
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import catalog
from hethub.spec.model import ModelSpec
from hethub.train import rank_plan

SPEC = ModelSpec(name="t4", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=256, max_seq_len=32)


def _plan(kind_a: str, kind_b: str) -> Plan:
    kinds = {k: catalog()[k] for k in (kind_a, kind_b)}
    cluster = Cluster(name="pair", kinds=kinds, groups=(NodeGroup(kind_a, 1, 2), NodeGroup(kind_b, 1, 2)),
                      inter_node=Link(25e9, 1e-5), cross_kind=Link(10e9, 5e-5))
    stages = (Stage(kind_a, (0,), (0, 2), embedding=True), Stage(kind_b, (3,), (2, 4), head=True))
    return Plan(model=SPEC, cluster=cluster, global_batch=4, seq_len=16, pipelines=(Pipeline(1, 4, stages),),
                precision="fp32").validate()


def test_cpu_kind_runs_on_the_cpu() -> None:
    assert place_rank(catalog()["cpu"], rank=0, local_index=5).device == torch.device("cpu")


@pytest.mark.skipif(importlib.util.find_spec("torch_musa") is not None, reason="torch_musa is installed here")
def test_absent_extension_stops_naming_rank_kind_and_package() -> None:
    with pytest.raises(RuntimeSetupError) as err:
        place_rank(catalog()["mthreads-s4000"], rank=3, local_index=1)
    msg = str(err.value)
    assert "rank 3" in msg and "'mthreads-s4000'" in msg and "'torch_musa'" in msg and "Fix: install torch_musa" in msg


def test_an_installed_extension_registers_the_device_without_code_changes(monkeypatch) -> None:
    """What torch_npu / torch_musa do on import: make torch.<type> answer. Here a stand-in extension
    does that for the 'cuda' type (the only accelerator type torch.device accepts in a CPU build)."""
    imported = []

    def importer(name: str):
        imported.append(name)
        monkeypatch.setattr(torch, "cuda", SimpleNamespace(is_available=lambda: True, device_count=lambda: 8))
        return SimpleNamespace()

    kind = replace(catalog()["a100-80gb"], name="vendor-x", torch_package="vendor_x_ext")
    got = place_rank(kind, rank=5, local_index=3, importer=importer, available=lambda: ("gloo", "nccl"))
    assert imported == ["vendor_x_ext"] and got.device == torch.device("cuda", 3) and got.kind == "vendor-x"
    with pytest.raises(RuntimeSetupError, match=r"rank 5 \(kind 'vendor-x'\) needs cuda:9.*shows 8"):
        place_rank(kind, rank=5, local_index=9, importer=importer)
    # The device is there but its collective library is not (a torch build without NCCL).
    with pytest.raises(RuntimeSetupError, match=r"rank 5 \(kind 'vendor-x'\) needs the collective backend 'nccl'.*"
                       r"has gloo\. Fix: install a CUDA build"):
        place_rank(kind, rank=5, local_index=3, importer=importer, available=lambda: ("gloo",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_a_vendor_torch_build_that_is_absent_is_named() -> None:
    with pytest.raises(RuntimeSetupError, match=r"rank 0 \(kind 'metax-c500'\).*'cuda'.*MetaX MACA build"):
        place_rank(catalog()["metax-c500"], rank=0, local_index=0)


def test_plan_placement_takes_the_index_from_the_node_layout(monkeypatch) -> None:
    plan = _plan("cpu", "a100-80gb")  # ranks: device 0 (cpu), device 3 (a100, second of its node)
    monkeypatch.setattr(torch, "cuda", SimpleNamespace(is_available=lambda: True, device_count=lambda: 2))
    assert plan_placement(plan, 0).device == torch.device("cpu")
    monkeypatch.setattr("hethub.runtime.devices.available_backends", lambda: ("gloo", "nccl"))
    assert plan_placement(plan, 1).device == torch.device("cuda", 1)
    assert device_types_of_kinds(plan) == {"a100-80gb": "cuda", "cpu": "cpu"}
    assert world_backend(plan) == "gloo"
    assert world_backend(_plan("a100-80gb", "v100-16gb")) == "nccl"  # one vendor's library serves both
    assert world_backend(_plan("a100-80gb", "mi300x")) == "gloo"  # NCCL and RCCL: bridged over gloo


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_training_start_up_stops_before_any_process_group(tmp_path, monkeypatch) -> None:
    path = tmp_path / "plan.json"
    _plan("cpu", "ascend-910b4").save(path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    # No MASTER_ADDR: reaching init_process_group would fail differently (or hang).
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeSetupError) as err:
        train.run(train.parse_args(["--plan", str(path), "--steps", "1"]), plan_of=rank_plan)
    msg = str(err.value)
    assert "rank 1 (kind 'ascend-910b4')" in msg and "'torch_npu'" in msg and "Fix:" in msg
    assert not torch.distributed.is_initialized()
