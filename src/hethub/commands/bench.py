"""`hethub bench comm`: measure a cluster's link classes here and write a links profile.

The profile (see hethub.predict.links) replaces the cluster file's nominal link numbers in the
predictor. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_bytes(text: str) -> int:
    """'4096', '64KiB', '256 MiB', '1GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64KiB or 256MiB, got {text!r}")
    n = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def cmd_bench_comm(args: argparse.Namespace) -> int:
    from hethub.emulation.measure.collbench import measure_host_links
    from hethub.errors import SpecError
    from hethub.predict.links import write_links_profile
    from hethub.spec.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    if args.min_bytes > args.max_bytes:
        raise SpecError(f"--min-bytes {args.min_bytes} exceeds --max-bytes {args.max_bytes}. Fix: swap them.")
    try:
        profile = measure_host_links(cluster, max_bytes=args.max_bytes, min_bytes=args.min_bytes,
                                     show_progress=not args.json)
    except ValueError as err:
        raise SpecError(f"{args.cluster}: {err}. Fix: describe at least two devices.") from None
    out = Path(args.out)
    write_links_profile(profile, out)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
        return 0
    print(f"cluster {cluster.name}: {len(profile.links)} link classes, messages "
          f"{_fmt_bytes(args.min_bytes)} .. {_fmt_bytes(args.max_bytes)}, {profile.meta['seconds']} s")
    print(f"note: {profile.note}")
    print(f"{'link class':<28} {'latency':>10} {'bandwidth':>12}   one-way time by message size")
    for name, fit in profile.links.items():
        times = "  ".join(f"{_fmt_bytes(n)}:{t * 1e3:.3g}ms" for n, t in fit.samples)
        print(f"{name:<28} {fit.latency_s * 1e6:>8.1f}us {fit.bw_bytes_per_s / 1e9:>8.3f} GB/s   {times}")
    for p, fit in sorted(profile.host_allreduce.items()):
        times = "  ".join(f"{_fmt_bytes(n)}:{t * 1e3:.3g}ms" for n, t in fit.samples)
        label = f"host all-reduce, {p} ranks"
        print(f"{label:<28} {fit.latency_s * 1e6:>8.1f}us {fit.bw_bytes_per_s / 1e9:>8.3f} GB/s   {times}")
    print(f"\nlinks profile written to {out} (use it: hethub plan|predict ... --links {out})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("bench", help="measure this machine: communication links")
    bench_sub = sp.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    cp = bench_sub.add_parser("comm", help="latency and bandwidth of each link class of a cluster -> links profile")
    cp.add_argument("--cluster", required=True, help="cluster TOML file whose link classes are measured")
    cp.add_argument("--out", default="links.json", help="links profile to write (default: links.json)")
    cp.add_argument("--max-bytes", type=parse_bytes, default=256 * 1024**2,
                    help="largest message (default 256MiB); sizes go up in powers of 4")
    cp.add_argument("--min-bytes", type=parse_bytes, default=4096, help="smallest message (default 4KiB)")
    cp.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    cp.set_defaults(func=cmd_bench_comm)
