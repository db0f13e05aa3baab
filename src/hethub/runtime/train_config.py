"""A training run described in one TOML file (``--config run.toml``); command-line flags override it.

Sections and keys (every key optional; paths are relative to the current directory)::

    [plan]        file | cluster, global_batch, seq_len, strategy, schedule, precision, out, model
    [model]       init_from (a Hugging Face folder), create_from_config (see below)
    [train]       steps, seed, timeout_s, trace
    [optim]       lr, min_lr_ratio, warmup_steps, weight_decay, grad_clip
    [data]        files (list of paths/globs), format, text_field, eos_token, cache_dir, eval_sequences,
                  shuffle_seed
    [tokenizer]   path (a tokenizer.json or a folder holding one; default: bytes)
    [checkpoint]  dir, every, keep, resume
    [logging]     metrics (JSONL), tensorboard (a log directory; used when tensorboard is installed)
    [eval]        every, batches
    [export]      hf_dir (write the final checkpoint as a Hugging Face folder)

Each rank reads the keys that are flags of ``python -m hethub.train`` (table ``FLAGS``). The keys only
a launcher can act on — making a plan from ``[plan] cluster`` and writing a random-weight model
folder at ``init_from`` from ``create_from_config`` when it does not exist yet — are done by
``hethub train --config`` before it starts the ranks (``hethub.commands.launch_config``).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from hethub.errors import SpecError

# (section, key) -> destination of python -m hethub.train's argument parser
FLAGS: dict[tuple[str, str], str] = {
    ("plan", "file"): "plan",
    ("model", "init_from"): "init_from",
    ("train", "steps"): "steps", ("train", "seed"): "seed", ("train", "timeout_s"): "timeout_s",
    ("train", "trace"): "trace",
    ("optim", "lr"): "lr", ("optim", "min_lr_ratio"): "min_lr_ratio", ("optim", "warmup_steps"): "warmup_steps",
    ("optim", "weight_decay"): "weight_decay", ("optim", "grad_clip"): "grad_clip",
    ("data", "files"): "data", ("data", "format"): "data_format", ("data", "text_field"): "text_field",
    ("data", "eos_token"): "eos_token", ("data", "cache_dir"): "data_cache",
    ("data", "eval_sequences"): "eval_sequences", ("data", "shuffle_seed"): "shuffle_seed",
    ("tokenizer", "path"): "tokenizer",
    ("checkpoint", "dir"): "checkpoint_dir", ("checkpoint", "every"): "checkpoint_every",
    ("checkpoint", "keep"): "keep_checkpoints", ("checkpoint", "resume"): "resume",
    ("logging", "metrics"): "metrics", ("logging", "tensorboard"): "tensorboard",
    ("eval", "every"): "eval_every", ("eval", "batches"): "eval_batches",
    ("export", "hf_dir"): "export_hf",
}
LAUNCHER_KEYS = {("plan", k) for k in ("cluster", "model", "global_batch", "seq_len", "strategy", "schedule",
                                       "precision", "out")} | {("model", "create_from_config")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of Hugging Face models, files as data, evaluation, TensorBoard and the config file."""
    ap.add_argument("--config", help="training config TOML (docs/models-and-data.md); flags override it")
    g = ap.add_argument_group("models and data (docs/models-and-data.md)")
    g.add_argument("--init-from", metavar="DIR", help="start from a local Hugging Face model folder "
                   "(config.json + *.safetensors); the plan's model must be that folder's config.json")
    g.add_argument("--data", nargs="+", metavar="FILE", help="train on these text/JSONL/Parquet files or globs "
                   "(default: the Python standard library's source, byte-level)")
    g.add_argument("--data-format", default="auto", choices=["auto", "text", "jsonl", "parquet"],
                   help="how to read --data; auto: by each file's extension (.jsonl or .json: JSONL, .parquet: "
                        "Parquet, else text)")
    g.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    g.add_argument("--eos-token", help="token placed between packed documents (default: the tokenizer's own)")
    g.add_argument("--data-cache", default="runs/token-cache", help="where tokenised data is cached")
    g.add_argument("--eval-sequences", type=int, default=0, help="sequences held out at the end of the data")
    g.add_argument("--shuffle-seed", type=int, default=0, help="seed of the per-epoch order; -1: file order")
    g.add_argument("--eval-every", type=int, default=0, metavar="N", help="held-out loss every N steps")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out global batches per evaluation")
    g.add_argument("--tensorboard", metavar="DIR", help="also log metrics to TensorBoard here (if installed)")
    g.add_argument("--export-hf", metavar="DIR", help="at the end, write the final checkpoint as a Hugging Face "
                   "folder (needs --checkpoint-dir)")


def read(path: str | Path) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"training config '{p}' does not exist. Fix: pass the path of a TOML file "
                                "(examples/train/finetune-small.toml is one).")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SpecError(f"{p}: not valid TOML ({err}). Fix: correct the file.") from None
    known = {s for s, _ in FLAGS} | {s for s, _ in LAUNCHER_KEYS}
    for section, table in data.items():
        if section not in known or not isinstance(table, dict):
            raise SpecError(f"{p}: section [{section}] is not a training config section. Fix: use "
                                    f"{', '.join(f'[{s}]' for s in sorted(known))}.")
        for key in table:
            if (section, key) not in FLAGS and (section, key) not in LAUNCHER_KEYS:
                keys = sorted(k for s, k in (*FLAGS, *LAUNCHER_KEYS) if s == section)
                raise SpecError(f"{p}: field '{section}.{key}' is not known. Fix: use one of "
                                        f"{', '.join(keys)}.")
    return data


def _checked(value: Any, action: argparse.Action, *, where: str) -> Any:
    """``value`` as the flag would have parsed it, or an error naming the field."""
    def bad(want: str) -> SpecError:
        return SpecError(f"{where} must be {want}, got {value!r}. Fix: write {want}.")

    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.nargs in ("+", "*"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return value
    want = action.type or str
    if want not in (int, float, str) and callable(want):  # a checking type (hethub.argtypes): numbers only
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad("a number (without quotes)")
        try:
            return want(str(value))
        except argparse.ArgumentTypeError as err:
            raise SpecError(f"{where}: {err}. Fix: correct the value.") from None
    if want is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad("an integer (without quotes)")
    if want is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise bad("a number (without quotes)")
    if want is str and not isinstance(value, str):
        raise bad("a string")
    if action.choices is not None and value not in action.choices:
        raise bad(f"one of {', '.join(map(str, action.choices))}")
    return want(value) if want in (int, float) else value


def defaults_from(ap: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """Parser defaults from the config file at ``path`` (launcher-only keys skipped)."""
    data = read(path)
    actions = {a.dest: a for a in ap._actions}
    out: dict[str, Any] = {}
    for (section, key), dest in FLAGS.items():
        if key in data.get(section, {}) and dest in actions:
            out[dest] = _checked(data[section][key], actions[dest], where=f"{path}: field '{section}.{key}'")
    return out


def parse_with_config(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; with ``--config`` the file's values become the defaults the flags override."""
    pre, _ = ap.parse_known_args(argv)
    if getattr(pre, "config", None):
        ap.set_defaults(**defaults_from(ap, pre.config))  # SpecError naming the field: no usage text
    args = ap.parse_args(argv)
    if args.shuffle_seed is not None and args.shuffle_seed < 0:
        args.shuffle_seed = None
    for dest in ("eval_sequences", "eval_every", "eval_batches"):
        if getattr(args, dest) < 0:
            ap.error(f"--{dest.replace('_', '-')} must be >= 0")
    if args.export_hf and not args.checkpoint_dir:
        ap.error("--export-hf needs --checkpoint-dir (the export is made from the final checkpoint)")
    if args.eval_every and not args.eval_sequences:
        ap.error("--eval-every needs held-out data: set --eval-sequences (data.eval_sequences)")
    return args

