"""`hethub export --format hf`: a hethub checkpoint of any plan as a Hugging Face model folder."""

from __future__ import annotations

import argparse


def _size(text: str) -> int:
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    t = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit) and t[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(unit)]) * units[unit])
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"expected a size such as 2GB, 500MB or 1000000, got {text!r}")


def cmd_export(args: argparse.Namespace) -> int:
    from hethub.runtime.hf_export import exported_files
    from hethub.runtime.hf_io import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite)
    print(f"wrote {out}: {', '.join(exported_files(out))}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("export", help="write a training checkpoint as a Hugging Face model folder")
    sp.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + sharded safetensors + index")
    sp.add_argument("--checkpoint", required=True,
                    help="a checkpoint directory (--checkpoint-dir of a run: its newest step) or one step-NNNNNN")
    sp.add_argument("--out", required=True, help="folder to write (created; must be empty unless --overwrite)")
    sp.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty --out: the model files of an earlier export there are replaced, "
                         "other files kept")
    sp.add_argument("--max-shard-size", type=_size, default=2 * 10**9, help="largest safetensors file (default 2GB)")
    sp.set_defaults(func=cmd_export)
