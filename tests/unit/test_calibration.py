"""Calibration beyond A100: every fitted bf16 number in the catalog names its cited measurement, the
fit reproduces the points it was fitted on and the held-out points within stated tolerances, kinds
without a published figure stay assumed, and a prediction reports each efficiency's source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hethub.predict.calibrate import fit_gemm_eff, gemm_tflops
from hethub.predict.cited import ATTENTION_POINTS, GEMM_POINTS
from hethub.predict.compute import calibration_of, efficiency_sources, kernel_params
from hethub.spec.kind import catalog

GEMM_KINDS = sorted({p.kind for p in GEMM_POINTS})
# Held-out rows: NVIDIA's within 5% (other shapes, CUDA versions and the table's first method); the
# MI300X row is ROCm 6.2 against the fit's ROCm 6.3 + TunableOp and measured 17% faster, which no
# shape term explains (a software difference): within 20%, and the bench prints it.
HELD_OUT_TOLERANCE = {"mi300x": 0.20}


def _model_tflops(kind_name: str, point) -> float:
    kind = catalog()[kind_name]
    params = kernel_params(kind, "bf16-mixed")[0]
    return gemm_tflops(replace(params, gemm_eff=kind.gemm_eff), m=point.m, n=point.n, k=point.k)


@pytest.mark.parametrize("name", sorted(catalog()))
def test_a_fitted_bf16_number_names_its_measurement_and_an_unmeasured_kind_stays_assumed(name):
    kind = catalog()[name]
    cited_gemm = {p.kind for p in GEMM_POINTS if p.fit}
    cited_attention = {a.kind for a in ATTENTION_POINTS}
    assert (kind.gemm_eff is not None) == (name in cited_gemm), name
    assert (kind.flash_eff is not None) == (name in cited_attention), name
    if kind.gemm_eff is not None:
        assert "MAMF" in kind.gemm_eff_source and "stas00/ml-engineering" in kind.gemm_eff_source, kind.gemm_eff_source
    if kind.flash_eff is not None:
        assert "arXiv:2307.08691" in kind.flash_eff_source, kind.flash_eff_source
    if kind.sm_count is not None:  # the op model: every number it uses says where it comes from
        for number, entry in efficiency_sources(kind, "bf16-mixed").items():
            assert entry["source"], (name, number)
            if getattr(kind, "gemm_eff" if number == "gemm_eff" else number, None) is None:
                assert entry["source"].startswith("assumed"), (name, number, entry)


@pytest.mark.parametrize("name", GEMM_KINDS)
def test_the_catalogs_gemm_efficiency_is_the_fit_of_its_cited_rows(name):
    kind = catalog()[name]
    params = kernel_params(kind, "bf16-mixed")[0]
    fit = fit_gemm_eff([(p.m, p.n, p.k, p.tflops) for p in GEMM_POINTS if p.kind == name and p.fit], params)
    assert kind.gemm_eff == pytest.approx(fit, abs=0.001)  # rounded to three digits in the catalog


@pytest.mark.parametrize("point", GEMM_POINTS, ids=lambda p: f"{p.kind}-{p.m}x{p.n}x{p.k}-{'fit' if p.fit else 'held'}")
def test_the_fitted_efficiency_reproduces_the_cited_gemm_rows(point):
    err = _model_tflops(point.kind, point) / point.tflops - 1
    tolerance = 0.005 if point.fit else HELD_OUT_TOLERANCE.get(point.kind, 0.05)
    assert abs(err) <= tolerance, f"{point.kind} {point.m}x{point.n}x{point.k}: {err:+.1%} ({point.source})"


def test_the_kernel_model_is_not_flat_over_shapes():
    # The fit must come from the shape terms, not only from one factor: a GEMM whose tiles fill a
    # fraction of one wave reaches far less than the MAMF shapes on the same kind.
    h100 = catalog()["h100-sxm"]
    params = replace(kernel_params(h100, "bf16-mixed")[0], gemm_eff=h100.gemm_eff)
    big = gemm_tflops(params, m=2048, n=2048, k=13312)
    small = gemm_tflops(params, m=256, n=256, k=256)
    assert small < 0.2 * big


@pytest.mark.parametrize("point", ATTENTION_POINTS, ids=lambda a: a.kind)
def test_the_attention_efficiency_is_the_cited_peak_over_the_bf16_peak(point):
    kind = catalog()[point.kind]
    assert kind.flash_eff == pytest.approx(point.tflops * 1e12 / kind.peak_flops, abs=0.001)
    params = kernel_params(kind, "bf16-mixed")[0]
    assert params.flash_eff == kind.flash_eff and params.flash_eff < params.gemm_eff


def test_a_prediction_reports_each_efficiency_with_its_source():
    h100 = calibration_of(catalog()["h100-sxm"], precision="bf16-mixed",
                          compute_source=kernel_params(catalog()["h100-sxm"], "bf16-mixed")[1])
    assert h100["status"] == "partly calibrated"
    numbers = h100["numbers"]
    assert numbers["gemm_eff"]["value"] == catalog()["h100-sxm"].gemm_eff
    assert "stas00/ml-engineering" in numbers["gemm_eff"]["source"]
    assert "arXiv:2307.08691" in numbers["flash_eff"]["source"]
    assert numbers["gemm_k_half"]["source"] == "assumed default"
    ascend = calibration_of(catalog()["ascend-910b"], precision="bf16-mixed",
                            compute_source="analytic, constant efficiency")
    assert ascend["status"].startswith("uncalibrated") and ascend["numbers"]["efficiency"]["value"] == 0.45
    assert calibration_of(catalog()["a100-40gb"], precision="bf16-mixed", compute_source="profile") == {
        "status": "measured profile"}


def test_a_cluster_file_override_is_not_credited_to_the_base_kinds_source():
    from hethub.spec.kind import parse_kind

    mine = parse_kind("my-h100", {"gemm_eff": 0.7}, where="cluster.toml: kinds.my-h100", base=catalog()["h100-sxm"])
    numbers = efficiency_sources(mine, "bf16-mixed")
    assert numbers["gemm_eff"] == {"value": 0.7, "source": "cluster file"}
    assert "arXiv:2307.08691" in numbers["flash_eff"]["source"]  # not overridden: still the cited figure
