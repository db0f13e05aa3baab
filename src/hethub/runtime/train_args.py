"""The training flags, in one place: ``python -m hethub.train`` (each rank) and ``hethub train`` (the
launcher) declare the same options from here, so every flag works on ``hethub train`` itself and is
checked once, in the launcher, before any rank starts. No torch here: the launcher stays light.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hethub.argtypes import above_one, fraction, nonneg_float, nonneg_int, positive_float, positive_int
from hethub.errors import SpecError
from hethub.layout import DEFAULT_BUCKET_ELEMS
from hethub.rebalance.config import DEFAULT_MODE, MODES, RebalanceConfig
from hethub.runtime import train_config
from hethub.runtime.slowdown import parse_slowdown

# (flag, argparse keywords). Order = the order of --help.
_TRAINING: list[tuple[str, dict]] = [
    ("--steps", {"type": positive_int, "default": 10,
                 "help": "length of the whole run in optimizer steps; fixes the cosine LR schedule"}),
    ("--metrics", {"help": "write one JSON line per step to this file (created with its folder)"}),
    ("--lr", {"type": positive_float, "default": 3e-3, "help": "peak learning rate"}),
    ("--min-lr-ratio", {"type": fraction, "default": 0.1,
                        "help": "final LR as a fraction of --lr, 0..1"}),
    ("--warmup-steps", {"type": nonneg_int, "default": None,
                        "help": "linear warm-up steps (default: 10%% of --steps)"}),
    ("--weight-decay", {"type": nonneg_float, "default": 0.1, "help": "AdamW weight decay"}),
    ("--grad-clip", {"type": nonneg_float, "default": 1.0,
                     "help": "global gradient-norm limit; 0 disables"}),
    ("--seed", {"type": int, "default": 0, "help": "parameter initialisation seed"}),
    ("--trace", {"action": "store_true",
                 "help": "log every micro-batch's forward/backward interval per rank (for the report's timeline)"}),
    ("--grad-bucket-elems", {"type": positive_int, "default": DEFAULT_BUCKET_ELEMS, "metavar": "N",
                             "help": "data-parallel gradient bucket size in elements (Megatron's default: 40M); "
                                     "each bucket is reduced as soon as its gradients are final in the last backward"}),
    ("--no-overlap-grad-reduce", {"action": "store_true",
                                  "help": "start every gradient bucket's reduction after the whole backward instead "
                                          "of inside it"}),
    ("--compile", {"action": "store_true",
                   "help": "torch.compile each decoder block (needs a C++ compiler on the host; the first steps "
                           "pay the compilation)"}),
    ("--tokenizer", {"help": "a tokenizer.json (or a folder holding one), or a local Hugging Face tokenizer name "
                             "(default: bytes)"}),
    ("--timeout-s", {"type": positive_float, "default": 600.0,
                     "help": "collective timeout in seconds"}),
]
_CHECKPOINTS: list[tuple[str, dict]] = [
    ("--checkpoint-dir", {"help": "save checkpoints here (always at the end of the run); one run at a time"}),
    ("--checkpoint-every", {"type": nonneg_int, "default": 0, "metavar": "N",
                            "help": "also save every N steps"}),
    ("--keep-checkpoints", {"type": nonneg_int, "default": 3, "metavar": "K",
                            "help": "keep the newest K (0: all; default: 3)"}),
    ("--resume", {"metavar": "DIR|auto",
                  "help": "continue from a checkpoint; auto: the newest in --checkpoint-dir if there is one"}),
    ("--start-over", {"action": "store_true",
                      "help": "if --checkpoint-dir holds another run's checkpoints, move them aside into "
                              "DIR/previous/RUN/ and start a new run (without it such a directory is refused unless "
                              "resumed)"}),
    ("--checkpoint-sync", {"action": "store_true",
                           "help": "write checkpoints on the training thread (training waits for the files) instead "
                                   "of in the background after a device-to-host copy"}),
    ("--no-checkpoint-fallback", {"action": "store_true",
                                  "help": "stop if the newest checkpoint is corrupt instead of resuming from the "
                                          "newest valid one (with a warning)"}),
    ("--allow-schedule-change", {"action": "store_true",
                                 "help": "resume even if --steps/--lr/--warmup-steps/--min-lr-ratio differ from "
                                         "the checkpoint's (the LR schedule changes from there on)"}),
    ("--replan-on-shrink", {"action": "store_true",
                            "help": "if fewer processes than the plan's devices start, plan for them and resume"}),
]
_REBALANCE: list[tuple[str, dict]] = [
    ("--rebalance", {"choices": MODES, "default": DEFAULT_MODE,
                     "help": "follow measured speed without a restart: off (measure and name stragglers only), shares "
                             "(re-split the micro-batch counts among replicas), layers (also move a layer between "
                             "adjacent stages where that pays more)"}),
    ("--rebalance-min-gain", {"type": fraction, "default": RebalanceConfig.min_gain, "metavar": "F",
                              "help": "change only when the step is predicted to get this fraction faster"}),
    ("--rebalance-patience", {"type": positive_int, "default": RebalanceConfig.patience, "metavar": "N",
                              "help": "... on N consecutive steps"}),
    ("--straggler-factor", {"type": above_one, "default": RebalanceConfig.straggler_factor, "metavar": "X",
                            "help": "name a rank a straggler when its time per micro-batch is X times its prediction"}),
    ("--emulate-slowdown", {"type": parse_slowdown, "action": "append", "default": None,
                            "metavar": "RANK_OR_KIND:FACTOR@STEP",
                            "help": "local emulation: from STEP on, slow one rank (by number) or every rank of a kind "
                                    "by FACTOR, e.g. 3:2@10 (repeatable)"}),
]
FLAGS = [flag for flag, _ in _TRAINING + _CHECKPOINTS + _REBALANCE]


def add_train_arguments(ap: argparse.ArgumentParser) -> None:
    """Every training flag (not ``--plan``), with its type check and default."""
    for flag, kw in _TRAINING:
        ap.add_argument(flag, **kw)
    ck = ap.add_argument_group("checkpoints and restarts (docs/reliability.md)")
    for flag, kw in _CHECKPOINTS:
        ck.add_argument(flag, **kw)
    rb = ap.add_argument_group("online re-balancing (docs/rebalance.md)")
    for flag, kw in _REBALANCE:
        rb.add_argument(flag, **kw)


def check_train_args(args: argparse.Namespace) -> None:
    """Checks that need several flags at once; SpecError (exit 2) naming the flags."""
    if (args.resume == "auto" or args.checkpoint_every or args.replan_on_shrink or args.start_over) \
            and not args.checkpoint_dir:
        raise SpecError("--resume auto, --checkpoint-every, --replan-on-shrink and --start-over need "
                        "--checkpoint-dir. Fix: add --checkpoint-dir DIR.")
    if args.start_over and args.resume:
        raise SpecError(f"--start-over and --resume {args.resume} contradict each other: one starts a new run, the "
                        "other continues one. Fix: keep one.")
    if args.warmup_steps is not None and args.warmup_steps > args.steps:
        raise SpecError(f"--warmup-steps {args.warmup_steps} is longer than the run (--steps {args.steps}). Fix: "
                        "use fewer warm-up steps.")
    if args.checkpoint_every and args.checkpoint_every >= args.steps:
        raise SpecError(f"--checkpoint-every {args.checkpoint_every} >= --steps {args.steps}: no periodic save "
                        "would happen (the end of the run always saves). Fix: a smaller N, or leave it out.")


def rank_parser() -> argparse.ArgumentParser:
    """What ``python -m hethub.train`` parses: --plan, the training flags, and the config file's flags."""
    from hethub.argtypes import HelpFormatter

    ap = argparse.ArgumentParser(prog="python -m hethub.train", formatter_class=HelpFormatter,
                                 description="One training rank (run under torchrun; 'hethub train' starts them).")
    ap.add_argument("--plan", help="plan JSON written by 'hethub plan' (required, here or in --config)")
    add_train_arguments(ap)
    train_config.add_arguments(ap)
    return ap


def parse_rank_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check a rank's arguments (a --config file's values are defaults the flags override).
    The launcher calls this too, on the arguments it will hand the ranks, so bad values stop there."""
    ap = rank_parser()
    args = train_config.parse_with_config(ap, argv)
    if not args.plan:
        ap.error("--plan is required (or [plan] file in --config)")
    check_train_args(args)  # SpecError (exit 2) naming the flags, printed as one paragraph
    return args


def train_argv(args: argparse.Namespace) -> list[str]:
    """The rank flags of ``args`` (a launcher's namespace) that differ from their defaults, as
    ``python -m hethub.train`` arguments (--plan, --steps and --metrics excluded: the launcher passes
    those itself)."""
    out: list[str] = []
    for action in rank_parser()._actions:
        if not action.option_strings or action.dest in ("help", "plan", "steps", "metrics"):
            continue
        v = getattr(args, action.dest, action.default)
        if v == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._AppendAction):
            for item in v:
                out += [flag, str(item)]
        elif isinstance(v, bool):
            out.append(flag)
        elif isinstance(v, list | tuple):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def done_marker(error_dir: str | Path, rank: int) -> Path:
    """The file rank ``rank`` leaves in ``error_dir`` once every rank has finished training (after the
    final barrier): a failing exit with every marker present and no rank error came from teardown."""
    return Path(error_dir, f"rank-{rank}.done")
