"""Leave-one-model-out check of the operator-level compute model on Sailor's measured GPU profiles.

For every (GPU, model, micro-batch size, TP) entry of ../shared/reference/sailor/profiles, the
decoder layer's forward + backward time is predicted by predict/opmodel.py with numbers fitted on
the OTHER models only (predict/calibrate.py), and compared with the measurement. Each layer's op
list is the one Sailor's Megatron-DeepSpeed code runs for its family (SAILOR_CODE below; shapes as
its profiler profile_all.py passes them). Fitted per GPU: the GEMM efficiency of each math mode,
the K half-saturation, the host's time per kernel and the TP all-reduce scale; the memory-bound
kernels' share of DRAM bandwidth is ONE number for all GPUs (calibrate.fit_shared_mem_eff says
why), fitted in each fold without the held-out model. A GPU with no other model measured
(RTX-2080, RTX-3090, Titan-RTX: OPT-350 only) is predicted analytically, uncalibrated on itself:
its datasheet peaks and bandwidth times the median of the other GPUs' fitted fractions; its
entries are reported apart as well as in the total. Sailor's TP > 1 entries were measured on real
TP groups, so their all-reduces are in the times: the bench adds them as NCCL runs them per link
kind (link_kind): a ring with a latency per step, on NVLink at Sailor's measured intra-node figure
(intra_node_bandwidths.json, a send/recv test) times the GPU's fitted scale, on PCIe without P2P
(NCCL's SHM path through host memory) at one host SHM rate (SHM_REF_BW times a factor fitted on the
other PCIe GPUs, pcie_shm_link), plus each collective's wait on the GPU for the group's slowest rank
(fitted per GPU: a layer-by-layer profiler's ranks drift apart between layers). Sailor's
"RTX-2080" is priced as the RTX 2080 Ti its 11 GiB say it is (BENCH_KINDS).

Math mode per profile file: where the measured layer is faster than an ideal fp32 layer can be,
the file ran its matmuls on TF32 tensor cores (Sailor's Dockerfile uses an NGC PyTorch container,
nvcr.io/nvidia/pytorch:24.10, where cuBLAS TF32 is on by default); else on the fp32 units.

Data defects are reported and kept out of the fit and of the headline figures: a profile file
byte-identical to another model's on the same GPU whose layer count is not its model's is a copy.

Run: PYTHONPATH=src python bench/compute_model.py [--fit-all] (--fit-all: print the fit on all models
per GPU, the numbers the catalog carries).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from hethub.interop.sailor import SAILOR_KINDS
from hethub.predict.calibrate import (
    DEFAULT_COLLECTIVE_WAIT_S,
    DEFAULT_GEMM_EFF,
    DEFAULT_K_HALF,
    DEFAULT_LAUNCH_S,
    DEFAULT_MEM_EFF,
    Fit,
    Sample,
    fit_kind,
    fit_shared_mem_eff,
    predicted_layer_s,
)
from hethub.predict.comm import allreduce_time_s
from hethub.predict.gemm import KernelParams
from hethub.predict.opmodel import Recipe, Shape, layer_ops
from hethub.spec.cluster import Link
from hethub.spec.kind import catalog
from hethub.spec.model import PRESETS, ModelSpec

REF = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference" / "sailor"
# Sailor's model shapes as its profiler ran them (third_party/Megatron-DeepSpeed/profile_all.py): GPT-Neo
# with 20 heads of 128 (training_config_gpt_neo27.json says 32 of 80; the profiler passes 20), sequence
# 2048; "LLAMA-3-8" multi-head (32 KV heads), no --swiglu, so Megatron's FFN default 4h = 16384 for gate
# and up each (llm_info.json's 268.5M parameters per layer confirm it), sequence 8192.
MODELS: dict[str, tuple[ModelSpec, int]] = {
    "OPT-350": (PRESETS["opt-350m"], 2048),
    "GPT-Neo-2.7": (ModelSpec(name="sailor-gpt-neo-2.7", num_layers=32, hidden_size=2560, num_heads=20,
                              num_kv_heads=20, ffn_hidden_size=10240, vocab_size=50304, max_seq_len=2048,
                              arch="gpt", activation="gelu", tied_embeddings=True), 2048),
    "OPT-30": (PRESETS["opt-30b"], 2048),
    "LLAMA-3-8": (ModelSpec(name="sailor-llama-3-8", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                            ffn_hidden_size=16384, vocab_size=50304, max_seq_len=8192), 8192),
}
# What Sailor's Megatron-DeepSpeed code runs per family (third_party/Megatron-DeepSpeed/megatron/model/
# {opt,gpt_neo,llama}_model.py; profile_all.py runs them without --fp16/--bf16, so the masked-softmax
# fusion (16-bit only) is off and scores are masked by masked_fill_ with a bool mask, then soft-maxed).
# OPT: fused LayerNorm, QKV bias added, q/k/v read strided, no scale (norm_factor 1), no dropout (its
# dropout calls are commented out), attention-out and MLP biases skipped (skip_bias_add, discarded).
# GPT-Neo: the same with torch LayerNorm, GeLU and residual dropout 0.1 after attention-out and the MLP
# (attn_dropout defined, never applied; the local-attention mask is built but unused: every layer dense).
# Llama: Python RMSNorm and rotary, q/k/v copied after rotary, scores scaled by a separate pass (query-
# key layer scaling is on by default, --no-query-key-layer-scaling turns it off), gate and up as two
# GEMMs, then gate * up and SiLU as two kernels, no dropout.
_MEGATRON = Recipe(qkv_bias=True, qkv_layout="strided", mask_bytes=1, mask_on_view=True)
SAILOR_CODE = {
    "OPT-350": dict(recipe=_MEGATRON, dropout=False, attn_dropout=False),
    "OPT-30": dict(recipe=_MEGATRON, dropout=False, attn_dropout=False),
    "GPT-Neo-2.7": dict(recipe=_MEGATRON, dropout=True, attn_dropout=False),
    "LLAMA-3-8": dict(recipe=Recipe(norm="python-rms", qkv_bias=True, qkv_layout="copy-after-rotary", rotary="python",
                                    score_scale=True, mask_bytes=1, mlp="mul-then-act", gated_split=True),
                      dropout=False, attn_dropout=False),
}
ELEM_BYTES = 4  # Sailor profiled fp32 (Megatron-DeepSpeed fp32 runs; TF32 where the GPU has it)


def load(root: Path = REF) -> tuple[dict, dict, dict[tuple[str, str], str]]:
    """Sailor's profiles, its intra-node bandwidths and the copies among the files, from `root` (the
    full reference set; the tests pass their vendored copy)."""
    profiles, digests = {}, {}
    for f in sorted((root / "profiles").glob("*/*/profile.json")):
        model, gpu = f.parent.parent.name, f.parent.name
        profiles[(gpu, model)] = json.loads(f.read_bytes())
        digests[(gpu, model)] = hashlib.sha256(json.dumps(profiles[(gpu, model)], sort_keys=True).encode()).digest()
    # A file identical to another model's on the same GPU is a copy; the copy is the one whose layer
    # count does not match its model (embedding + decoder layers + head, + final norm for Llama).
    dup = {}
    for (gpu, model), dg in digests.items():
        spec = MODELS[model][0]
        layers = len(next(iter(next(iter(profiles[(gpu, model)].values())).values())))
        twins = [m for (g, m), d in digests.items() if g == gpu and m != model and d == dg]
        if twins and layers not in (spec.num_layers + 2, spec.num_layers + 3):
            dup[(gpu, model)] = twins[0]
    bws = json.loads((root / "intra_node_bandwidths.json").read_text())
    return profiles, bws, dup


# Sailor's "RTX-2080" GPUs are RTX 2080 Ti cards: its basic_cluster_config.json gives them 11 GiB
# (11811160064 bytes), the RTX 2080 has 8 GB, the 2080 Ti 11 GB (Turing whitepaper). Priced at the
# 2080 Ti's datasheet (68 SMs, 13.4 TFLOPS fp32, 616 GB/s), not the 2080's (46, 10.1, 448).
BENCH_KINDS = {**SAILOR_KINDS, "RTX-2080": "rtx-2080-ti"}


def base_params(gpu: str) -> tuple[KernelParams, dict[str, float]]:
    k = catalog()[BENCH_KINDS[gpu]]
    base = KernelParams(sm_count=k.sm_count, matmul_flops=k.fp32_flops, mem_bw_bytes_per_s=k.mem_bw_bytes_per_s,
                        gemm_eff=DEFAULT_GEMM_EFF, k_half=DEFAULT_K_HALF, mem_eff=DEFAULT_MEM_EFF,
                        launch_s=DEFAULT_LAUNCH_S)
    return base, {"fp32": k.fp32_flops, "tf32": k.tf32_flops or k.fp32_flops}


# How a TP group's all-reduce travels, per GPU and group size. NVLink parts (A100, V100, GH200): NCCL's
# P2P transport over NVLink, ring at Sailor's measured bandwidth for that group size. RTX-3090 pairs:
# an NVLink bridge (Sailor's 2-GPU figure, 49.8 GB/s, is above what PCIe 4.0 x16 carries, 31.5 GB/s
# per direction). Everything else on the GeForce/Titan parts: PCIe without peer-to-peer (NVIDIA
# disables P2P on GeForce), so NCCL falls back to its SHM transport: every ring hop is staged through
# pinned host memory (the sender's copy into a host buffer, the receiver's copy out of it). Its rate
# is set by those copies through the host, not by the PCIe generation: published SHM all-reduces
# reach 6-9 GB/s on PCIe 3.0 hosts (nccl#406) and 6.1 GB/s on a PCIe 4.0 host (nccl#1817, 8 x L20),
# and Sailor's layers imply the same ~4-5 GB/s bus rate at TP 4 on the RTX-3090 (PCIe 4.0) box as on
# the Titan-RTX and RTX-2080 (PCIe 3.0) ones. So one SHM hop rate for every PCIe GPU: SHM_REF_BW times
# a factor fitted on the OTHER PCIe GPUs (see pcie_shm_link); not Sailor's send/recv figure (which
# measures 2.5-4.8x more than the layers' all-reduces imply).
CONSUMER = ("RTX-2080", "RTX-3090", "Titan-RTX")
# The nominal rate the fitted SHM factor divides (PCIe 3.0 x16 per direction, PCI-SIG: 8 GT/s x 16
# lanes x 128/130 = 15.75 GB/s); only the product rate / factor is a claim, fitted leave-one-GPU-out.
# The bench's SHM base, not the catalog's figure (that one is the effective all-reduce rate these fits
# give, so it would leak).
SHM_REF_BW = 15.75e9


def link_kind(gpu: str, tp: int) -> str:
    if gpu not in CONSUMER:
        return "nvlink"
    return "nvlink-bridge" if gpu == "RTX-3090" and tp == 2 else "pcie-shm"


def allreduce_fn(gpu: str, tp: int, bws: dict):
    """A ring all-reduce as NCCL runs it: 2(p-1) steps, each a latency and n/p bytes over one link
    (nccl-tests PERFORMANCE.md: busbw = algbw x 2(n-1)/n, the per-link rate a ring needs)."""
    if tp == 1:
        return None
    kind = catalog()[BENCH_KINDS[gpu]]
    if link_kind(gpu, tp) == "pcie-shm":
        link = Link(SHM_REF_BW, kind.intra_node_latency_s)
    else:
        sizes = sorted(int(p) for p in bws[gpu])
        size = max([p for p in sizes if p <= tp] or sizes[:1])
        link = Link(bws[gpu][str(size)][1], kind.intra_node_latency_s)
    return _Ring(tp, link)


@dataclass(frozen=True)
class _Ring:
    """Hashable (the calibration caches compiled operator lists per all-reduce model)."""

    participants: int
    link: Link

    def __call__(self, nbytes: float) -> float:
        return allreduce_time_s(nbytes=nbytes, participants=self.participants, link=self.link)


def pcie_shm_link(held_gpu: str, samples: dict, *, mem_eff: float) -> tuple[float, float]:
    """The SHM factor of PCIe TP groups without P2P (measured all-reduce / the ring at SHM_REF_BW) and
    their wait per collective for the slowest rank: the median over the other PCIe GPUs, each fitted
    on its own entries (its TP = 1 entries pin its compute, its TP > 1 ones the link). Not
    leave-one-model-out: OPT-350 is the only model measured on these GPUs, so this is
    leave-one-GPU-out (the held GPU's entries are never in it)."""
    peers = [g for g in CONSUMER if g != held_gpu and any(gg == g for gg, _ in samples)]
    fits = [_own_fit(g, samples, mem_eff) for g in peers]
    if not fits:
        return 1.0, DEFAULT_COLLECTIVE_WAIT_S
    return (statistics.median(f.comm_scale for f in fits), statistics.median(f.collective_wait_s for f in fits))


_OWN_FITS: dict[tuple[str, float], Fit] = {}


def _own_fit(gpu: str, samples: dict, mem_eff: float) -> Fit:
    """A PCIe GPU fitted on its own (OPT-350) entries; only its link factor is transferred. The link is
    fitted on the GPU's smallest SHM group (TP 2, or TP 4 where pairs are bridged): a ring's hop
    rate does not depend on the group size while its hops share one host path (Sailor's Titan-RTX and
    RTX-2080 layers: 3.9, 4.6, 4.9 GB/s bus rate at TP 2, 4, 8), and a larger group that is slower
    per hop (the RTX-3090 box at TP 8: 1.5 GB/s against 4.7 at TP 4) is that box's own topology,
    which no input gives and which the bench reports instead of spreading it over the other GPUs."""
    key = (gpu, mem_eff)
    if key not in _OWN_FITS:
        shm = [s.shape.tp for (g, _m), ss in samples.items() if g == gpu for s in ss
               if s.shape.tp > 1 and link_kind(g, s.shape.tp) == "pcie-shm"]
        rows = [s for (g, _m), ss in samples.items() if g == gpu for s in ss
                if s.shape.tp == 1 or s.shape.tp == min(shm, default=0)]
        base, peaks = base_params(gpu)
        _OWN_FITS[key] = fit_kind(rows, base=base, peaks=peaks, mem_eff=mem_eff)
    return _OWN_FITS[key]


def samples_of(profiles: dict, bws: dict) -> dict[tuple[str, str], list[Sample]]:
    out: dict[tuple[str, str], list[Sample]] = {}
    for (gpu, model), prof in profiles.items():
        spec, seq = MODELS[model]
        base, peaks = base_params(gpu)
        rows = []
        for mbs, by_tp in prof.items():
            for tp, layers in by_tp.items():
                fwd, bwd, _ = layers["2"]
                shape = Shape.of(spec, mbs=int(mbs), seq_len=seq, tp=int(tp), elem_bytes=ELEM_BYTES,
                                 attention="math", **SAILOR_CODE[model])
                rows.append((shape, fwd + bwd, allreduce_fn(gpu, int(tp), bws), f"{mbs}/{tp}"))
        # Math mode of the file: faster than an ideal fp32 layer (every GEMM at the non-tensor fp32
        # peak, memory at full bandwidth, no launch cost) can be, by a margin (10%) beyond the model's own
        # uncertainty -> TF32 tensor cores.
        ideal = replace(base, gemm_eff=1.0, k_half=1e-9, mem_eff=1.0, launch_s=0.0)
        fast = min(t / predicted_layer_s(Sample(sh, "fp32", t, ar), ideal) for sh, t, ar, _ in rows)
        mode = "tf32" if fast < 0.9 and peaks["tf32"] > peaks["fp32"] else "fp32"
        out[(gpu, model)] = [Sample(sh, mode, t, ar, lab) for sh, t, ar, lab in
                             sorted(rows, key=lambda r: (r[0].tokens, r[0].tp))]
    return out


def median_fit(fits: list[Fit], *, mem_eff: float) -> Fit:
    """A GPU measured on no other model: the median of the other GPUs' fitted fractions (of their own
    datasheet peaks), the shared memory efficiency."""
    modes = {m for f in fits for m in f.gemm_eff}
    return Fit({m: statistics.median(f.gemm_eff[m] for f in fits if m in f.gemm_eff) for m in modes},
               statistics.median(f.k_half for f in fits), mem_eff,
               statistics.median(f.launch_s for f in fits), statistics.median(f.comm_scale for f in fits),
               statistics.median(f.collective_wait_s or DEFAULT_COLLECTIVE_WAIT_S for f in fits))


@dataclass(frozen=True)
class Siblings:
    """What lacking() compares an entry with, all from the same file: errors of the TP=1 entries by
    tokens, their measured forwards, the entries' measured times and errors by (tokens, TP)."""

    tp1_err: dict[int, float]
    tp1_fwd_s: dict[int, float]
    measured_s: dict[tuple[int, int], float]
    err: dict[tuple[int, int], float]


_SHORT_K = ("measured faster than the tile model (the fastest of gemm.TILES, each tile's fixed cost worth k_half K "
            "steps of a 128 x 128 tile, fitted on this GPU's other models) allows: this model's time grows in "
            "proportion to its work from here up while the model still charges the tile's fixed cost against a "
            "short K (the tokens, for the weight gradients); which kernel cuBLAS ran is not in the data")
# Where the data property each reason rests on is checked (from the measured files alone, no model).
REASON_TESTS = "tests/unit/test_compute_model_outliers.py"


def lacking(s: Sample, err: float, *, own: bool, sib: Siblings, file_errs: list[float], fwd_s: float,
            linear_s: float | None = None, sendrecv: dict[int, float] | None = None, wait_s: float = 0.0,
            collectives: int = 0) -> str:
    """Which mechanism the model lacks for an entry outside 15%, reasoned from the data: the entry's
    TP=1 sibling (same micro-batch), its siblings at other micro-batches and TP degrees, the file's
    median error, and how the measured forward falls with TP."""
    t, tp = s.shape.tokens, s.shape.tp
    more = [v for (tt, p), v in sib.measured_s.items() if p == tp and tt > t]
    if err < 0 and more and min(more) < s.measured_s:
        return (f"measurement: this entry ({s.measured_s * 1e3:.2f} ms) takes longer than the same TP at a larger "
                f"micro-batch ({min(more) * 1e3:.2f} ms): no mechanism makes less work take longer (run-to-run "
                "variation or rank skew of this one measurement)")
    tp1_err = sib.tp1_err
    base = tp1_err.get(t)
    if not own:
        if base is None and tp1_err:  # no TP=1 entry at this micro-batch (it did not fit): the file's TP=1 median
            base = statistics.median(tp1_err.values())
        if s.shape.tp > 1 and base is not None and abs(base) <= 0.15:
            if err > 0 and linear_s and s.measured_s < 0.9 * linear_s:
                return (f"measurement: this entry takes {s.measured_s / linear_s:.2f}x the time of a smaller "
                        "micro-batch at the same TP scaled by its work (and bytes), so its all-reduces ran "
                        "faster per byte than this box's others (TP=1 within 15%); no mechanism of a ring gives that")
            small = {p: v for p, v in (sendrecv or {}).items() if p < s.shape.tp}
            if err < 0 and small and sendrecv and s.shape.tp in sendrecv:
                p0 = max(small)
                return (f"host topology: this box's {s.shape.tp}-GPU ring is slower per hop than its {p0}-GPU one "
                        f"(the other PCIe boxes' are not), and Sailor's send/recv test on it also falls from "
                        f"{small[p0] / 1e9:.1f} to {sendrecv[s.shape.tp] / 1e9:.1f} GB/s: the group spans a slower "
                        "host path (e.g. two CPU sockets), which no input describes")
            return (f"PCIe TP collectives: this GPU's TP=1 entries are within 15% ({base * 100:+.0f}%), but "
                    f"this machine's {s.shape.tp}-GPU all-reduce through host memory is not what the other PCIe "
                    "GPUs' SHM factor gives (its own host topology: sockets, PCIe switches; no input says it)")
        return ("calibration: analytic, uncalibrated on this GPU (no other model measured on it): its compute "
                "numbers are other GPUs' fractions of peak (consumer boost clocks differ)")
    if tp > 1 and base is not None and abs(base) <= 0.15:
        t1 = sib.tp1_fwd_s.get(t)
        if err < 0 and t1 and fwd_s > 0.5 * t1 and collectives:
            need = wait_s - err * s.measured_s / (1 + err) / collectives
            return (f"rank skew beyond this GPU's other models: TP={tp} cuts the measured forward only to "
                    f"{fwd_s / t1:.2f}x of TP=1; the wait of a TP collective for the group's slowest rank is "
                    f"modelled at {wait_s * 1e6:.0f} us (fitted on this GPU's other models), this entry needs "
                    f"~{need * 1e6:.0f} us per collective; the skew of a layer-by-layer profiler's ranks is not "
                    "a fixed number per GPU, and no other model is this short")
        if err > 0 and base > 0.10:
            return f"shape: as its TP=1 sibling ({base * 100:+.0f}%), " + _SHORT_K
        if sendrecv and tp not in sendrecv:
            return (f"TP collectives: Sailor's intra_node_bandwidths.json has no {tp}-GPU figure for this GPU "
                    f"(only {sorted(sendrecv)}), so the {tp}-GPU ring is priced at the "
                    f"{max(p for p in sendrecv if p < tp)}-GPU rate; the TP=1 entry of this micro-batch is within "
                    f"15% ({base * 100:+.0f}%)")
        return (f"TP collectives: the TP=1 entry of this micro-batch is within 15% ({base * 100:+.0f}%), so the "
                "measured all-reduce cost differs from a ring at Sailor's bandwidth x the GPU's one fitted scale")
    half = (t // 2, tp // 2)
    if tp > 1 and err > 0 and half in sib.err and abs(sib.err[half]) <= 0.15:
        step = s.measured_s / sib.measured_s[half]
        return (f"TP collectives by group size: the same work per rank at TP={tp // 2} is within 15% "
                f"({sib.err[half] * 100:+.0f}%), and TP={tp} measures only {step:.2f}x its time: this box's "
                f"{tp}-GPU all-reduce runs at a higher bus rate than its {tp // 2}-GPU one relative to Sailor's "
                f"send/recv figures (NCCL rings over the links the group spans), and no other model measured "
                f"TP={tp} on this GPU to fit its own scale")
    offset = statistics.median(file_errs)
    if abs(offset) > 0.15 and (err > 0) == (offset > 0):
        return (f"model-specific: this file's median error is {offset * 100:+.0f}%, so this model's kernels cost a "
                "different share than on the models fitted on")
    if err > 0:
        return "shape: " + _SHORT_K
    return "shape: measured slower than the model for this shape (launch-bound small kernels or memory stalls)"


def fold(held: str | None, samples: dict, by_gpu: dict, dup: dict) -> tuple[float, dict[str, Fit]]:
    """Fit every GPU on its models other than `held` (None: on all), with one shared memory efficiency."""
    groups = {}
    for g, models in by_gpu.items():
        train = [s for m in models if m != held and (g, m) not in dup for s in samples[(g, m)]]
        if train:
            base, peaks = base_params(g)
            groups[g] = (train, base, peaks)
    return fit_shared_mem_eff(groups)


def summary(name: str, errs: list[float]) -> str:
    if not errs:
        return f"{name}: no entries"
    return (f"{name}: {len(errs)} entries, median |err| {statistics.median(errs) * 100:.1f}% (target <= 5%), "
            f"max {max(errs) * 100:.1f}% (target <= 15%), within 15%: {sum(e <= 0.15 for e in errs)}/{len(errs)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-all", action="store_true", help="print the per-GPU fit on all models")
    args = ap.parse_args()
    if not (REF / "profiles").is_dir():
        print(f"no Sailor reference data at {REF}; nothing to check")
        return 0
    profiles, bws, dup = load()
    samples = samples_of(profiles, bws)
    gpus = sorted({g for g, _ in samples})
    by_gpu: dict[str, list[str]] = defaultdict(list)
    for g, m in sorted(samples):
        by_gpu[g].append(m)
    for (g, m), twin in sorted(dup.items()):
        print(f"DATA DEFECT, EXCLUDED from every fit and from the headline figures: {m}/{g}/profile.json is "
              f"byte-identical to {twin}/{g}/profile.json and has {twin}'s layer count, not {m}'s: it is not a "
              f"{m} measurement ({len(samples[(g, m)])} entries).")
    if args.fit_all:
        mem_eff, fits = fold(None, samples, by_gpu, dup)
        print(f"shared mem_eff={mem_eff:.3f}")
        for g in gpus:
            if g in CONSUMER:  # the SHM rate a planner's catalog carries: own, and leave-one-GPU-out
                own = SHM_REF_BW / _own_fit(g, samples, mem_eff).comm_scale
                held = SHM_REF_BW / pcie_shm_link(g, samples, mem_eff=mem_eff)[0]
                print(f"{g:10s} SHM all-reduce bus rate: own fit {own / 1e9:.2f} GB/s at its smallest SHM group, "
                      f"leave-one-GPU-out (the other PCIe GPUs' median) {held / 1e9:.2f} GB/s")
        for g in gpus:
            f = fits[g]
            print(f"{g:10s} gemm_eff={ {k: round(v, 3) for k, v in f.gemm_eff.items()} } k_half={f.k_half:.0f} "
                  f"launch_s={f.launch_s * 1e6:.1f}us comm_scale={f.comm_scale:.2f} "
                  f"collective_wait_s={f.collective_wait_s * 1e6:.0f}us "
                  f"models={sorted(m for m in by_gpu[g] if (g, m) not in dup)}")
        return 0
    errors: dict[str, list[float]] = defaultdict(list)  # by GPU, without data defects
    own_errs, xfer_errs, defect_errs = [], [], []
    reasons: dict[str, int] = defaultdict(int)
    print(f"{'gpu':10s} {'model':12s} {'mode':5s} {'mbs/tp':>7s} {'measured_ms':>11s} {'predicted_ms':>12s} "
          f"{'err':>7s}  calibration / missing mechanism")
    for held in sorted({m for _, m in samples}):
        mem_eff, fits = fold(held, samples, by_gpu, dup)
        for g in gpus:
            if (g, held) not in samples:
                continue
            base, peaks = base_params(g)
            own = g in fits
            fit = fits[g] if own else median_fit([f for gg, f in fits.items() if gg != g], mem_eff=mem_eff)
            rows = samples[(g, held)]
            scales = [fit.comm_scale] * len(rows)
            if not own:  # per link kind: the NVLink GPUs' median scale, or the SHM factor of the other PCIe GPUs
                shm, wait_s = pcie_shm_link(g, samples, mem_eff=mem_eff)
                fit = replace(fit, collective_wait_s=wait_s)  # rank skew of a workstation like the other PCIe GPUs'
                scales = [shm if link_kind(g, s.shape.tp) == "pcie-shm" else fit.comm_scale for s in rows]
            preds = [predicted_layer_s(s, fit.params(base, s.mode, peaks[s.mode]), comm_scale=c)
                     for s, c in zip(rows, scales, strict=True)]
            errs = [p / s.measured_s - 1 for p, s in zip(preds, rows, strict=True)]
            tp1 = {s.shape.tokens: e for s, e in zip(rows, errs, strict=True) if s.shape.tp == 1}
            fwd = {(s.shape.tokens, s.shape.tp): profiles[(g, held)][s.label.split("/")[0]][str(s.shape.tp)]["2"][0]
                   for s in rows}
            sib = Siblings(tp1, {t: v for (t, tp), v in fwd.items() if tp == 1},
                           {(s.shape.tokens, s.shape.tp): s.measured_s for s in rows},
                           {(s.shape.tokens, s.shape.tp): e for s, e in zip(rows, errs, strict=True)})
            defect = (g, held) in dup
            note = (f"fit on {', '.join(m for m in by_gpu[g] if m != held and (g, m) not in dup)}, "
                    f"shared mem_eff {mem_eff:.2f}" if own else
                    "analytic, uncalibrated on this GPU: median of the other GPUs' fitted fractions of peak")
            if own and rows[0].mode not in fit.gemm_eff:
                note += f"; {rows[0].mode} efficiency assumed (no other model ran {rows[0].mode} here)"
            for s, pred, err in zip(rows, preds, errs, strict=True):
                if defect:
                    defect_errs.append(abs(err))
                    why = f" | EXCLUDED (data defect: a copy of {dup[(g, held)]}'s file)"
                else:
                    errors[g].append(abs(err))
                    (own_errs if own else xfer_errs).append(abs(err))
                    why = ""
                    if abs(err) > 0.15:
                        small = min((r for r in rows if r.shape.tp == s.shape.tp), key=lambda r: r.shape.tokens)
                        half = small.measured_s * s.shape.tokens / small.shape.tokens if small is not s else None
                        why = lacking(s, err, own=own, sib=sib, file_errs=errs, linear_s=half,
                                      sendrecv={int(k): v[1] for k, v in bws.get(g, {}).items()},
                                      fwd_s=fwd[(s.shape.tokens, s.shape.tp)], wait_s=fit.collective_wait_s,
                                      collectives=sum(op[0] == "allreduce" for ph in layer_ops(s.shape) for op in ph))
                        reasons[why.split(":")[0]] += 1
                        why = " | OUTSIDE 15%: " + why
                print(f"{g:10s} {held:12s} {s.mode:5s} {s.label:>7s} {s.measured_s * 1e3:11.3f} {pred * 1e3:12.3f} "
                      f"{err * 100:+6.1f}%  {note}{why}")
    every = [e for g in gpus for e in errors[g]]
    print()
    print(summary("HEADLINE, all entries without data defects", every))
    print(summary("  calibrated on their own GPU's other models", own_errs))
    print(summary("  analytic, uncalibrated on their GPU (RTX-2080/3090/Titan-RTX: one model only)", xfer_errs))
    if defect_errs:
        print(summary("  (excluded data defects, for information)", defect_errs))
    print("per GPU: " + "; ".join(f"{g} median {statistics.median(errors[g]) * 100:.1f}% max "
                                  f"{max(errors[g]) * 100:.1f}%" for g in gpus if errors[g]))
    print("entries outside 15% by what the model lacks: "
          + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
          + f" (each reason's data property, from the measured files alone: {REASON_TESTS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
