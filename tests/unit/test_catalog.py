"""The built-in catalog: every number carries its source (or says it is assumed), and every kind says
where it computes (torch device type), over which backend, and what must be installed for it."""

from __future__ import annotations

import re
import tomllib
from importlib import resources

import pytest

from hethub.errors import SpecError
from hethub.spec.kind import DEVICE_TYPE_OF_BACKEND, DEVICE_TYPES, catalog, parse_kind

TEXT = resources.files("hethub.spec").joinpath("catalog.toml").read_text(encoding="utf-8")
RAW = tomllib.loads(TEXT)["kinds"]
NUMBER_KEYS = ("mem_bytes", "peak_flops", "intra_node_bw_bytes_per_s", "intra_node_latency_s",
               "mem_bw_bytes_per_s", "efficiency")


def _tables() -> dict[str, list[str]]:
    """Each kind's lines as written in the file (comments included)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in TEXT.splitlines():
        m = re.match(r"\[kinds\.([\w.-]+)\]", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


@pytest.mark.parametrize("name", sorted(RAW))
def test_every_number_has_a_source_or_says_assumed(name: str) -> None:
    lines = _tables()[name]
    table = RAW[name]
    assert table.get("source", "").startswith("http"), f"{name}: no source URL"
    for key in NUMBER_KEYS:
        assert key in table, f"{name}: {key} missing"
        line = next(x for x in lines if x.startswith(f"{key} ="))
        comment = line.partition("#")[2].strip()
        # Either a named source or an explicit assumption / nominal placeholder, with a reason.
        assert len(comment) > 15, f"{name}.{key}: the number needs a comment with its source or 'assumed: why'"
        assert re.search(r"assumed|nominal|datasheet|spec page|whitepaper|product page|reported|launch|FlagPerf|"
                         r"TechPowerUp|mx-smi", comment, re.IGNORECASE), f"{name}.{key}: {comment!r}"


@pytest.mark.parametrize("name", sorted(RAW))
def test_every_kind_names_device_type_backend_and_package(name: str) -> None:
    table = RAW[name]
    for key in ("device_type", "backend", "torch_package"):
        assert key in table, f"{name}: {key} must be written in the catalog, not derived"
    kind = catalog()[name]
    assert kind.device_type in DEVICE_TYPES
    moves = DEVICE_TYPE_OF_BACKEND[kind.backend]
    assert moves in ("cpu", kind.device_type), f"{name}: backend {kind.backend} cannot serve {kind.device_type}"
    if kind.device_type != "cpu":
        assert kind.torch_package, f"{name}: say what to install for {kind.device_type}"


def test_the_six_vendors_of_the_hethub_setting_are_in_the_catalog() -> None:
    vendors = {k.vendor for k in catalog().values()}
    assert {"nvidia", "amd", "huawei", "iluvatar", "metax", "moore-threads"} <= vendors
    assert len([k for k in catalog().values() if k.vendor == "huawei"]) >= 2
    # Extensions that register a device are imported by the runtime; vendor torch builds are not.
    assert catalog()["mthreads-s4000"].torch_extension == "torch_musa"
    assert catalog()["ascend-910b4"].torch_extension == "torch_npu"
    assert catalog()["metax-c500"].torch_extension == ""


def test_device_type_must_match_the_backend() -> None:
    base = catalog()["a100-80gb"]
    with pytest.raises(SpecError, match=r"device_type.*'npu'.*backend 'nccl' moves 'cuda'"):
        parse_kind("odd", {"device_type": "npu"}, where="t", base=base)
    # Changing the backend without a device type derives the backend's device.
    assert parse_kind("m", {"backend": "mccl"}, where="t", base=base).device_type == "musa"
    # A gloo kind may be an accelerator emulated on the host.
    assert parse_kind("e", {"backend": "gloo", "device_type": "cpu"}, where="t", base=base).device_type == "cpu"


@pytest.mark.parametrize("name", ["v100-16gb", "titan-rtx", "rtx-2080"])
def test_pre_ampere_kinds_run_a_bf16_plan_in_fp16_with_loss_scaling(name: str) -> None:
    # No bf16 units before Ampere: a bf16-mixed plan would otherwise be predicted at the fp16 tensor
    # peak while torch emulates bf16 far slower.
    kind = catalog()[name]
    assert "bf16-mixed" not in kind.precisions
    assert kind.precision_for("bf16-mixed") == "fp16-mixed"
    assert catalog()["a100-40gb"].precision_for("bf16-mixed") == "bf16-mixed"
