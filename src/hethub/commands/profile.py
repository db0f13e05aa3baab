"""`hethub profile`: measure the real layers on this machine and write a hethub profile file."""

from __future__ import annotations

import argparse
from pathlib import Path

from hethub.argtypes import nonneg_int, positive_int


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return tuple(dict.fromkeys(vals))


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    if not kinds:
        raise argparse.ArgumentTypeError(f"expected one or more kind names separated by commas, got {text!r}")
    return kinds


def output_paths(out: str, kinds: tuple[str, ...]) -> dict[str, Path]:
    """Where each kind's profile goes: ``--out`` itself for one kind unless it names a folder (ends
    with '/' or exists as one); ``OUT/KIND.json`` for several kinds. Made and checked before measuring."""
    from hethub.errors import SpecError
    from hethub.outfiles import prepare_output

    folder = out.endswith(("/", "\\")) or Path(out).is_dir()
    if len(kinds) > 1 and not folder:
        raise SpecError(f"--out {out} names one file, but --kind lists {len(kinds)} kinds. Fix: pass a folder, "
                        f"e.g. --out {Path(out).parent / 'profiles'}/ (one KIND.json per kind).")
    if folder:
        prepare_output(out, is_dir=True)
        return {k: Path(out) / f"{k}.json" for k in kinds}
    return {kinds[0]: prepare_output(out)}


def cmd_profile(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hethub.errors import SpecError
    from hethub.profile.format import write_profile
    from hethub.profiler.layers import Repetitions
    from hethub.profiler.runner import ProfileRequest, device_description, run_profile
    from hethub.spec.model import get_model

    model = get_model(args.model)
    seq_len = args.seq_len or model.max_seq_len
    if seq_len > model.max_seq_len:
        raise SpecError(f"--seq-len {seq_len} exceeds model {model.name!r}'s max_seq_len {model.max_seq_len}. "
                        "Fix: use a shorter sequence length.")
    _check_device(args.device)
    # Before the measurement: a missing or read-only output folder must not cost the minute it takes.
    outs = output_paths(args.out, args.kind)
    req = ProfileRequest(model=model, kind=args.kind[0], seq_len=seq_len, mbs=args.mbs, tp=args.tp,
                         device=args.device, threads=args.threads,
                         reps=Repetitions(warmup=args.warmup, repeats=args.repeats))
    prof = run_profile(req)
    host = None
    if (args.wake_penalty or args.speed_spread or args.split_backward or args.corun) and args.device == "cpu":
        from hethub.emulation.measure.effects import measure_host_effects

        host = measure_host_effects(model, mbs=args.mbs, seq_len=seq_len, wake_penalty=args.wake_penalty,
                                    speed_spread=args.speed_spread, split_backward=args.split_backward,
                                    corun=args.corun)
    for kind, path in outs.items():
        write_profile(path, replace(prof, kind=kind), model=model, device=device_description(args.device), host=host)
    where = ", ".join(f"{k} -> {p}" for k, p in outs.items())
    print(f"profile of {model.name} (seq_len {seq_len}) written: {where}")
    if len(outs) > 1:
        print("  (one measurement of this host for every kind: the predictor slows emulated kinds itself)")
    for (mbs, tp), e in sorted(prof.entries.items()):
        print(f"  mbs {mbs} tp {tp}: layer fwd {e.layer.fwd_s * 1e3:.2f} ms  bwd {e.layer.bwd_s * 1e3:.2f} ms  "
              f"update {e.layer.update_s * 1e3:.2f} ms  head fwd+bwd {(e.head.fwd_s + e.head.bwd_s) * 1e3:.2f} ms")
    if host is not None and host.wake_penalty:
        print("  wake penalty (extra CPU time after idle): "
              + ", ".join(f"{x * 1e3:.2f} ms after {g * 1e3:.0f} ms" for g, x in host.wake_penalty))
    if host is not None and host.split_backward:
        print(f"  split backward (ZB-H1): B {host.split_backward[0]:.2f}, W {host.split_backward[1]:.2f} "
              "of one whole backward")
    if host is not None and host.corun:
        print("  co-run factor (a chunk's CPU time with every core busy / alone): "
              + ", ".join(f"mbs {m} {f:.3f}" for m, f in host.corun))
    if host is not None and host.speed_spread:
        print("  core speed spread (sigma per window): "
              + ", ".join(f"{sp.sigma:.3f} over {sp.window_s:g} s" for sp in host.speed_spread))
    return 0


def _check_device(device: str) -> None:
    import torch

    from hethub.errors import RuntimeSetupError

    if device == "cpu":
        return
    if device.startswith("cuda") and torch.cuda.is_available():
        return  # ROCm builds of torch answer to "cuda" too
    raise RuntimeSetupError(f"--device {device!r} is not available here (torch {torch.__version__}). "
                            "Fix: use --device cpu, or cuda / cuda:N on a machine with a GPU.")


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("profile", help="measure layer times on this machine and write a profile file")
    sp.add_argument("--model", required=True, help="preset name or Hugging Face config.json")
    sp.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (ROCm: cuda)")
    sp.add_argument("--mbs", type=_int_list, default=(1,), help="micro-batch sizes, e.g. 1,2,4")
    sp.add_argument("--tp", type=_int_list, default=(1,), help="TP degrees, e.g. 1,2 (CPU: real gloo ranks)")
    sp.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's max_seq_len")
    sp.add_argument("--kind", type=_kinds, default=("cpu",),
                    help="device kind the profile is for, as in the cluster file (default: cpu); several, "
                         "comma-separated (local emulation: one CPU for every kind), write OUT/KIND.json each")
    sp.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads per rank (the runtime uses 1 on CPU)")
    sp.add_argument("--warmup", type=nonneg_int, default=3, help="unmeasured repetitions per part")
    sp.add_argument("--repeats", type=positive_int, default=10, help="measured repetitions (median) per part")
    sp.add_argument("--out", required=True,
                    help="profile JSON file to write, or a folder (ending in '/') for one KIND.json per kind; "
                         "created before measuring")
    sp.add_argument("--wake-penalty", action="store_true",
                    help="local emulation hosts: also measure the extra CPU time of work after idle gaps "
                         "(docs/profiles.md); ~4 s")
    sp.add_argument("--speed-spread", action="store_true",
                    help="local emulation hosts: also measure how much each core's speed wanders against the "
                         "others' (stragglers; docs/profiles.md); ~5 s")
    sp.add_argument("--split-backward", action="store_true",
                    help="local emulation hosts: also measure the split backward's B and W (ZB-H1) against one "
                         "whole backward (docs/profiles.md); ~2 s")
    sp.add_argument("--corun", action="store_true",
                    help="local emulation hosts: also measure the co-run factor per micro-batch size, how much "
                         "slower a chunk runs while every core computes (docs/profiles.md); ~5 s per size")
    sp.set_defaults(func=cmd_profile)
