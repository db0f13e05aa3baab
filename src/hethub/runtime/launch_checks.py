"""What ``hethub train`` checks before any rank starts, beyond the flags, the plan's memory and the host
(``host_check``): everything that would otherwise fail inside every rank, each with one clear error
(and the exit code of docs/cli.md) instead of a traceback per rank.

- the plan's optimizer sharding against its replicas (a ZeRO-1 plan needs every sharded group to have
  two holders or more: PlanError, exit 3);
- outputs: --metrics, --checkpoint-dir, --export-hf, --tensorboard, --data-cache (writable, a folder
  where one is needed, names within the filesystem's limit: exit 1);
- inputs: --data (present, not empty, readable as its format), --tokenizer (a path that exists),
  --init-from (config.json is the plan's model, every shard present and complete, shapes as
  config.json says): exit 2, or 3 for a model folder of another model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hethub.errors import PlanError, SpecError
from hethub.layout import single_holder_units
from hethub.outfiles import prepare_output
from hethub.plan import Plan


def check_before_launch(plan: Plan, args: argparse.Namespace, *, plan_path: str) -> None:
    check_sharding(plan, plan_path=plan_path)
    check_outputs(args)
    check_inputs(plan, args)


def check_sharding(plan: Plan, *, plan_path: str) -> None:
    """A sharded optimizer needs, for every parameter, two data-parallel holders or more: the runtime
    builds its reduce-scatter groups from them, and one holder has nothing to share."""
    if not plan.sharded_optimizer:
        return
    alone = single_holder_units(plan)
    if not alone:
        return
    raise PlanError(f"{plan_path}: field 'training.optimizer_sharding' is {plan.optimizer_sharding!r}, but "
                    f"{len(alone)} parameter group(s) ({', '.join(alone[:3])}{', ...' if len(alone) > 3 else ''}) "
                    "have a single data-parallel holder (one replica): there is nothing to shard them across. "
                    "Fix: set training.optimizer_sharding to \"none\", or plan with replicas "
                    "(hethub plan --optimizer-sharding auto chooses).")


def check_outputs(args: argparse.Namespace) -> None:
    if args.metrics:
        prepare_output(args.metrics, flag="--metrics")
    for flag, value in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard),
                        ("--data-cache", args.data_cache if args.data else None)):
        if value:
            prepare_output(value, flag=flag, is_dir=True)
    if args.export_hf:
        from hethub.runtime.hf_export import check_export_target

        check_export_target(args.export_hf, overwrite=False, flag="--export-hf")


def check_inputs(plan: Plan, args: argparse.Namespace) -> None:
    if args.data:
        from hethub.runtime.dataset import DataConfig
        from hethub.runtime.dataset import check_inputs as check_data

        check_data(DataConfig(files=tuple(args.data), format=args.data_format, text_field=args.text_field))
    if args.tokenizer:
        tok = Path(args.tokenizer)
        if (tok.suffix == ".json" or tok.is_absolute() or len(tok.parts) > 1) and not tok.exists():
            raise SpecError(f"--tokenizer {args.tokenizer} does not exist. Fix: pass a tokenizer.json, a folder "
                            "holding one, or a Hugging Face tokenizer name available on this machine.")
    if args.init_from:
        from hethub.runtime.hf_io import check_folder

        check_folder(plan.model, args.init_from, seq_len=plan.seq_len)
