"""A cheap proxy of bench/compute_model.py's leave-one-model-out figures: one GPU (V100-16, four models
measured, TP 1-8) fitted on three of Sailor's models and checked on the fourth, in turn, with the memory
efficiency held at its prior (the bench fits it shared across GPUs, which this proxy skips to stay
cheap: ~5 s of CPU). The bench's targets apply: median within 5%, every entry within 15%."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from conftest import SAILOR_DATA
from hethub.predict.calibrate import DEFAULT_MEM_EFF, fit_kind, predicted_layer_s

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compute_model as bench


def test_v100_leave_one_model_out_meets_the_targets():
    profiles, bws, dup = bench.load(SAILOR_DATA)
    gpu = "V100-16"
    samples = bench.samples_of({k: v for k, v in profiles.items() if k[0] == gpu}, bws)
    models = sorted(m for _, m in samples)
    assert len(models) == 4 and not any(g == gpu for g, _ in dup)
    base, peaks = bench.base_params(gpu)
    errs = []
    for held in models:
        train = [s for (_, m), rows in samples.items() if m != held for s in rows]
        fit = fit_kind(train, base=base, peaks=peaks, mem_eff=DEFAULT_MEM_EFF)
        for s in samples[(gpu, held)]:
            pred = predicted_layer_s(s, fit.params(base, s.mode, peaks[s.mode]), comm_scale=fit.comm_scale)
            errs.append(abs(pred / s.measured_s - 1))
    assert len(errs) >= 30
    assert statistics.median(errs) <= 0.05, statistics.median(errs)
    assert max(errs) <= 0.15, max(errs)
