"""The entries bench/compute_model.py leaves outside 15%: for each, the mechanism it names is shown from
the measured files themselves (no model involved) to be absent from them or contradicted by them, so
no mechanism fitted on the other files can reach it. Entries are (GPU, model, micro-batch, TP) of
Sailor's profiles (tests/data/sailor, vendored with their source); times are a decoder layer's forward +
backward."""

from __future__ import annotations

import json
import statistics

import pytest

from conftest import SAILOR_DATA as SAILOR


def _profile(model: str, gpu: str) -> dict:
    return json.loads((SAILOR / "profiles" / model / gpu / "profile.json").read_text())


def _t(prof: dict, mbs: int, tp: int) -> float:
    fwd, bwd, _ = prof[str(mbs)][str(tp)]["2"]
    return fwd + bwd


def _fwd(prof: dict, mbs: int, tp: int) -> float:
    return prof[str(mbs)][str(tp)]["2"][0]


def test_measurement_less_work_takes_longer():
    # GH-96 OPT-350 mbs 1 TP 4 (-63%): one micro-batch takes longer than two at the same TP; no
    # mechanism makes less work take longer.
    prof = _profile("OPT-350", "GH-96")
    assert _t(prof, 1, 4) > 1.2 * _t(prof, 2, 4)


def test_measurement_larger_batches_ran_faster_per_byte():
    # RTX-3090 OPT-350 mbs 16 and 32 at TP 4 (+57%, +38%): at TP 1 and 2 and up to mbs 8 at TP 4 each
    # doubling of the micro-batch doubles the time (work and all-reduce bytes both double), but mbs 16
    # at TP 4 takes only 1.4x mbs 8: its all-reduces ran faster per byte than the same box's smaller
    # ones, which no ring (time growing with bytes) gives.
    prof = _profile("OPT-350", "RTX-3090")
    for tp in (1, 2):
        steps = [_t(prof, 2 * m, tp) / _t(prof, m, tp) for m in (1, 2, 4) if str(2 * m) in prof and str(tp) in
                 prof[str(2 * m)]]
        assert all(1.9 < s < 2.2 for s in steps), (tp, steps)
    assert all(1.9 < _t(prof, 2 * m, 4) / _t(prof, m, 4) < 2.1 for m in (1, 2, 4))
    assert _t(prof, 16, 4) / _t(prof, 8, 4) < 1.5
    assert _t(prof, 32, 4) / _t(prof, 8, 4) < 2 * 2 * 0.8


def test_host_topology_is_in_no_input():
    # RTX-3090 OPT-350 TP 8 (7 entries, -45% to -63%): on this box an 8-GPU group is more than twice
    # as slow as a 4-GPU one at every micro-batch, while on the other two 8-GPU PCIe boxes (Titan-RTX,
    # RTX 2080 Ti) TP 8 is faster than TP 4: the 8-GPU ring spans a slower host path on this box only.
    def ratios(gpu: str) -> list[float]:
        prof = _profile("OPT-350", gpu)
        return [_t(prof, m, 8) / _t(prof, m, 4) for m in sorted(map(int, prof)) if {"4", "8"} <= set(prof[str(m)])]

    assert min(ratios("RTX-3090")) > 2.0
    assert max(ratios("Titan-RTX")) < 1.05 and max(ratios("RTX-2080")) < 1.05
    # No input describes host paths: the cluster file gives GPUs per node and memory only, the same
    # for the three boxes, and Sailor's send/recv figure on the RTX-3090 falls by a third from 4 to 8
    # GPUs where the layers' all-reduces fall by a factor of about three.
    config = json.loads((SAILOR / "basic_cluster_config.json").read_text())
    assert {k for g in ("RTX-3090", "Titan-RTX", "RTX-2080") for k in config[g]} == {"gpus_per_node", "mem_per_gpu"}
    assert all(config[g]["gpus_per_node"] == 8 for g in ("RTX-3090", "Titan-RTX", "RTX-2080"))
    bws = json.loads((SAILOR / "intra_node_bandwidths.json").read_text())
    assert 0.6 < bws["RTX-3090"]["8"][1] / bws["RTX-3090"]["4"][1] < 0.75


@pytest.mark.parametrize(("gpu", "mbs", "tp"), [("A100-40", 1, 4), ("A100-80", 1, 4), ("GH-96", 1, 2),
                                                ("GH-96", 2, 4)])
def test_rank_skew_is_a_fixed_wait_not_in_the_file(gpu, mbs, tp):
    # OPT-350 at TP 2-4 with micro-batch 1-2 (-20% to -33%): the measured forward hardly shrinks with
    # TP although each rank does 1/TP of the work, and the gap over TP = 1's share is many times what
    # the layer's two all-reduces take at the bandwidth Sailor measured on that box; four micro-batches
    # later the same file scales with TP. A wait of hundreds of microseconds per collective that appears
    # only in the shortest layers is the ranks of a layer-by-layer profiler drifting apart, which the
    # file (one time per layer, no per-rank times) does not record.
    prof = _profile("OPT-350", gpu)
    bws = json.loads((SAILOR / "intra_node_bandwidths.json").read_text())
    sizes = sorted(int(p) for p in bws[gpu])
    bw = bws[gpu][str(max(p for p in sizes if p <= tp))][1]
    nbytes = mbs * 2048 * 1024 * 4  # one all-reduce of the layer's fp32 activations
    ring_s = 2 * (tp - 1) / tp * nbytes / bw
    gap_s = _fwd(prof, mbs, tp) - _fwd(prof, mbs, 1) / tp
    assert gap_s > 5 * 2 * ring_s, (gap_s, ring_s)
    assert _fwd(prof, mbs, tp) / _fwd(prof, mbs, 1) > 0.65
    big = 8 * mbs
    assert _fwd(prof, big, tp) / _fwd(prof, big, 1) < 1.6 / tp
    assert len(prof[str(mbs)][str(tp)]["2"]) == 3  # forward, backward, update: one time per layer


def test_short_k_cost_is_absent_from_gh96_opt30():
    # GH-96 OPT-30 at micro-batch 1 (TP 1, 2, 4: +15% to +26%) and 2 (TP 4: +15%): the weight-gradient
    # GEMMs reduce over the tokens (K = 2048 at micro-batch 1), and the model, with the tile's fixed
    # cost fitted on GH-96's other files, charges it ~13% there. This file shows none: from
    # micro-batch 1 to 4 every doubling of the work at least doubles the time (1.99-2.06x) at every TP,
    # where a fixed cost against short K would make the first doubling cost visibly less than twice.
    prof = _profile("OPT-30", "GH-96")
    for tp in (1, 2, 4):
        for m in (1, 2):
            assert 1.98 < _t(prof, 2 * m, tp) / _t(prof, m, tp) < 2.1, (tp, m)


def test_no_eight_gpu_bandwidth_for_v100():
    # V100-16 OPT-350 mbs 4 TP 8 (+15.0%): the TP all-reduces are priced at Sailor's measured rate for
    # the group's size; for V100 the file has 2- and 4-GPU figures only, while the profile has TP 8
    # entries, so an 8-GPU ring (over more NVLinks per GPU than a 4-GPU one on a hybrid cube mesh) is
    # priced at the 4-GPU rate: its rate is absent from the measured input.
    bws = json.loads((SAILOR / "intra_node_bandwidths.json").read_text())
    assert set(bws["V100-16"]) == {"2", "4"}
    assert all("8" in by_tp for mbs, by_tp in _profile("OPT-350", "V100-16").items() if int(mbs) >= 2)


def test_the_rtx3090_boxs_shm_rate_is_in_no_input():
    # RTX-3090 OPT-350 mbs 1 TP 4 (+15.8%; its other TP-4 entries +10%): the box is priced with the
    # other PCIe boxes' SHM factor (it has one model, nothing to fit its own on). Its layers' TP-4
    # time beyond a quarter of TP 1 is no larger than on the Titan-RTX and RTX 2080 Ti boxes (within 1%), yet the
    # one input measured on the box, Sailor's send/recv figure, ranks it far below both at 4 GPUs: no
    # input gives this box's own all-reduce rate.
    def excess(gpu: str) -> list[float]:
        prof = _profile("OPT-350", gpu)
        return [_t(prof, m, 4) - _t(prof, m, 1) / 4 for m in (1, 2, 4)]

    mine = excess("RTX-3090")
    others = [statistics.mean(v) for v in zip(excess("Titan-RTX"), excess("RTX-2080"), strict=True)]
    assert all(a <= 1.01 * b for a, b in zip(mine, others, strict=True)), (mine, others)
    bws = json.loads((SAILOR / "intra_node_bandwidths.json").read_text())
    assert bws["RTX-3090"]["4"][1] < 0.7 * min(bws["Titan-RTX"]["4"][1], bws["RTX-2080"]["4"][1])
