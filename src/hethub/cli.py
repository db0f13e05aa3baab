"""The `hethub` command line: the parser of every command (each defined in ``hethub.commands``,
``plan`` and ``predict`` registered first, then the others), ``hethub models`` and the error and exit
handling. Parsing and printing only; the work lives in the packages.

Every input error is a HethubError: it is printed as one paragraph on stderr and the process exits
with the error's code (see docs/cli.md). Heavy imports (torch) happen inside the commands that need
them, so planning stays fast and works without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from hethub import __version__
from hethub.argtypes import HelpFormatter
from hethub.commands import plan as plan_command
from hethub.commands import predict as predict_command
from hethub.commands.plan import plan_config
from hethub.errors import HethubError, missing_extra

__all__ = ["build_parser", "cmd_models", "main", "plan_config"]  # plan_config: bench/planner_scale.py

EXIT_INTERRUPTED = 130


def cmd_models(args: argparse.Namespace) -> int:
    from hethub.spec.model import PRESETS

    if args.json:
        print(json.dumps({name: m.to_dict() | {"num_params": m.num_params} for name, m in PRESETS.items()}, indent=2))
        return 0
    print(f"{'preset':<14} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'ffn':>6} "
          f"{'vocab':>7} {'max seq':>7}  arch")
    for name, m in PRESETS.items():
        n = m.num_params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(f"{name:<14} {size:>8} {m.num_layers:>6} {m.hidden_size:>6} {m.num_heads:>5} {m.num_kv_heads:>3} "
              f"{m.ffn_hidden_size:>6} {m.vocab_size:>7} {m.max_seq_len:>7}  {m.arch}")
    print("\nAny --model also takes the path of a Hugging Face config.json (llama- or gpt-style).")
    return 0


# Shown at the end of each command's --help.
EXAMPLES = {
    "plan": ["hethub plan --cluster examples/clusters/a100-v100-32.toml --model llama-3-8b --global-batch 512 "
             "--seq-len 2048 --out plan.json",
             "hethub plan --cluster examples/clusters/local-cpu.toml --model small --global-batch 16 --seq-len 128 "
             "--precision fp32 --profiles profiles/ --compare"],
    "predict": ["hethub predict --plan plan.json", "hethub predict --plan local.json --profiles profiles/ "
                "--links links.json --json"],
    "report": ["hethub report --plan local.json --metrics run.jsonl --out report/"],
    "profile": ["hethub profile --model small --mbs 1,2 --seq-len 128 --kind cpu-fast,cpu-slow --out profiles/",
                "hethub profile --model llama-3-8b --device cuda --mbs 1,2,4 --tp 1,2 --seq-len 2048 "
                "--kind a100-40gb --out profiles/a100-40gb.json"],
    "import-plan": ["hethub import-plan --format sailor examples/sailor/opt350m-a100-v100-plan.json "
                    "--cluster examples/clusters/a100-v100-32.toml --model opt-350m --out imported.json"],
    "export-plan": ["hethub export-plan --format sailor plan.json --out sailor-plan.json"],
    "demo": ["hethub demo", "hethub demo --steps 10 --out runs/quick"],
    "bench": ["hethub bench comm --cluster examples/clusters/local-cpu.toml --out links.json"],
    "models": ["hethub models", "hethub models --json"],
}


# ---- parser ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hethub", description="Plan, predict and train LLMs on mixed accelerators.",
                                epilog="Exit codes and every command's flags: docs/cli.md. Start with the README's "
                                       "tour, or 'hethub demo'.", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"hethub {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan_command.register(sub)
    predict_command.register(sub)

    sp = sub.add_parser("models", help="list the model presets --model accepts")
    sp.add_argument("--json", action="store_true", help="print one JSON object: preset -> shape")
    sp.set_defaults(func=cmd_models)

    for register in _extra_commands():
        register(sub)
    for name, sp in sub.choices.items():
        _teach(sp, EXAMPLES.get(name, []))
    return p


def _teach(sp: argparse.ArgumentParser, examples: list[str]) -> None:
    """Defaults in every option's help and examples at the end, for a command and its subcommands."""
    sp.formatter_class = HelpFormatter
    if examples and not sp.epilog:
        sp.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    for action in sp._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _teach(child, [])


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """The commands after ``plan``, ``predict`` and ``models``, in their ``--help`` order."""
    from hethub.commands import bench, export, interop, launch, profile, report, run

    return [run.register, launch.register, report.register, interop.register, profile.register, bench.register,
            export.register]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and "--" in argv:
        # Older spelling: training flags after '--'. They are flags of 'hethub train' itself now.
        argv.remove("--")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HethubError as err:
        print(f"hethub {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except ModuleNotFoundError as err:
        # Planning needs only the core; training, profiling and benchmarks need the train extra.
        missing = missing_extra(err, what=f"'hethub {args.command}'")
        if missing is None:
            raise
        print(f"hethub {args.command}: error: {missing}", file=sys.stderr)
        return missing.exit_code
    except KeyboardInterrupt:
        print("hethub: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
