"""Run the layer measurements for every (micro-batch size, TP degree) and build a KindProfile.

TP degree 1 is measured in this process. TP degree t > 1 on CPU runs on t forked ranks of a real
gloo group (loopback), so each entry's times contain the TP all-reduces, which is what the
predictor assumes of a profile; the slowest rank's median counts (a TP stage waits for all its
ranks). On an accelerator a TP group would need t devices and the matching backend; with fewer
devices the sharded layer is measured alone and the entry is marked ``tp_comm_included: false``,
so the predictor adds its modelled TP collectives on top.

Threads: the runtime runs one thread per rank (``launch_local`` sets OMP_NUM_THREADS=1), so CPU
profiles default to one thread too; a profile is only as good as its match with the run.
"""

from __future__ import annotations

import io
import platform
from dataclasses import dataclass, field, replace

import torch

from hethub.emulation.host import usable_cores
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.profile.format import merge_profiles
from hethub.profiler.layers import EntryResult, Repetitions, measure_entry, stack_depths, tp_alone
from hethub.progress import progress
from hethub.runtime.tensor_parallel import TPContext
from hethub.spec.model import ModelSpec

_JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProfileRequest:
    model: ModelSpec
    kind: str
    seq_len: int
    mbs: tuple[int, ...]
    tp: tuple[int, ...]
    device: str = "cpu"
    threads: int = 1
    reps: Repetitions = field(default_factory=Repetitions)
    # Decoder-layer stack depths (> 1, capped at the model's layer count) also measured per entry.
    depths: tuple[int, ...] = (2, 4, 8)
    show_progress: bool = True  # on stderr


def device_description(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device}: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {platform.processor() or platform.machine()}, {usable_cores()} cores usable"


def run_profile(req: ProfileRequest) -> KindProfile:
    """Measure every requested (mbs, tp) entry; progress goes to stderr."""
    torch.set_num_threads(req.threads)
    entries: dict[tuple[int, int], ProfileEntry] = {}
    dev = torch.device(req.device)
    combos = [(m, t) for t in req.tp for m in req.mbs]
    for t in req.tp:  # all of them before the first measurement
        _check_tp(req.model, t)
    with progress(len(combos), desc=f"profile {req.model.name} on {req.device}", unit="entries",
                  stream=None if req.show_progress else io.StringIO()) as bar:
        for mbs, tp in combos:
            if tp == 1:
                res, included = measure_entry(req.model, mbs=mbs, seq_len=req.seq_len, tp=TPContext(), device=dev,
                                              reps=req.reps, depths=stack_depths(req.model, req.depths)), True
            elif dev.type == "cpu":
                res, included = _slowest(_run_tp_ranks(req, mbs=mbs, tp=tp)), True
            else:
                res, included = _measure_sharded_alone(req, mbs=mbs, tp=tp, dev=dev), False
            entries[(mbs, tp)] = ProfileEntry(res.embedding.times, res.layer.times, res.head.times,
                                              peak_mem_bytes=res.peak_mem_bytes, tp_comm_included=included,
                                              layer_by_depth=res.layer_by_depth,
                                              cpu_fraction=res.layer.cpu_fraction)
            bar.update()
    return KindProfile(kind=req.kind, model=req.model.name, seq_len=req.seq_len, entries=entries,
                       source=f"hethub profile on {device_description(req.device)}")


def _check_tp(model: ModelSpec, tp: int) -> None:
    from hethub.errors import SpecError

    if model.num_kv_heads % tp or model.ffn_hidden_size % tp:
        raise SpecError(f"--tp {tp} does not divide model {model.name!r} (num_kv_heads {model.num_kv_heads}, "
                        f"ffn_hidden_size {model.ffn_hidden_size}). Fix: use TP degrees dividing both.")


def _slowest(results: list[EntryResult]) -> EntryResult:
    """Per part, the rank with the longest forward + backward: a TP stage is as slow as its slowest rank."""
    def pick(attr: str):
        return max((getattr(r, attr) for r in results), key=lambda p: p.times.fwd_s + p.times.bwd_s)

    def depths() -> tuple[tuple[int, LayerTimes], ...]:
        ks = [k for k, _ in results[0].layer_by_depth]
        return tuple((k, max((dict(r.layer_by_depth)[k] for r in results), key=lambda t: t.fwd_s + t.bwd_s))
                     for k in ks)

    return EntryResult(pick("embedding"), pick("layer"), pick("head"), max(r.peak_mem_bytes for r in results),
                       depths())


def _measure_sharded_alone(req: ProfileRequest, *, mbs: int, tp: int, dev: torch.device) -> EntryResult:
    return measure_entry(req.model, mbs=mbs, seq_len=req.seq_len, tp=tp_alone(tp), device=dev, reps=req.reps,
                         depths=stack_depths(req.model, req.depths))


# ---- forked TP ranks (CPU, gloo) --------------------------------------------------------------------
def _tp_worker(rank: int, req: ProfileRequest, mbs: int, tp: int) -> EntryResult:
    from hethub.comm.communicator import Communicator

    ctx = TPContext(size=tp, rank=rank, group=tuple(range(tp)), comm=Communicator())
    return measure_entry(req.model, mbs=mbs, seq_len=req.seq_len, tp=ctx, device=torch.device("cpu"), reps=req.reps,
                         depths=stack_depths(req.model, req.depths))


def _run_tp_ranks(req: ProfileRequest, *, mbs: int, tp: int) -> list[EntryResult]:
    from hethub.comm.local_ranks import run_local_ranks

    return run_local_ranks(tp, _tp_worker, req, mbs, tp, timeout_s=_JOIN_TIMEOUT_S, threads=req.threads)


def profile_for_kinds(*, model: ModelSpec, kinds: tuple[str, ...], seq_len: int, mbs: tuple[int, ...],
                      tp: tuple[int, ...] = (1, 2), reps: Repetitions | None = None,
                      show: bool = True) -> ProfileSet:
    """Profile this host once and hand the result to every kind running on it.

    For local emulation all kinds are the same CPU; the predictor slows the emulated ones itself.
    """
    req = ProfileRequest(model=model, kind=kinds[0], seq_len=seq_len, mbs=mbs, tp=tp,
                         reps=reps or Repetitions(), show_progress=show)
    base = run_profile(req)
    return merge_profiles([replace(base, kind=k) for k in kinds])
