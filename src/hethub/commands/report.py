"""`hethub report`: pictures, Chrome trace and summary of a plan (and of a run, given its metrics)."""

from __future__ import annotations

import argparse


def cmd_report(args: argparse.Namespace) -> int:
    from hethub.commands.host import host_for
    from hethub.outfiles import prepare_output
    from hethub.plan import Plan
    from hethub.predict.predictor import predict
    from hethub.report import write_report

    plan = Plan.load(args.plan)
    prepare_output(args.out, is_dir=True)
    if args.metrics:  # read (and checked against the plan) before the prediction's work
        from dataclasses import replace

        from hethub.report import read_metrics
        from hethub.schedules import DEFAULT_P2P

        read_metrics(args.metrics, plan=plan)
        if plan.p2p != DEFAULT_P2P:
            # The metrics come from hethub's runtime, which always sends asynchronously: compare the
            # run with what the predictor says of that runtime, not of the one the plan was made for.
            print(f"note: the plan says training.p2p = {plan.p2p!r} (another runtime's sends); the run's metrics "
                  f"come from hethub's runtime, so the report predicts it with {DEFAULT_P2P!r} sends")
            plan = replace(plan, p2p=DEFAULT_P2P)
    profiles = None
    if args.profiles:
        from hethub.profile.format import load_profiles

        profiles = load_profiles(args.profiles, model=plan.model, seq_len=plan.seq_len)
    host = host_for(plan.cluster, args.profiles, model=plan.model, seq_len=plan.seq_len)
    from hethub.report.groups import timeline_devices

    devices = timeline_devices(plan)
    pred = predict(plan, profiles=profiles, timeline=True if devices is None else devices, host=host)
    paths = write_report(plan=plan, prediction=pred, out_dir=args.out, metrics_path=args.metrics)
    print(f"report written to {args.out}/")
    for p in paths.written:
        print(f"  {p}")
    if paths.note:
        print(f"note: {paths.note}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("report", help="draw the plan and its timeline; write a Chrome trace and a summary")
    sp.add_argument("--plan", required=True, help="plan JSON the run trained (or any plan, for its prediction alone)")
    sp.add_argument("--metrics", help="JSON lines written by a run's --metrics (adds measured timings)")
    sp.add_argument("--profiles", help="measured layer profiles used for the prediction")
    sp.add_argument("--out", required=True, help="output directory")
    sp.set_defaults(func=cmd_report)
