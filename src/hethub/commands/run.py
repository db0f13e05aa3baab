"""`hethub train` (a local torchrun launch of a plan) and `hethub demo` (the built-in local default)."""

from __future__ import annotations

import argparse


def cmd_train(args: argparse.Namespace) -> int:
    from hethub.errors import RuntimeSetupError, require_extra

    require_extra("torch", what="'hethub train'")  # the ranks are torchrun's processes, not this one
    from hethub.plan import Plan
    from hethub.predict.fit import check_memory_fit
    from hethub.predict.predictor import predict
    from hethub.runtime.launch import launch_local

    extra = list(args.train_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.config:  # the config's launcher part: model folder, plan; the ranks read the rest
        from hethub.commands.launch_config import prepare_launch

        got = prepare_launch(args.config)
        args.plan = args.plan or got["plan"]
        args.steps = args.steps or got["steps"]
        args.metrics = args.metrics or got["metrics"]
        extra = ["--config", args.config, *extra]
    if not args.plan:
        raise RuntimeSetupError("hethub train needs --plan (or --config with a [plan] section). Fix: pass one.")
    args.steps = args.steps or 20
    plan = Plan.load(args.plan)
    check_memory_fit(plan, predict(plan))
    print(f"launching {plan.world_size} local ranks for {args.steps} steps (torchrun --standalone)", flush=True)
    proc = launch_local(args.plan, nproc=plan.world_size, steps=args.steps, metrics=args.metrics, extra_args=extra)
    if proc.returncode != 0:
        raise RuntimeSetupError(f"training exited with code {proc.returncode} (its output is above). Fix: read the "
                                "first error the ranks printed.")
    if args.metrics:
        print(f"metrics written to {args.metrics}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hethub.demo import DemoConfig, run_demo
    from hethub.errors import require_extra

    require_extra("torch", what="'hethub demo'")

    run_demo(DemoConfig(cluster=args.cluster, steps=args.steps, out_dir=args.out))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("train", help="train a plan with local processes (torchrun underneath)")
    sp.add_argument("--plan", help="plan JSON (required unless --config gives one)")
    sp.add_argument("--config", help="training config TOML (docs/models-and-data.md); flags override it")
    sp.add_argument("--steps", type=int, default=None, help="default: the config's train.steps, else 20")
    sp.add_argument("--metrics", help="write per-step metrics as JSON lines")
    sp.add_argument("train_args", nargs=argparse.REMAINDER,
                    help="after '--': options for 'python -m hethub.train' (e.g. -- --lr 1e-3 --seed 1)")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("demo", help="plan and train a small model on local CPU ranks (the built-in default)")
    sp.add_argument("--cluster", default=None, help="default: examples/clusters/local-cpu.toml (embedded copy)")
    sp.add_argument("--steps", type=int, default=30)
    sp.add_argument("--out", default="runs/demo", help="where plans, metrics and the report go")
    sp.set_defaults(func=cmd_demo)
