"""Bridge vs direct gloo: bandwidth for the same message sizes, measured side by side in one run.

    python bench/comm_bridge.py [--max-bytes 256MiB] [--allreduce] [--repeats 5]

Two forked gloo ranks ping-pong each message size four ways, interleaved so load on the host
affects all alike:

- direct: plain gloo send/recv (what same-kind traffic does on CPU);
- bridge: two emulated kinds with the bridge forced, host tensors as the bridge sends them between
  two host (CPU-kind) ranks: no copy, one transport isend/irecv per message (the acceptance ratio);
- staged: the same with staging forced, as for device tensors (comm/staging.py): on CPU one extra
  memcpy at each end, messages whole. A real GPU end copies device-to-host over PCIe on a side
  stream instead (bench/gpu_check.py measures it), so this is a stand-in for that path's cost;
- staged-chunks: staging in chunks of 256 KiB and more, as a pair with a GPU end sends them (chunk
  k+1 copied while chunk k is sent; on a host the copy and the send share the cores).

Each round measures every size and mode once (fastest of several round trips); ``--repeats``
rounds give each ratio's median and its spread (min..max), printed with the host's load average.

``--allreduce`` adds 4 ranks (kinds a, a, b, b): flat gloo all-reduce vs the hierarchical one
(reduce-scatter in kind, each shard among its peers of the other kind over the bridge,
all-gather in kind: ``comm/hierarchical.py``). Bandwidth is message bytes / one-way
time (p2p) or bytes / all-reduce time. ``--sharded`` adds 4 ranks (kinds a, b, b, b: one rank alone
in its island, as hethub-768's one MI250X pipeline beside seven others): the bridge's all-reduce of
an fp32 buffer vs ZeRO-1's sync of it, the bridge's two-level reduce-scatter plus the all-gather of
the slices in bf16 (``hethub.islands``). Everything here is TCP loopback on one host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from hethub.comm.bridge import BridgedCommunicator
from hethub.comm.communicator import Communicator
from hethub.comm.linkbench import message_sizes, ping_pong_s, repetitions
from hethub.comm.local_ranks import run_local_ranks
from hethub.comm.staging import MIN_CHUNK_BYTES
from hethub.commands.bench import parse_bytes

TIMEOUT = timedelta(seconds=120)
MODES = ("direct", "bridge", "staged", "staged-chunks")
KINDS = {"kind_of_rank": ["a", "b"], "backend_of_kind": {"a": "gloo", "b": "gloo"}}


def _p2p_worker(rank: int, sizes: list[int], repeats: int) -> list[dict[int, dict[str, float]]]:
    comms = {
        "direct": Communicator(timeout=TIMEOUT),
        "bridge": BridgedCommunicator(**KINDS, timeout=TIMEOUT, force_bridge=True, stage_host=False),
        "staged": BridgedCommunicator(**KINDS, timeout=TIMEOUT, force_bridge=True, stage_host=True),
        "staged-chunks": BridgedCommunicator(**KINDS, timeout=TIMEOUT, force_bridge=True, stage_host=True,
                                             p2p_chunk_bytes=MIN_CHUNK_BYTES),
    }
    rounds = []
    for r in range(repeats):
        # Each round starts with another mode, so no mode always runs first (or last) after a size change.
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        rounds.append({n: {m: ping_pong_s(comms[m], rank=rank, nbytes=n, reps=repetitions(n)) for m in order}
                       for n in sizes})
    return rounds


def _ratio(rounds: list[dict[int, dict[str, float]]], n: int, num: str, den: str, *, time: bool) -> str:
    """Median and spread over rounds of num's bandwidth over den's (``time``: values are times)."""
    r = sorted((x[n][den] / x[n][num]) if time else (x[n][num] / x[n][den]) for x in rounds)
    return f"{statistics.median(r):.2f} ({r[0]:.2f}..{r[-1]:.2f})"


def _best_times(sizes: list[int], modes: dict[str, Callable[[torch.Tensor], object]]) -> dict[int, dict[str, float]]:
    """Per message size, each mode's fastest run over the repetitions (modes interleaved, all ranks
    starting together; the first round warms up)."""
    out: dict[int, dict[str, float]] = {}
    for n in sizes:
        x = torch.ones(n // 4, dtype=torch.float32)
        best = dict.fromkeys(modes, float("inf"))
        names = list(modes)
        for i in range(repetitions(n) + 1):
            for mode in names[i % len(names):] + names[:i % len(names)]:  # alternating which runs first
                run = modes[mode]
                dist.barrier()
                start = time.perf_counter()
                run(x)
                if i:
                    best[mode] = min(best[mode], time.perf_counter() - start)
        out[n] = best
    return out


def _allreduce_worker(rank: int, sizes: list[int], repeats: int) -> list[dict[int, dict[str, float]]]:
    # Host tensors as the bridge reduces them between host ranks (no staging); the flat reference is
    # gloo's own all-reduce over the same four ranks.
    hier = BridgedCommunicator(kind_of_rank=["a", "a", "b", "b"], backend_of_kind={"a": "gloo", "b": "gloo"},
                               timeout=TIMEOUT, force_bridge=True, stage_host=False)
    return [_best_times(sizes, {"flat": dist.all_reduce, "hierarchical": hier.all_reduce}) for _ in range(repeats)]


def _sharded_worker(rank: int, sizes: list[int]) -> dict[int, dict[str, float]]:
    group = (0, 1, 2, 3)
    bridge = BridgedCommunicator(kind_of_rank=["a", "b", "b", "b"], backend_of_kind={"a": "gloo", "b": "gloo"},
                                 timeout=TIMEOUT, force_bridge=True)
    bridge.create_groups([group])

    def rs_ag(x: torch.Tensor) -> None:
        mine = bridge.reduce_scatter(x, group=group)
        bridge.all_gather(mine.to(torch.bfloat16), group=group)

    return _best_times(sizes, {"all-reduce": lambda x: bridge.all_reduce(x, group=group), "rs+ag": rs_ag})


def _fmt(n: int) -> str:
    return f"{n // 1024**2} MiB" if n >= 1024**2 else f"{n // 1024} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-bytes", type=parse_bytes, default=256 * 1024**2)
    ap.add_argument("--allreduce", action="store_true", help="also compare flat vs hierarchical all-reduce")
    ap.add_argument("--sharded", action="store_true",
                    help="also compare the bridge's all-reduce with its reduce-scatter + bf16 all-gather")
    ap.add_argument("--min-bytes", type=parse_bytes, default=4096)
    ap.add_argument("--repeats", type=int, default=9, help="rounds; ratios are their median (min..max)")
    args = ap.parse_args()
    sizes = message_sizes(min_bytes=args.min_bytes, max_bytes=args.max_bytes)
    start = time.perf_counter()
    print(f"host: {os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (start)")
    p2p = run_local_ranks(2, _p2p_worker, sizes, args.repeats)[0]
    print(f"p2p, 2 ranks, TCP loopback, {args.repeats} rounds; bandwidth = bytes / one-way time (fastest round "
          "trip / 2), median over rounds; ratios: median (min..max) over rounds")
    print(f"{'size':>9} {'direct GB/s':>12} {'bridge GB/s':>12} {'bridge/direct':>20} {'staged/direct':>20} "
          f"{'chunks/direct':>20}")
    for n in sizes:
        bw = {m: n / statistics.median(r[n][m] for r in p2p) / 1e9 for m in MODES}
        print(f"{_fmt(n):>9} {bw['direct']:>12.3f} {bw['bridge']:>12.3f} "
              f"{_ratio(p2p, n, 'bridge', 'direct', time=True):>20} "
              f"{_ratio(p2p, n, 'staged', 'direct', time=True):>20} "
              f"{_ratio(p2p, n, 'staged-chunks', 'direct', time=True):>20}")
    if args.allreduce:
        ar = run_local_ranks(4, _allreduce_worker, sizes, args.repeats)[0]
        print(f"\nall-reduce, 4 ranks (kinds a,a,b,b), {args.repeats} rounds; bandwidth = bytes / time (median)")
        print(f"{'size':>9} {'flat GB/s':>10} {'hier GB/s':>10} {'hier/flat':>20}")
        for n in sizes:
            flat = n / statistics.median(r[n]["flat"] for r in ar) / 1e9
            hier = n / statistics.median(r[n]["hierarchical"] for r in ar) / 1e9
            print(f"{_fmt(n):>9} {flat:>10.3f} {hier:>10.3f} {_ratio(ar, n, 'hierarchical', 'flat', time=True):>20}")
    if args.sharded:
        sh = run_local_ranks(4, _sharded_worker, sizes)[0]
        print("\nbridged sync, 4 ranks (kinds a,b,b,b), fp32 buffer; time per sync")
        print(f"{'size':>9} {'all-reduce ms':>14} {'rs+ag ms':>9} {'rs+ag/all-reduce':>17}")
        for n in sizes:
            ar_s, zs = sh[n]["all-reduce"], sh[n]["rs+ag"]
            print(f"{_fmt(n):>9} {ar_s * 1e3:>14.2f} {zs * 1e3:>9.2f} {zs / ar_s:>17.2f}")
    print(f"\n{time.perf_counter() - start:.1f} s; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (end)")


if __name__ == "__main__":
    main()
