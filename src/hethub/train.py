"""``python -m hethub.train`` / ``torchrun -m hethub.train``: one training rank.

The entry point settles the plan this rank runs, then hands it to the runtime
(:mod:`hethub.runtime.train`), which reads everything it needs from that plan and imports neither
the planner nor the predictor (docs/architecture.md). Settling the plan happens before the runtime
creates any process group or communication thread:

* a job that came back with fewer processes than the plan has devices is re-planned for them
  (``--replan-on-shrink``: :mod:`hethub.commands.replan`);
* a ZeRO-1 plan that carries no optimizer shard weights (a file from before plan version 7, or one
  made in code) gets them from the predictor at the default memory headroom, with a note;
* online re-balancing gets the predictor's per-stage times and memory limits, and a resumed run the
  shares and layers its checkpoint was saved under (:mod:`hethub.commands.rebalance_plan`).
"""

from __future__ import annotations

import argparse
import sys

from hethub.errors import missing_extra
from hethub.plan import Plan

try:
    from hethub.runtime.train import exit_rank, parse_args
    from hethub.runtime.train import main as run_rank
except ModuleNotFoundError as _err:  # torch is the train extra: say so instead of a traceback
    _missing = missing_extra(_err, what="'python -m hethub.train'")
    if _missing is None:
        raise
    if __name__ != "__main__":
        raise _missing from None
    print(f"hethub.train: error: {_missing}", file=sys.stderr)
    sys.exit(_missing.exit_code)

__all__ = ["main", "parse_args", "rank_plan"]


def rank_plan(args: argparse.Namespace, *, world_size: int, rank: int) -> Plan:
    """The plan rank ``rank`` of a ``world_size``-process job runs: ``args.plan``, re-planned for fewer
    processes where ``--replan-on-shrink`` allows it, with its ZeRO-1 split computed where missing."""
    from hethub.commands.rebalance_plan import saved_balance, with_rebalance_meta

    plan = Plan.load(args.plan)
    if not (args.replan_on_shrink and world_size < plan.world_size):
        plan = saved_balance(plan, args)
    if args.replan_on_shrink and world_size < plan.world_size:
        from hethub.commands.replan import replan_path, shrunk_plan
        from hethub.emulation.host import host_model

        old = plan.world_size
        plan = shrunk_plan(plan, world_size=world_size, rank=rank, root=args.checkpoint_dir,
                           timeout_s=args.timeout_s, host=host_model(plan.cluster))
        if rank == 0:
            print(f"hethub.train: {world_size} of {old} devices: re-planned, running "
                  f"{replan_path(args.checkpoint_dir, world_size)}", flush=True)
    if plan.sharded_optimizer and plan.shard_weights is None:
        from hethub.predict.predictor import with_shard_weights

        plan = with_shard_weights(plan)
        if rank == 0:
            print(f"hethub.train: note: {args.plan} carries no optimizer shard weights (training."
                  f"optimizer_shard_weights); computed at the default memory headroom "
                  f"{plan.shard_weights.mem_headroom:g}. Re-create the plan with 'hethub plan' to keep the "
                  "headroom it was planned at.", flush=True)
    return with_rebalance_meta(plan, layers=args.rebalance == "layers")


def main(argv: list[str] | None = None) -> int:
    """One rank: the runtime, given the plan :func:`rank_plan` settles."""
    return run_rank(argv, plan_of=rank_plan)


if __name__ == "__main__":
    exit_rank(main())
