"""`hethub import-plan` / `hethub export-plan`: plans in other planners' formats (Sailor)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hethub.argtypes import positive_int
from hethub.errors import PlanError


def cmd_import(args: argparse.Namespace) -> int:
    from hethub.errors import load_json
    from hethub.interop.sailor import import_sailor_plan, sailor_plan_model
    from hethub.outfiles import prepare_output, write_text_atomic
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    data = load_json(Path(args.file), missing=f"Sailor plan file '{args.file}' does not exist. Fix: pass the path "
                     "of a plan in Sailor's format, e.g. examples/sailor/opt350m-a100-v100-plan.json.",
                     invalid_fix="pass a plan in Sailor's JSON format", cls=PlanError)
    if args.out:
        prepare_output(args.out)
    model = sailor_plan_model(data) or (get_model(args.model) if args.model else None)
    if model is None:
        raise PlanError(f"{args.file}: the Sailor plan does not name its model. Fix: pass --model NAME.")
    cluster = load_cluster(args.cluster)
    plan = import_sailor_plan(data, cluster=cluster, model=model, seq_len=args.seq_len, where=args.file)
    text = plan.to_json()
    if args.out:
        write_text_atomic(args.out, text)
        print(f"imported {len(plan.pipelines)} pipelines on {plan.world_size} devices -> {args.out}")
        for key in ("note", "p2p_note"):
            if plan.meta.get("sailor", {}).get(key):
                print(f"note: {plan.meta['sailor'][key]}")
    else:
        print(text, end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hethub.interop.sailor import export_sailor_plan
    from hethub.plan import Plan

    plan = Plan.load(args.plan)
    text = json.dumps(export_sailor_plan(plan, nearest_equal=args.nearest_equal), indent=2) + "\n"
    if args.out:
        from hethub.outfiles import write_text_atomic

        write_text_atomic(args.out, text)
        print(f"exported to {args.out}")
    else:
        print(text, end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("import-plan", help="convert another planner's plan into a hethub plan")
    sp.add_argument("file", help="the other planner's plan file")
    sp.add_argument("--format", required=True, choices=["sailor"], help="the file's format (Sailor's plan JSON)")
    sp.add_argument("--cluster", required=True, help="cluster TOML whose devices the plan is placed on")
    sp.add_argument("--model", help="model preset or config.json (Sailor plans do not name theirs)")
    sp.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per sequence")
    sp.add_argument("--out", help="write the hethub plan JSON here (default: print it)")
    sp.set_defaults(func=cmd_import)

    sp = sub.add_parser("export-plan", help="write a hethub plan in another planner's format")
    sp.add_argument("plan", help="hethub plan JSON")
    sp.add_argument("--format", required=True, choices=["sailor"], help="the format to write (Sailor's plan JSON)")
    sp.add_argument("--nearest-equal", action="store_true",
                    help="if replicas take unequal batch shares (Sailor cannot express that), write every "
                         "replica with the mean share rounded")
    sp.add_argument("--out", help="write the exported plan here (default: print it)")
    sp.set_defaults(func=cmd_export)
