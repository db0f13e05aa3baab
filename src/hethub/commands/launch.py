"""`hethub launch`: the torchrun command of every node of a multi-node plan, or a Slurm batch script.

torchrun numbers ranks node by node (node K's ranks follow those of nodes 0..K-1), and a plan's
ranks are its devices in ascending id order, which the cluster numbers node by node. So the nodes
that hold the plan's devices, in the order of their first rank, are torchrun's node ranks 0, 1, ...,
and each runs as many processes as the plan has devices on it (nodes of different kinds may run
different counts; torch's elastic agent assigns global ranks from each node's local world size).
Each rank then finds its own device from the node layout (docs/runtime.md, "Where each rank runs").

Pure Python: no torch needed to print the commands.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hethub.argtypes import positive_int
from hethub.errors import PlanError, SpecError
from hethub.plan import Plan

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeLaunch:
    """One machine of the job: its torchrun node rank, host, processes and environment."""

    node_rank: int
    host: str
    cluster_node: int  # the cluster file's node index
    nproc: int
    first_rank: int
    kinds: tuple[str, ...]
    needs: tuple[str, ...]  # what must be installed there (the kinds' torch packages)
    env: dict[str, str] = field(default_factory=dict)


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def check_host_name(host: str) -> str:
    """``host`` if it is a host name (RFC 1123: dot-separated labels of letters, digits and inner
    hyphens, 253 characters at most) or an IPv4 address; SpecError (exit 2) otherwise. Host names go
    into shell commands and an sbatch script: anything else could run as a command there."""
    if not host or len(host) > 253 or not all(_LABEL.match(part) for part in host.split(".")):
        raise SpecError(f"--hosts: {host!r} is not a host name (letters, digits, '-' and '.' only, each dot-separated "
                        "part 1-63 characters, not starting or ending with '-'). Fix: pass the machines' host names "
                        "or IPv4 addresses, comma-separated.")
    return host


def node_launches(plan: Plan, hosts: list[str], *, port: int = DEFAULT_PORT) -> list[NodeLaunch]:
    """The plan's nodes in rank order, each given the next host of ``hosts``."""
    for host in hosts:
        check_host_name(host)
    by_node: dict[int, list[int]] = {}
    for rank, dev in enumerate(plan.devices):
        by_node.setdefault(plan.cluster.devices[dev].node, []).append(rank)
    nodes = list(by_node)  # insertion order = order of first rank
    if len(hosts) != len(nodes) or len(set(hosts)) != len(hosts) or not all(hosts):
        raise PlanError(f"--hosts gives {len(hosts)} host(s) ({','.join(hosts)}) but the plan's {plan.world_size} "
                        f"ranks sit on {len(nodes)} node(s) of cluster {plan.cluster.name!r} (nodes "
                        f"{', '.join(map(str, nodes))}). Fix: pass exactly {len(nodes)} distinct host names, one per "
                        "node, in that order (the first hosts rank 0).")
    out = []
    for k, (node, host) in enumerate(zip(nodes, hosts, strict=True)):
        ranks = by_node[node]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):  # cannot happen for plans of this format
            raise PlanError(f"node {node}'s ranks {ranks} are not contiguous; torchrun cannot number them")
        kinds = tuple(dict.fromkeys(plan.cluster.devices[plan.devices[r]].kind for r in ranks))
        needs = tuple(dict.fromkeys(plan.cluster.kinds[k].torch_package for k in kinds
                                    if plan.cluster.kinds[k].torch_package))
        env = {"MASTER_ADDR": hosts[0], "MASTER_PORT": str(port), "NNODES": str(len(nodes)),
               "NODE_RANK": str(k), "NPROC_PER_NODE": str(len(ranks)), "OMP_NUM_THREADS": "1"}
        out.append(NodeLaunch(node_rank=k, host=host, cluster_node=node, nproc=len(ranks), first_rank=ranks[0],
                              kinds=kinds, needs=needs, env=env))
    return out


def _train_args(plan_path: str, train_args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["-m", "hethub.train", "--plan", plan_path, *train_args])


def torchrun_line(n: NodeLaunch, *, plan_path: str, train_args: list[str]) -> str:
    """The command to run on node ``n`` (static rendezvous: honours --node-rank, docs/runtime.md);
    every argument shell-quoted."""
    args = ["torchrun", "--nnodes", n.env["NNODES"], "--node-rank", str(n.node_rank), "--nproc-per-node",
            str(n.nproc), "--master-addr", n.env["MASTER_ADDR"], "--master-port", n.env["MASTER_PORT"]]
    return (f"OMP_NUM_THREADS={shlex.quote(n.env['OMP_NUM_THREADS'])} {' '.join(map(shlex.quote, args))} "
            f"{_train_args(plan_path, train_args)}")


def _dq(text: str) -> str:
    """Double-quoted for bash (the body of the script's ``bash -c '...'`` holds no single quotes)."""
    return '"' + "".join("\\" + c if c in '"$`\\' else c for c in text) + '"'


@dataclass(frozen=True)
class SlurmOptions:
    """What the sbatch script asks Slurm for, beyond the nodes (``hethub launch --slurm`` flags)."""

    job_name: str
    time: str | None = None  # --time, e.g. 24:00:00
    partition: str | None = None
    account: str | None = None
    cpus_per_rank: int = 8  # cores per training process: --cpus-per-task is this x the busiest node's ranks
    env_setup: str | None = None  # a line run before srun, e.g. "source /shared/venv/bin/activate"


def node_devices(plan: Plan, n: NodeLaunch) -> dict[str, int]:
    """Accelerators node ``n`` needs, by device type (cuda, npu, ...): one per rank of such a kind."""
    out: dict[str, int] = {}
    for r in range(n.first_rank, n.first_rank + n.nproc):
        dtype = plan.cluster.kinds[plan.cluster.devices[plan.devices[r]].kind].device_type
        if dtype != "cpu":
            out[dtype] = out.get(dtype, 0) + 1
    return out


def _resources(plan: Plan, launches: list[NodeLaunch], opts: SlurmOptions) -> list[str]:
    """#SBATCH lines for devices and cores. One request covers every node (one task per node), so it
    is the busiest node's: Slurm's generic resources by device type, GPUs as --gpus-per-node."""
    need: dict[str, int] = {}
    for n in launches:
        for dtype, k in node_devices(plan, n).items():
            need[dtype] = max(need.get(dtype, 0), k)
    lines = [f"#SBATCH --cpus-per-task={max(n.nproc for n in launches) * opts.cpus_per_rank}"]
    for dtype, k in sorted(need.items()):
        # cuda devices (NVIDIA, and vendors behind the CUDA API) are GPUs to Slurm; others are generic
        # resources whose name is the site's (Ascend sites commonly call theirs npu).
        lines.append(f"#SBATCH --gpus-per-node={k}" if dtype == "cuda" else f"#SBATCH --gres={dtype}:{k}")
    for flag, value in (("time", opts.time), ("partition", opts.partition), ("account", opts.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def slurm_script(launches: list[NodeLaunch], *, plan: Plan, plan_path: str, train_args: list[str],
                 opts: SlurmOptions) -> str:
    """An sbatch script: one task per node; each node picks its node rank, process count and
    environment by host name, so the plan's node order holds whatever order Slurm lists the nodes in."""
    hosts = ",".join(n.host for n in launches)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={opts.job_name}",
        f"#SBATCH --nodes={len(launches)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --nodelist={hosts}",
        *_resources(plan, launches, opts),
        "#SBATCH --exclusive",
        "# Written by 'hethub launch --slurm'. One torchrun per node; the case below gives each node",
        "# the node rank, process count and environment the plan's rank order needs.",
        "set -euo pipefail",
        *([opts.env_setup] if opts.env_setup else []),
        "srun --ntasks-per-node=1 bash -c '",
        'case "$(hostname -s)" in',
    ]
    for n in launches:
        env = " ".join(f"{k}={_dq(v)}" for k, v in n.env.items())
        needs = f" needs {', '.join(n.needs)};" if n.needs else ""
        lines.append(f"  {n.host})  # cluster node {n.cluster_node}: {n.nproc} x {'+'.join(n.kinds)};{needs} "
                     f"ranks {n.first_rank}-{n.first_rank + n.nproc - 1}")
        lines.append(f"    export {env} ;;")
    args = " ".join(_dq(a) for a in ["-m", "hethub.train", "--plan", plan_path, *train_args])
    lines += [
        '  *) echo "hethub: host $(hostname -s) is not in the plan host list" >&2; exit 2 ;;',
        "esac",
        'exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" '
        f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" {args}',
        "'",
        "",
    ]
    body = "\n".join(lines)
    if "'" in body.split("bash -c '", 1)[1].rstrip().rstrip("'"):
        raise SpecError("a path or training argument contains a single quote, which the script's per-node "
                        "command cannot hold. Fix: rename it.")
    return body


def _checked_train_args(plan_path: str, steps: int | None, extra: list[str]) -> list[str]:
    """The ranks' arguments, parsed by the parser ``hethub train`` and every rank use: a bad value or an
    unknown flag stops here, not on every node after the allocation is granted. ``--steps`` is passed
    only when given (before or after '--', not both)."""
    from hethub.runtime.train_args import parse_rank_args

    if steps is not None and any(a == "--steps" or a.startswith("--steps=") for a in extra):
        raise SpecError("--steps is given twice, before and after '--'. Fix: keep one.")
    train_args = [*(["--steps", str(steps)] if steps is not None else []), *extra]
    parse_rank_args(["--plan", plan_path, *train_args])
    return train_args


def cmd_launch(args: argparse.Namespace) -> int:
    from hethub.outfiles import prepare_output

    plan = Plan.load(args.plan)
    hosts = [h.strip() for h in args.hosts.split(",")]
    launches = node_launches(plan, hosts, port=args.port)
    extra = list(args.train_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    train_args = _checked_train_args(args.plan, args.steps, extra)
    steps_note = ""
    if "--steps" not in train_args and not any(a.startswith("--steps=") for a in train_args):
        from hethub.runtime.train_args import rank_parser

        steps_note = (f"no --steps given: the ranks train {rank_parser().get_default('steps')} steps "
                      "(python -m hethub.train's default)")
    if args.slurm:
        default = f"{Path(args.plan).stem}.sbatch"
        out = Path(args.out or default)
        if out.is_dir() or (args.out or "").endswith(("/", "\\")):
            out = out / default
        prepare_output(out)
        opts = SlurmOptions(job_name=f"hethub-{plan.cluster.name}", time=args.time, partition=args.partition,
                            account=args.account, cpus_per_rank=args.cpus_per_rank, env_setup=args.env_setup)
        out.write_text(slurm_script(launches, plan=plan, plan_path=args.plan, train_args=train_args, opts=opts),
                       encoding="utf-8")
        print(f"wrote {out} ({len(launches)} nodes, {plan.world_size} ranks): sbatch {out}")
        if steps_note:
            print(f"note: {steps_note}")
        return 0
    print(f"# {plan.world_size} ranks on {len(launches)} nodes; run each line on its host (node 0 first or in "
          "any order: they wait for each other)")
    if steps_note:
        print(f"# {steps_note}")
    for n in launches:
        needs = f", needs {', '.join(n.needs)}" if n.needs else ""
        print(f"# {n.host}: cluster node {n.cluster_node}, {n.nproc} x {'+'.join(n.kinds)}{needs}, ranks "
              f"{n.first_rank}-{n.first_rank + n.nproc - 1}")
        print(torchrun_line(n, plan_path=args.plan, train_args=train_args))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("launch", help="print the torchrun command of every node of a plan, or write an sbatch "
                                       "script (--slurm)")
    sp.add_argument("--plan", required=True, help="plan JSON written by 'hethub plan' (the same path on every node)")
    sp.add_argument("--hosts", required=True, help="comma-separated host names, one per node, in rank order")
    sp.add_argument("--slurm", action="store_true", help="write a Slurm batch script instead of printing commands")
    sp.add_argument("--out", help="the sbatch script's path (default: PLAN.sbatch)")
    sp.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help="rendezvous port on the first host")
    sp.add_argument("--steps", type=positive_int, default=None,
                    help="training steps, passed to every rank as --steps (default: none passed, so "
                         "'python -m hethub.train' uses its own default); same as giving it after '--'")
    sl = sp.add_argument_group("the sbatch script (--slurm)")
    sl.add_argument("--time", help="the job's time limit, e.g. 24:00:00 (sbatch --time)")
    sl.add_argument("--partition", help="sbatch --partition")
    sl.add_argument("--account", help="sbatch --account")
    sl.add_argument("--cpus-per-rank", type=positive_int, default=8,
                    help="cores per training process; --cpus-per-task is this times the busiest node's ranks")
    sl.add_argument("--env-setup", metavar="LINE",
                    help="a shell line run before srun, e.g. 'source /shared/venv/bin/activate' (the ranks "
                         "inherit its environment)")
    sp.add_argument("train_args", nargs=argparse.REMAINDER,
                    help="after '--': options for 'python -m hethub.train' (e.g. -- --metrics run.jsonl)")
    sp.set_defaults(func=cmd_launch)
