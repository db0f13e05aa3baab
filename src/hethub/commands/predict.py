"""`hethub predict`: step time, throughput and memory of any plan."""

from __future__ import annotations

import argparse
import json
import sys

from hethub.commands.options import add_headroom, load_profiles_arg
from hethub.runtimes import RUNTIMES
from hethub.schedules import P2P_MODES


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("predict", help="predict step time, throughput and memory of a plan")
    sp.add_argument("--plan", required=True, help="plan JSON (from 'hethub plan', 'import-plan' or written by hand)")
    sp.add_argument("--profiles", help="measured layer profiles (directory or file)")
    sp.add_argument("--links", help="measured links profile from 'hethub bench comm'")
    sp.add_argument("--p2p", choices=P2P_MODES, default=None,
                    help="how the runtime sends between stages, overriding the plan's training.p2p: async (hethub's "
                         "runtime), blocking (a stage waits for its send, as in Megatron-LM) or lockstep (DeepSpeed's "
                         "pipeline engine, which Sailor uses: its instruction order, each send and receive a "
                         "rendezvous; 1F1B only); see docs/predictor.md")
    sp.add_argument("--runtime", choices=tuple(RUNTIMES), default=None,
                    help="predict the plan as this runtime runs it, overriding training.runtime: what it overlaps "
                         "(gradient buckets, TP all-reduces under weight-gradient GEMMs), how it sends and which "
                         "attention kernels it has (hethub.runtimes; docs/predictor.md)")
    sp.add_argument("--json", action="store_true", help="print one JSON object (warnings go to stderr)")
    add_headroom(sp)
    sp.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from hethub.commands.host import host_for
    from hethub.plan import Plan
    from hethub.predict.predictor import predict
    from hethub.tables import format_plan_table, format_summary

    plan = Plan.load(args.plan)
    if args.runtime is not None:
        plan = plan.with_runtime(args.runtime)
    if args.p2p is not None:
        from dataclasses import replace

        plan = replace(plan, p2p=args.p2p)
    plan.validate()
    if args.links:
        from hethub.predict.links import plan_with_links, read_links_profile

        plan = plan_with_links(plan, read_links_profile(args.links))
    profiles = load_profiles_arg(args.profiles, plan.model, plan.seq_len)
    pred = predict(plan, profiles=profiles,
                   host=host_for(plan.cluster, args.profiles, model=plan.model, seq_len=plan.seq_len),
                   mem_headroom=args.mem_headroom)
    upper = plan.meta.get("upper_bound_tokens_per_s")
    for w in pred.warnings:  # stderr, so --json output stays one object
        print(f"hethub predict: warning: {w}", file=sys.stderr)
    if args.json:
        out = {**pred.to_dict(), "upper_bound_tokens_per_s": upper,
               "efficiency": pred.tokens_per_s / upper if upper else None, "feasible": pred.fits_memory,
               "p2p": plan.p2p, "runtime": plan.runtime}
        print(json.dumps(out, indent=2))
        return 0
    print(format_summary(plan, pred, upper_bound_tokens_per_s=upper,
                         kinds_alone_tokens_per_s=plan.meta.get("kinds_alone_tokens_per_s")))
    print()
    print(format_plan_table(plan, pred))
    return 0
