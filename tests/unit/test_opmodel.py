"""The operator-level compute model: shape-dependent GEMM efficiency, backward shapes, calibration."""

from __future__ import annotations

import itertools

import pytest

from hethub.predict.calibrate import Sample, fit_kind, predicted_layer_s
from hethub.predict.compute import kernel_params, stage_times
from hethub.predict.gemm import KernelParams, gemm_time_s, wave_utilisation
from hethub.predict.opmodel import Shape, layer_ops, op_flops
from hethub.spec.kind import catalog
from hethub.spec.model import ModelSpec


def _llama(h: int) -> ModelSpec:
    return ModelSpec(name=f"h{h}", num_layers=1, hidden_size=h, num_heads=h // 128, num_kv_heads=h // 128,
                     ffn_hidden_size=4 * h, vocab_size=32000, max_seq_len=2048)


def test_analytic_efficiency_rises_with_hidden_size():
    kind = catalog()["a100-40gb"]
    effs = []
    for h in (1024, 2048, 4096, 8192):
        m = _llama(h)
        t = stage_times(m, kind, layers=1, embedding=False, head=False, tp=1, mbs=1, seq_len=2048,
                        recompute=False, precision="bf16-mixed")
        flops = 3 * m.layer_fwd_flops(tokens=2048, seq_len=2048)
        effs.append(flops / ((t.fwd_s + t.bwd_s) * kind.peak_flops))
    assert all(b > a for a, b in itertools.pairwise(effs)), effs
    assert effs[-1] > 1.2 * effs[0]  # not a constant efficiency (smaller tiles keep small GEMMs at ~0.8x the large)


def test_wave_quantisation_and_k_saturation():
    p = KernelParams(sm_count=100, matmul_flops=1e14, mem_bw_bytes_per_s=1e15, gemm_eff=1.0, k_half=64.0,
                     mem_eff=1.0, launch_s=0.0)
    full = gemm_time_s(p, m=128 * 10, n=128 * 10, k=4096, elem_bytes=2)  # 100 tiles: one full wave
    spill = gemm_time_s(p, m=128 * 101, n=128, k=4096, elem_bytes=2)  # 101 tiles: a second, almost empty wave
    # On 128 x 128 tiles alone, 1% more work would take twice the time (a second wave with one tile)
    assert wave_utilisation(m=128 * 101, n=128, batch=1, sm_count=100) == pytest.approx(101 / 200)
    # the library takes 64 x 64 tiles instead: 404 tiles in 5 waves (81% busy) at 4x the tile's fixed cost
    flops = 2.0 * 128 * 101 * 128 * 4096
    assert spill == pytest.approx(flops / (1e14 * 404 / 500) * (4096 + 4 * 64) / 4096, rel=1e-6)
    assert 1.25 * full < spill < 1.5 * full
    short = gemm_time_s(p, m=128 * 10, n=128 * 10, k=64, elem_bytes=2)  # K = k_half: half the long-K speed
    assert (short / 64) / (full / 4096) == pytest.approx(2 / ((4096 + 64) / 4096), rel=1e-6)


def test_backward_has_twice_the_forward_gemm_flops_with_its_own_shapes():
    s = Shape.of(_llama(2048), mbs=2, seq_len=1024, tp=2, elem_bytes=2, attention="math")
    fwd, bwd = layer_ops(s)
    assert op_flops(bwd) == pytest.approx(2 * op_flops(fwd))
    # QKV (M=tokens, N=(h + 2 kv)/tp, K=h) -> input grad (tokens, h, (h+2kv)/tp), weight grad (h, (h+2kv)/tp, tokens)
    assert ("gemm", 2048, 3 * 2048 // 2, 2048, 1) in fwd
    assert ("gemm", 2048, 2048, 3 * 2048 // 2, 1) in bwd and ("gemm", 2048, 3 * 2048 // 2, 2048, 1) in bwd
    flash = Shape.of(_llama(2048), mbs=2, seq_len=1024, tp=2, elem_bytes=2, attention="flash")
    assert op_flops(layer_ops(flash)[0]) < op_flops(fwd)  # causal half of the attention work


def test_fit_recovers_known_numbers():
    truth = KernelParams(sm_count=108, matmul_flops=1.5e14, mem_bw_bytes_per_s=1.5e12, gemm_eff=0.6, k_half=120.0,
                         mem_eff=0.8, launch_s=8e-6)
    samples = []
    for h in (512, 1024, 2048):
        for mbs in (1, 4):
            shape = Shape.of(_llama(h), mbs=mbs, seq_len=1024, tp=1, elem_bytes=4, attention="math")
            samples.append(Sample(shape, "tf32", predicted_layer_s(Sample(shape, "tf32", 1.0), truth)))
    fit = fit_kind(samples, base=truth, peaks={"tf32": 1.5e14})
    for s in samples:
        assert predicted_layer_s(s, fit.params(truth, "tf32", 1.5e14)) == pytest.approx(s.measured_s, rel=0.03)


def test_sources_say_calibrated_or_not():
    assert kernel_params(catalog()["a100-40gb"], "fp32")[1].startswith("analytic, calibrated on Sailor")
    assert kernel_params(catalog()["a100-40gb"], "bf16-mixed")[1] == (
        "analytic, calibrated on MAMF table, Sailor profiles GPT-Neo-2.7, LLAMA-3-8, OPT-30, OPT-350 on A100-40, "
        "FlashAttention-2 paper")
    h100 = kernel_params(catalog()["h100-sxm"], "bf16-mixed")[1]
    assert h100.startswith("analytic, partly calibrated on MAMF")
    assert h100.endswith("(gemm_k_half 64, kernel_launch_s 1e-05 assumed)")
    assert kernel_params(catalog()["mi300x"], "fp32")[1] == "analytic, uncalibrated"
    assert kernel_params(catalog()["cpu"], "fp32") is None  # no compute-unit data: constant-efficiency roofline


@pytest.mark.parametrize("kind_name", ["a100-40gb", "v100-16gb"])
def test_selective_recomputation_adds_the_attention_core_forward(kind_name):
    from hethub.predict.compute import _core_time_s
    from hethub.predict.opmodel import attention_core_ops

    kind, m = catalog()[kind_name], _llama(4096)
    kw = dict(layers=4, embedding=False, head=False, tp=2, mbs=1, seq_len=4096, precision="bf16-mixed")
    none, sel, full = (stage_times(m, kind, recompute=rc, **kw) for rc in ("none", "selective", "full"))
    assert none.fwd_s == sel.fwd_s == full.fwd_s
    assert none.bwd_s < sel.bwd_s < full.bwd_s
    params, _ = kernel_params(kind, "bf16-mixed")
    shape = Shape.of(m, mbs=1, seq_len=4096, tp=2, elem_bytes=2, attention=kind.attention)
    assert sel.bwd_s - none.bwd_s == pytest.approx(4 * _core_time_s(shape, params) * kind.emulated_slowdown)
    # The core is the layer's forward between the QKV and output projections: no projection GEMM.
    assert not [op for op in attention_core_ops(shape) if op[0] == "gemm" and op[4] == 1]
    # On the roofline (no compute-unit data) the score and value products' FLOPs.
    plain = catalog()["cpu"]
    assert kernel_params(plain, "fp32") is None
    r_none, r_sel = (stage_times(m, plain, recompute=rc, **kw) for rc in ("none", "selective"))
    core = m.attention_core_fwd_flops(tokens=4096, seq_len=4096) / 2 / plain.effective_flops
    assert r_sel.bwd_s - r_none.bwd_s == pytest.approx(4 * core)


def test_recipe_names_the_runtimes_kernels():
    from hethub.predict.opmodel import Recipe

    m = _llama(2048)
    plain = Shape.of(m, mbs=1, seq_len=2048, tp=1, elem_bytes=4, attention="math")
    megatron = Shape.of(m, mbs=1, seq_len=2048, tp=1, elem_bytes=4, attention="math",
                        recipe=Recipe(norm="python-rms", qkv_layout="strided", rotary="python", score_scale=True))
    (pf, pb), (mf, mb) = layer_ops(plain), layer_ops(megatron)
    kernels = lambda ops: sum(1 for op in ops if op[0] != "mem" or op[1] > 0)  # noqa: E731
    # Python RMSNorm (6 kernels each, twice) and rotary (5 per tensor) instead of one fused kernel each,
    # a scaling pass, but no copy of q, k, v (read strided): more kernels, the same GEMMs.
    assert kernels(mf) == kernels(pf) + 2 * 5 + (10 - 1) + 1 - 1
    assert [op for op in mf if op[0] == "gemm"] == [op for op in pf if op[0] == "gemm"]
    assert op_flops(mb) == pytest.approx(op_flops(pb))
    assert sum(op[1] for op in mb if op[0] == "mem") > sum(op[1] for op in pb if op[0] == "mem")


def test_shared_memory_efficiency_is_recovered_across_models():
    from hethub.predict.calibrate import fit_shared_mem_eff

    truth = KernelParams(sm_count=108, matmul_flops=1.5e14, mem_bw_bytes_per_s=1.5e12, gemm_eff=0.6, k_half=64.0,
                         mem_eff=0.55, launch_s=1e-5)
    samples = []
    for h, heads in ((1024, 16), (4096, 32)):  # two models: GEMM and memory shares differ between them
        m = ModelSpec(name=f"h{h}", num_layers=1, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                      ffn_hidden_size=4 * h, vocab_size=32000, max_seq_len=2048)
        for mbs in (1, 4):
            shape = Shape.of(m, mbs=mbs, seq_len=2048, tp=1, elem_bytes=4, attention="math")
            samples.append(Sample(shape, "tf32", predicted_layer_s(Sample(shape, "tf32", 1.0), truth)))
    mem_eff, fits = fit_shared_mem_eff({"k": (samples, truth, {"tf32": 1.5e14})})
    assert mem_eff == pytest.approx(0.55, rel=0.1)
    assert fits["k"].gemm_eff["tf32"] == pytest.approx(0.6, rel=0.1)


def test_k_half_scales_with_the_modes_peak():
    # A tile's fixed prologue/epilogue is worth peak / fp32 peak more K steps on the tensor cores (the
    # TF32 runs the bench fits); the predictor's bf16 keeps the fp32 number (no bf16 measurement).
    from hethub.predict.calibrate import Fit

    base = KernelParams(sm_count=108, matmul_flops=19.5e12, mem_bw_bytes_per_s=1.5e12, gemm_eff=1.0, k_half=1.0,
                        mem_eff=1.0, launch_s=0.0)
    fit = Fit({"tf32": 0.8, "fp32": 0.9}, 50.0, 0.7, 1e-5)
    assert fit.params(base, "fp32", 19.5e12).k_half == pytest.approx(50.0)
    assert fit.params(base, "tf32", 156e12).k_half == pytest.approx(400.0)
    kind = catalog()["a100-40gb"]
    assert kernel_params(kind, "bf16-mixed")[0].k_half == kernel_params(kind, "fp32")[0].k_half == kind.gemm_k_half


def test_a_tp_collectives_wait_for_the_slowest_rank_keeps_a_small_layer_from_shrinking():
    """A TP collective waits on the GPU for the group's slowest rank: a fixed cost per collective that
    TP does not shorten, so at a small micro-batch TP 4 barely cuts the layer; at a large one the
    compute binds and TP still cuts it."""
    from hethub.predict.comm import allreduce_time_s
    from hethub.predict.opmodel import phase_time_s
    from hethub.spec.cluster import Link

    p = KernelParams(sm_count=108, matmul_flops=156e12, mem_bw_bytes_per_s=1.5e12, gemm_eff=0.8, k_half=64.0,
                     mem_eff=0.7, launch_s=10e-6, collective_wait_s=400e-6)
    link = Link(240e9, 5e-6)

    def layer_s(mbs: int, tp: int) -> float:
        s = Shape.of(_llama(1024), mbs=mbs, seq_len=1024, tp=tp, elem_bytes=4, attention="math")
        fwd, bwd = layer_ops(s)
        ar = (lambda n: allreduce_time_s(nbytes=n, participants=tp, link=link)) if tp > 1 else None
        return sum(phase_time_s(ph, p, elem_bytes=4, allreduce_s=ar) for ph in (fwd, bwd))

    small = layer_s(1, 4) / layer_s(1, 1)
    large = layer_s(16, 4) / layer_s(16, 1)
    assert small > 0.9  # the wait binds: TP 4 does not shorten it (the measured A100/GH200 OPT-350 pattern)
    assert large < 0.5  # GPU-bound: TP 4 cuts it towards a quarter
    no_sync = KernelParams(**{**p.__dict__, "collective_wait_s": 0.0})
    s1 = Shape.of(_llama(1024), mbs=1, seq_len=1024, tp=4, elem_bytes=4, attention="math")
    ar4 = lambda n: allreduce_time_s(nbytes=n, participants=4, link=link)  # noqa: E731
    assert phase_time_s(layer_ops(s1)[0], no_sync, elem_bytes=4, allreduce_s=ar4) < phase_time_s(
        layer_ops(s1)[0], p, elem_bytes=4, allreduce_s=ar4)
    # The wait is spent on the GPU: a GPU-bound layer (the host far ahead) still pays it in full, once
    # per collective (its forward has two), where a host-side cost would hide behind the kernels.
    s16 = Shape.of(_llama(1024), mbs=16, seq_len=1024, tp=4, elem_bytes=4, attention="math")
    fwd16 = layer_ops(s16)[0]
    paid = phase_time_s(fwd16, p, elem_bytes=4, allreduce_s=ar4) - phase_time_s(fwd16, no_sync, elem_bytes=4,
                                                                                allreduce_s=ar4)
    assert sum(op[0] == "allreduce" for op in fwd16) == 2
    assert paid == pytest.approx(2 * p.collective_wait_s, rel=1e-6)


def test_split_k_fills_the_gpu_for_a_small_output_with_long_k():
    # A weight gradient of a narrow TP-sharded layer: 4 x 8 = 32 output tiles on 100 SMs, K = 16384.
    # Without split-K a third of the units work; cuBLAS cuts K (here into 2) and adds the partial tiles.
    p = KernelParams(sm_count=100, matmul_flops=1e14, mem_bw_bytes_per_s=1e15, gemm_eff=1.0, k_half=64.0,
                     mem_eff=1.0, launch_s=0.0)
    t = gemm_time_s(p, m=512, n=1024, k=16384, elem_bytes=4)
    one_split = 2.0 * 512 * 1024 * 16384 / (1e14 * 0.32) * (16384 + 64) / 16384
    assert t < 0.6 * one_split  # two slices: 64 blocks busy, not 32
    assert t > 2.0 * 512 * 1024 * 16384 / 1e14  # never faster than the peak
    # A GEMM that fills a wave is not split: its time is the plain tile model's.
    full = gemm_time_s(p, m=128 * 10, n=128 * 10, k=16384, elem_bytes=4)
    assert full == pytest.approx(2.0 * 1280 * 1280 * 16384 / 1e14 * (16384 + 64) / 16384, rel=1e-6)


def test_the_library_picks_the_tile_per_shape():
    # Large tiles amortise a tile's fixed cost over more output (a 256 x 128 tile's is half a 128 x 128
    # tile's in K steps); small tiles make enough blocks for a small output. The model takes the fastest.
    p = KernelParams(sm_count=100, matmul_flops=1e14, mem_bw_bytes_per_s=1e15, gemm_eff=1.0, k_half=256.0,
                     mem_eff=1.0, launch_s=0.0)
    ideal = 2.0 * 2560 * 2560 * 2048 / 1e14
    # 2560 x 2560: 400 tiles of 128 x 128 (4 full waves) or 200 of 256 x 128 (2 full waves): the wide tile
    big = gemm_time_s(p, m=2560, n=2560, k=2048, elem_bytes=4)
    assert big == pytest.approx(ideal * (2048 + 128) / 2048, rel=1e-6)
    # 640 x 1280 with K = 256: 50 tiles of 128 x 128 (half a wave); 64 x 128 tiles give 100 (one full
    # wave) at twice the fixed cost, which beats leaving half the units idle (split-K needs K >= 512)
    t = gemm_time_s(p, m=640, n=1280, k=256, elem_bytes=4)
    flops = 2.0 * 640 * 1280 * 256 / 1e14
    assert t == pytest.approx(flops * (256 + 512) / 256, rel=1e-6)
    assert t < flops * (256 + 256) / (0.5 * 256)  # the 128 x 128 tile's time
