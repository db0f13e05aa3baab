"""hethub installs beside any vendor's PyTorch in its range, and each rank checks its own PyTorch
against its kind at start-up (stubbed versions: no vendor stack is installed here)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO
from hethub.errors import RuntimeSetupError
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.stack_check import BASE_FEATURES, Feature, check_rank_stack, features_for
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import catalog
from hethub.spec.model import ModelSpec
from hethub.spec.stacks import Found, stack_of, stack_problems, stacks, torch_range

ADMITTED = ["2.13.0+cpu", "2.13.0", "2.6.0", "2.6.0+rocm6.2.4", "2.7.1+cu126", "2.6.0a0+ecf3bae40a.nv25.01",
            "2.9.0+corex.4.3.0", "2.8.0+mc3.1.0.1", "2.5.1+rocm6.2", "2.5.1", "2.5.0", "2.5.0a0+git32f585d"]
EXCLUDED = ["2.4.1", "2.4.0+cpu", "2.4.1+rocm6.1", "1.13.1+corex.3.3.0", "2.0.0+mc2.18.0.8", "3.0.0", "3.0.0rc1",
            "3.1.0+cpu"]


def _torch_requirement(extra: str) -> Requirement:
    """The extra's torch requirement as the package metadata states it (Requires-Dist is pyproject's
    optional-dependencies, verbatim; read from the source so a stale installed copy cannot mislead)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["optional-dependencies"][extra]]
    return next(r for r in reqs if r.name == "torch")


@pytest.mark.parametrize("extra", ["train", "dev"])
def test_the_torch_range_admits_vendor_builds_and_excludes_those_below_the_floor(extra):
    spec = _torch_requirement(extra).specifier
    for v in ADMITTED:
        assert spec.contains(Version(v)), f"{extra}: {v} should be admitted by {spec}"
    for v in EXCLUDED:
        assert not spec.contains(Version(v)), f"{extra}: {v} should be excluded by {spec}"
    # The start-up check's range is the package's: the same verdict on every version.
    rng = torch_range()
    assert str(spec) == f"<{rng.below},>={rng.min}" or set(str(spec).split(",")) == {f">={rng.min}", f"<{rng.below}"}
    for v in ADMITTED + EXCLUDED:
        assert rng.admits(v) == spec.contains(Version(v)), v


def test_our_own_setup_pins_the_exact_cpu_wheel():
    """make test / make demo install through constraints.txt, which pins the CPU wheel the venv has."""
    import torch

    pins = [line.strip() for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert "torch==2.13.0" in pins
    assert re.search(r"pip install -q -c constraints\.txt -e '\.\[dev\]'", (REPO / "Makefile").read_text())
    assert torch.__version__.split("+")[0] == "2.13.0"


def test_every_catalog_package_has_a_stack_entry_with_a_source():
    for name, kind in catalog().items():
        if kind.torch_package:
            stack = stack_of(kind)
            assert stack is not None, f"{name}: torch_package {kind.torch_package!r} has no torch_stacks.toml entry"
            assert stack.source and stack.install, name
    for stack in stacks().values():
        assert stack.build in ("", "cuda", "hip") and stack.match in ("", "major.minor", "major.minor.patch")


def test_matching_stacks_pass():
    kinds = catalog()
    assert not stack_problems(kinds["a100-80gb"], Found(torch="2.7.1+cu126", cuda="12.6"))
    assert not stack_problems(kinds["mi300x"], Found(torch="2.6.0+rocm6.2.4", hip="6.2.41133"))
    assert not stack_problems(kinds["ascend-910b"], Found(torch="2.6.0", extension="2.6.0.post5"))
    assert not stack_problems(kinds["mthreads-s4000"], Found(torch="2.11.0", extension="2.11.0.post1"))
    assert not stack_problems(kinds["iluvatar-bi-v150"], Found(torch="2.6.0+corex.4.3.0", cuda="10.2"))
    assert not stack_problems(kinds["metax-c500"], Found(torch="2.6.0+mc3.0.0.1"))
    assert not stack_problems(kinds["cpu"], Found(torch="2.13.0+cpu"))
    # An accelerator kind emulated on the CPU needs no vendor stack, only the torch range.
    assert not stack_problems(kinds["ascend-910b"], Found(torch="2.13.0+cpu"), on_device=False)


def _plan(kind: str) -> Plan:
    spec = ModelSpec(name="t", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                     vocab_size=256, max_seq_len=32)
    cluster = Cluster(name="one", kinds={kind: catalog()[kind]}, groups=(NodeGroup(kind, 1, 2),),
                      inter_node=Link(25e9, 1e-5), cross_kind=Link(10e9, 5e-5))
    stage = Stage(kind, (0,), (0, 2), embedding=True, head=True)
    return Plan(model=spec, cluster=cluster, global_batch=2, seq_len=16, pipelines=(Pipeline(1, 2, (stage,)),),
                precision="fp32").validate()


ALL_THERE = tuple(Feature(f.name, f.since, lambda: True) for f in BASE_FEATURES)


@pytest.mark.parametrize(("kind", "found", "expect"), [
    # Ascend: torch_npu of another release than torch.
    ("ascend-910b", Found(torch="2.6.0", extension="2.5.1"),
     [r"kind 'ascend-910b'", r"found torch 2\.6\.0, torch_npu 2\.5\.1", r"torch_npu 2\.5\.1 does not match torch "
      r"2\.6\.0 \(major\.minor\.patch must be equal: 2\.6\.0\)", r"install torch_npu of the same version"]),
    # Ascend: the extension missing altogether.
    ("ascend-910b", Found(torch="2.6.0"),
     [r"torch_npu not installed", r"the package 'torch_npu' is not installed beside torch"]),
    # Moore Threads: torch_musa for another minor.
    ("mthreads-s4000", Found(torch="2.11.0", extension="2.9.1"),
     [r"kind 'mthreads-s4000'", r"torch_musa 2\.9\.1 does not match torch 2\.11\.0 \(major\.minor must be equal: "
      r"2\.11\)"]),
    # AMD: a CUDA build where ROCm is needed.
    ("mi250x", Found(torch="2.7.1+cu126", cuda="12.6"),
     [r"kind 'mi250x'", r"found torch 2\.7\.1\+cu126 \(CUDA 12\.6\)", r"is a CUDA build, but the kind needs torch "
      r"\(ROCm build\); install a ROCm build"]),
    # NVIDIA: the CPU wheel on a GPU node.
    ("a100-80gb", Found(torch="2.13.0+cpu"), [r"is a CPU-only build, but the kind needs torch \(CUDA build\)"]),
    # A ROCm build below the floor.
    ("mi300x", Found(torch="2.4.1+rocm6.1", hip="6.1"),
     [r"found torch 2\.4\.1\+rocm6\.1 \(ROCm/HIP 6\.1\)", r"outside the versions hethub's runtime supports "
      r"\(>= 2\.5\.0a0, < 3\); install torch >= 2\.5\.0, < 3"]),
    # Iluvatar: a stock CUDA torch instead of the CoreX build.
    ("iluvatar-bi-v150", Found(torch="2.6.0+cu124", cuda="12.4"), [r"is not torch \(Iluvatar CoreX build.*'corex'"]),
])
def test_each_mismatch_is_one_message_naming_kind_versions_and_fix(kind, found, expect):
    with pytest.raises(RuntimeSetupError) as err:
        check_rank_stack(_plan(kind), 0, found=found, features=ALL_THERE)
    text = str(err.value)
    assert err.value.exit_code == 6  # docs/cli.md: a rank's device or its package is missing or mismatched
    assert text.startswith(f"rank 0 (kind '{kind}') cannot run on this node's PyTorch") and "Fix:" in text
    assert "docs/install.md" in text
    for pattern in expect:
        assert re.search(pattern, text), (pattern, text)


def test_a_missing_api_is_named_with_the_release_that_has_it():
    gqa = next(f for f in BASE_FEATURES if "enable_gqa" in f.name)
    gone = (*(f for f in ALL_THERE if f.name != gqa.name), Feature(gqa.name, gqa.since, lambda: False))
    with pytest.raises(RuntimeSetupError, match=r"lacks torch\.nn\.functional\.scaled_dot_product_attention"
                                                r"\(enable_gqa=\.\.\.\) \(torch 2\.5 on\)"):
        check_rank_stack(_plan("cpu"), 0, found=Found(torch="2.5.0a0+git32f585d"), features=gone)


def test_this_torch_passes_for_cpu_kinds_and_the_plans_attention_is_checked():
    check_rank_stack(_plan("cpu"), 0)  # the real torch of this venv, every real feature probe
    plan = _plan("cpu")
    names = [f.name for f in features_for(plan, "cpu")]
    assert any(plan.attention_of("cpu") in n and "sdpa_kernel" in n for n in names)
    assert all(f.present() for f in features_for(plan, "cpu"))


def test_apis_newer_than_the_floor_are_not_demanded_at_any_precision():
    """torch 2.5 has neither the gradient-clipping pair (2.6) nor the fused RMSNorm kernel (mid-2025):
    the runtime falls back for each (runtime/grad_clip.py, runtime/norms.py), so no plan demands them."""
    for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        names = " ".join(f.name for f in features_for(replace(_plan("a100-80gb"), precision=precision), "a100-80gb"))
        assert "get_total_norm" not in names and "clip_grads_with_norm_" not in names
        assert "_fused_rms_norm" not in names
    assert all(f.since in ("torch 2.3 on", "torch 2.4 on", "torch 2.5 on") for f in BASE_FEATURES)
