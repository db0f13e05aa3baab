"""Regenerate README.md's "Measured here" table by running each row's command.

Usage: python bench/readme_figures.py [--rows KEY,KEY] [--long] [--demo-runs 3] [--dry-run] [--list]

Each row of the table is one entry of ROWS below: what it shows, the command a reader can run (the
"how" column), and a function that runs that command and turns its output into the "result" cell,
stamped with the date, the commit and, for rows whose figures depend on how busy the machine is,
the load average. Rows not selected keep their cell as it stands. Rows marked long (more than a
minute or two: multi-rank test files, the demo, the accuracy benches) run only with --long or when
named in --rows. Rows that run tests state what the tests assert (the bounds are the tests') and add
how many passed. The table lives between the README's "readme-figures" markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- readme-figures:begin -->", "<!-- readme-figures:end -->"
BIN = Path(sys.executable).parent
HETHUB = [str(BIN / "hethub")] if (BIN / "hethub").exists() else [sys.executable, "-m", "hethub.cli"]


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    how: str
    run: Callable[[argparse.Namespace], str]
    load: bool = False  # its figures depend on the machine's load
    long: bool = False  # more than a minute or two: only with --long or by name


def sh(cmd: list[str], *, cwd: Path = REPO, timeout_s: float = 3600) -> str:
    """Run a command from the repository root; its stdout, or SystemExit with its stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def bench_json(script: str) -> dict:
    """What a bench script writes with ``--json FILE``."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        sh([sys.executable, script, "--json", str(out)])
        return json.loads(out.read_text())


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---- rows -----------------------------------------------------------------------------------------------
PLAN_768 = ["plan", "--cluster", "examples/clusters/hethub-768.toml", "--model", "llama-140b", "--global-batch",
            "1536", "--seq-len", "4096", "--json"]
COMPARE = ["plan", "--cluster", "examples/clusters/a100-v100-32.toml", "--model", "llama-3-8b", "--global-batch", "512",
           "--seq-len", "2048", "--compare"]
_CACHE: dict[str, object] = {}


def hethub_768(_: argparse.Namespace) -> str:
    got = json.loads(sh([*HETHUB, *PLAN_768]))
    return (f"{got['tokens_per_s']:,.0f} tokens/s predicted, efficiency {got['efficiency']:.3f} of the proven upper "
            f"bound, {got['vs_kinds_alone']:.3f}x the sum of kind-alone plans, MFU {got['mfu']:.1%} (the bound, and "
            "why the kind-alone ratio can pass 1: docs/planner.md)")


def _compare_rows() -> dict[str, dict]:
    if "compare" not in _CACHE:
        _CACHE["compare"] = {r["strategy"]: r for r in json.loads(sh([*HETHUB, *COMPARE, "--json"]))}
    return _CACHE["compare"]  # type: ignore[return-value]


def a100_v100(_: argparse.Namespace) -> str:
    rows = _compare_rows()
    h = rows["hethub"]["tokens_per_s"]
    return (", ".join(f"{'hethub ' if i == 0 else ''}{h / rows[s]['tokens_per_s']:.2f}x `{s}`"
                      for i, s in enumerate(("uniform", "flops-proportional", "homogeneous")))
            + f" (predicted: {h:,.0f} tokens/s, schedule {rows['hethub']['schedule']}, optimizer "
            f"{rows['hethub']['optimizer_sharding']})")


def zero_gain(_: argparse.Namespace) -> str:
    rows = _compare_rows()
    h, flat = rows["hethub"], rows.get("hethub (no sharding)")
    gain = f"{h['tokens_per_s'] / flat['tokens_per_s']:.3f}x the best unsharded plan" if flat else "no unsharded row"
    return ("trains within 1e-5 of one device in fp32 (bf16-mixed within test_precision's bounds); each rank's "
            "AdamW and master bytes equal the memory model's prediction; resumes under another plan and sharding "
            f"({_pytest(['tests/dist/test_zero.py', 'tests/dist/test_zero_checkpoint.py'])}); the planner shards "
            f"where it pays: 16 A100 + 16 V100, llama-3-8b 512 x 2048, optimizer {h['optimizer_sharding']} chosen, "
            f"{gain} (predicted)")


def vendor_pairs(_: argparse.Namespace) -> str:
    out = sh([sys.executable, "bench/vendor_pairs.py"])
    gains, effs = [], []
    for line in out.splitlines():
        m = re.match(r"(nvidia-\S+)\s+\d+\s+\d+\s+[\d,]+\s+([\d.]+)\s+[\d,]+\s+([\d.]+)x", line)
        if m:
            effs.append(float(m.group(2)))
            gains.append(f"{float(m.group(3)):.2f}x")
    if len(gains) != 5:
        raise SystemExit(f"bench/vendor_pairs.py: expected 5 nvidia-* rows, parsed {len(gains)}:\n{out}")
    return (f"hethub {' / '.join(gains)} the best single kind (AMD / Ascend / Iluvatar / MetaX / Moore Threads), "
            f"{min(effs):.2f}-{max(effs):.2f}x the sum of kind-alone plans (predicted from catalog numbers, many "
            "assumed for the newer vendors)")


def planner_speed(args: argparse.Namespace) -> str:
    """The default `hethub plan` command (schedule and optimizer sharding left to the planner) on the
    clusters of bench/planner_scale.py, written as cluster files."""
    sys.path.insert(0, str(REPO / "bench"))
    from planner_scale import NETWORK, SIZES

    cells = []
    with tempfile.TemporaryDirectory() as d:
        for n in (int(x) for x in args.planner_sizes.split(",")):
            groups, model, gb, seq = SIZES[n]
            path = Path(d) / f"bench-{n}.toml"
            path.write_text(f'name = "bench-{n}"\n[network]\n'
                            + "".join(f"{k} = {v!r}\n" for k, v in NETWORK.items())
                            + "".join(f'[[group]]\nkind = "{k}"\nnodes = {nodes}\ndevices_per_node = 8\n'
                                      "devices_per_nic = 1\n" for k, nodes in groups))
            c0, t0 = children_cpu_s(), time.perf_counter()
            got = json.loads(sh([*HETHUB, "plan", "--cluster", str(path), "--model", model, "--global-batch",
                                 str(gb), "--seq-len", str(seq), "--json"]))
            wall, cpu = time.perf_counter() - t0, children_cpu_s() - c0
            cells.append((n, got["search_time_s"], wall, cpu, got["tokens_per_s"], got["efficiency"]))
    sizes = " / ".join(f"{n:,}" for n, *_ in cells)
    return (f"{sizes} devices: search {' / '.join(f'{c[1]:.2f}' for c in cells)} s (the command's whole run "
            f"{' / '.join(f'{c[2]:.1f}' for c in cells)} s wall, {' / '.join(f'{c[3]:.1f}' for c in cells)} s CPU "
            f"with its children); {' / '.join(f'{c[4]:,.0f}' for c in cells)} tokens/s, efficiency "
            f"{' / '.join(f'{c[5]:.3f}' for c in cells)}; targets (the default path, idle): 512 <= 3 s, "
            "4,096 <= 10 s: one run here; docs/planner.md (Measured) compares them side by side")


def compute_model(_: argparse.Namespace) -> str:
    out = sh([sys.executable, "bench/compute_model.py"])
    m = re.search(r"HEADLINE[^:]*: (\d+) entries, median \|err\| ([\d.]+)%.*max ([\d.]+)%.*within 15%: (\d+)/(\d+)",
                  out)
    if not m:
        raise SystemExit(f"bench/compute_model.py: no HEADLINE line in:\n{out[-2000:]}")
    n, med, mx, within = int(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4))
    verdict = lambda v, t: "**met**" if v <= t else "**not met**"  # noqa: E731
    return (f"median {med:.1f} %, max {mx:.1f} %, {within}/{n} within 15 % (targets 5 % / 15 %: median "
            f"{verdict(med, 5)}, max {verdict(mx, 15)}; every entry outside 15 % named with the mechanism the "
            "model lacks, per GPU: docs/predictor.md)")


def lean_activations(_: argparse.Namespace) -> str:
    got = bench_json("bench/activation_bytes.py")
    row = {(r["model"], r["tp"], r["recompute"]): r for r in got["rows"]}
    small, big = row[("small", 1, "none")], row[("llama-3-8b/4", 1, "none")]
    zb = next(c for c in got["weight_copies"] if c["model"] == "small" and c["split"])
    return (f"saved bytes per token per hidden unit of the `small` preset's layer, bf16, flash, TP 1: "
            f"{small['today']:.2f} before, {small['lean']:.2f} now (Llama-3-8B's shape: {big['today']:.2f} -> "
            f"{big['lean']:.2f}); ZB-H1's bf16 weight copies {zb['today']:.1f} -> {zb['lean']:.1f} bytes per "
            "parameter over 3 micro-batches (measured side by side)")


def calibration(_: argparse.Namespace) -> str:
    out = sh([sys.executable, "bench/calibration.py"])
    held = re.search(r"held-out GEMM rows: (\d+), median \|err\| ([\d.]+)%, max \|err\| ([\d.]+)%", out)
    errs = re.findall(r"(H100 tokens/s/GPU|A100 tokens/s/GPU|H100 / A100)\s*: \d+ configurations, median error\s*"
                      r"([+-]?[\d.]+)%", out)
    if not held or len(errs) != 6:
        raise SystemExit(f"bench/calibration.py: unexpected output:\n{out[-2000:]}")
    cited, assumed = dict(errs[:3]), dict(errs[3:])
    return (f"held-out GEMM rows: median {float(held.group(2)):.1f} % (max {float(held.group(3)):.1f} %); "
            f"llm-foundry's MPT configurations on H100 and A100: predicted H100 / A100 ratio "
            f"{float(cited['H100 / A100']):+.1f} % median ({float(assumed['H100 / A100']):+.1f} % with the assumed "
            f"defaults); absolute tokens/s {float(cited['H100 tokens/s/GPU']):+.0f} % (H100) / "
            f"{float(cited['A100 tokens/s/GPU']):+.0f} % (A100) median")


def _pytest(files: list[str]) -> str:
    out = sh([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *files])
    m = re.search(r"(\d+) passed", out)
    return f"{m.group(1) if m else '0'} tests passed"


def tests_row(claim: str, files: list[str]) -> Callable[[argparse.Namespace], str]:
    return lambda _: f"{claim} ({_pytest(files)})"


def demo(args: argparse.Namespace) -> str:
    runs = []
    for i in range(args.demo_runs):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            sh([*HETHUB, "demo", "--out", d])
            res = json.loads((Path(d) / "demo.json").read_text())
            runs.append((res, time.perf_counter() - t0))
        print(f"  demo run {i + 1}/{args.demo_runs}: {runs[-1][1]:.0f} s", flush=True)

    def ratio(res: dict, key: str, what: str) -> float:
        return res["hethub"][f"{what}_tokens_per_s"] / res[key][f"{what}_tokens_per_s"]

    res0 = runs[0][0]
    subset = res0.get("subset", {}).get("label", "best subset").removeprefix("best subset: ")
    meas = "; ".join(f"{ratio(r, 'subset', 'measured'):.2f}x / {ratio(r, 'uniform', 'measured'):.2f}x" for r, _ in runs)
    won = sum(ratio(r, "subset", "measured") > 1 and ratio(r, "uniform", "measured") > 1 for r, _ in runs)
    load = max(x["foreign_load_cores"] or 0.0 for r, _ in runs for x in r.values())
    shares = ", ".join(f"{k} {v:.0%}" for k, v in res0["hethub"]["work_shares"].items())
    return (f"the planner's plan uses every kind ({shares} of the work) and trained faster than both the best "
            f"single kind ({subset}) and `uniform` in {won} of {len(runs)} runs in a row: {meas} measured "
            f"(predicted {ratio(res0, 'subset', 'predicted'):.2f}x / {ratio(res0, 'uniform', 'predicted'):.2f}x); "
            f"other processes kept up to {load:.1f} cores busy; {min(t for _, t in runs):.0f}-"
            f"{max(t for _, t in runs):.0f} s a run")


def overhead(_: argparse.Namespace) -> str:
    out = sh([sys.executable, "bench/runtime_overhead.py", "--skip-demo"])
    m = re.search(r"ratio runtime/plain:\s+([\d.]+)", out)
    if not m:
        raise SystemExit(f"bench/runtime_overhead.py: no ratio in:\n{out}")
    return f"{float(m.group(1)):.2f}x the plain loop's step time (median of 9 steps, 1 thread)"


def predictor_accuracy(_: argparse.Namespace) -> str:
    got = bench_json("bench/predictor_accuracy.py")
    s = got["sets"]["ranking"]["summary"]
    met = s["spearman"] >= 0.9 and s["regret"] <= 0.05
    return (f"**Spearman {s['spearman']:.3f}, regret {s['regret']:+.1%}** (targets >= 0.9, <= 5 %: "
            f"{'met' if met else 'not met'}); absolute error median {s['median_abs_error']:.1%} (information); "
            f"other processes kept {s['foreign_cores_median']:.2f} cores busy (median over plans); every run: "
            "docs/accuracy.md")


def memory_accuracy(_: argparse.Namespace) -> str:
    out = sh([sys.executable, "bench/memory_accuracy.py"])
    worst = re.findall(r"largest \|error\| (\S+)\s+([\d.]+)%", out)
    ranks = re.search(r"(\d+) ranks in", out)
    if not worst or not ranks:
        raise SystemExit(f"bench/memory_accuracy.py: unexpected output:\n{out[-2000:]}")
    top = max(float(v) for _, v in worst)
    return (f"largest error {top:.1f} % over every part ({', '.join(p for p, _ in worst)}) on {ranks.group(1)} "
            "ranks: flash and math attention, stages that recompute selectively or fully")


ROWS = [
    Row("hethub-768", "HETHUB paper setting: 128 MI250X + 640 gpu-b, llama-140b, batch 1536 x 4096",
        f"`hethub {' '.join(PLAN_768)}`", hethub_768),
    Row("a100-v100", "16 A100 + 16 V100, llama-3-8b, batch 512 x 2048", f"`hethub {' '.join(COMPARE)}`", a100_v100),
    Row("vendors", "NVIDIA (16 A100-80GB) beside 16 devices of each other HETHUB brand (AMD, Ascend, Iluvatar, "
        "MetaX, Moore Threads), llama-3-8b, batch 512 x 2048", "`python bench/vendor_pairs.py`, "
        "`examples/clusters/README.md`", vendor_pairs),
    Row("planner-speed", "planner search time of the default `hethub plan` command (schedule and optimizer "
        "sharding left to the planner), 32 / 128 / 512 / 4,096 devices",
        "`hethub plan --cluster C --model M --global-batch B --seq-len S --json` on `bench/planner_scale.py`'s "
        "clusters (`python bench/readme_figures.py --rows planner-speed`)", planner_speed, load=True),
    Row("compute-model", "analytic compute model vs Sailor's measured GPU layers, leave-one-model-out (7 GPUs, 4 "
        "models; a defective Sailor file excluded and named)", "`python bench/compute_model.py` (~25 s CPU)",
        compute_model),
    Row("calibration", "bf16 calibration beyond A100 (H100, H200, GH200, MI300X, MI250X, A100) from cited public "
        "measurements (MAMF GEMM table, FlashAttention-2 peaks)",
        "`bench/calibration.py` (~1 s)", calibration),
    Row("exhaustive", "planner vs exhaustive search, small clusters", "`tests/unit/test_space.py`",
        tests_row("equal optimum (same predicted step time to 1e-9; 3 cases, 229-3,965 plans)",
                  ["tests/unit/test_space.py"])),
    Row("schedules", "pipeline schedules: 1F1B, GPipe, ZB-H1 (split backward, Qi et al. 2024), interleaved 1F1B "
        "(virtual stages, Narayanan et al. 2021)", "`tests/dist/test_split_schedules.py`, "
        "`tests/dist/test_interleaved_training.py`, `bench/schedules.py`",
        tests_row("ZB-H1 and interleaved each train within 1e-5 of one device (TP stages, uneven replicas, "
                  "recomputation, bridge forced), as 1F1B does; traced op order and in-flight peak equal the "
                  "schedule registry's; the planner chooses among them per plan (`--schedule auto`); measured "
                  "ZB-H1 and interleaved / 1F1B ratios against predicted: docs/predictor.md",
                  ["tests/dist/test_split_schedules.py", "tests/dist/test_interleaved_training.py"]), long=True),
    Row("recompute", "activation recomputation per stage: none, selective (only the attention core, Korthikanti "
        "et al. 2022) or full", "`tests/unit/test_profiler.py`, `tests/dist/test_parity.py`, "
        "`tests/unit/test_recompute_choice.py`",
        tests_row("predicted activation bytes equal the runtime's saved tensors to the byte in all three modes, "
                  "fp32 and bf16-mixed (flash and math attention, TP 2, GQA); a plan mixing the three trains within "
                  "1e-5 of one device under 1F1B and ZB-H1; the planner gives each laid-out stage the fastest mode "
                  "that fits",
                  ["tests/unit/test_profiler.py", "tests/dist/test_parity.py",
                   "tests/unit/test_recompute_choice.py"]), long=True),
    Row("lean", "lean activations in mixed precision (issue 32): the residual stream and messages in the compute "
        "dtype, fused-kernel RMSNorm, SDPA's native GQA, RoPE in the compute dtype",
        "`python bench/activation_bytes.py`", lean_activations),
    Row("parity", "training under any plan vs one device", "`tests/dist/test_parity.py`, "
        "`tests/dist/test_placement.py`",
        tests_row("loss/grads/params within 1e-5 fp32 (grads ~1e-8), bridge on or off; `torchrun -m hethub.train` "
                  "on two kinds with per-kind groups and the bridge forced, 1e-5",
                  ["tests/dist/test_parity.py", "tests/dist/test_placement.py"]), long=True),
    Row("zero", "ZeRO-1: optimizer state sharded across unequal data-parallel holders (other kinds, other TP "
        "degrees), slices in proportion to free memory; in mixed precision the fp32 masters too",
        f"`tests/dist/test_zero.py`, `tests/dist/test_zero_checkpoint.py`, `hethub {' '.join(COMPARE)}`", zero_gain,
        long=True),
    Row("precision", "mixed precision per kind (CPU autocast) vs one device in the same precision",
        "`tests/dist/test_precision.py`",
        tests_row("bf16 and fp16 with loss scaling within the test's bounds of one device after 3 AdamW steps; a "
                  "forced overflow is skipped on every rank and the run then equals one device without that batch",
                  ["tests/dist/test_precision.py"]), long=True),
    Row("hf", "Hugging Face models under a heterogeneous plan (TP-2 stage, uneven replicas) vs Transformers' "
        "forward", "`tests/dist/test_hf_io.py`",
        tests_row("logits and loss within 1e-5 fp32 for GQA, tied, Qwen2 (qkv bias), Llama 3 RoPE; trained, "
                  "exported and reloaded: equal to one device within 1e-5", ["tests/dist/test_hf_io.py"]), long=True),
    Row("demo", "`hethub demo` (4 CPU ranks on demo-cpu.toml: 2 cpu-fast 3x, 2 cpu-slow 6x slower than a core; "
        "EMULATION)", "`make demo` (`hethub demo`)", demo, load=True, long=True),
    Row("overhead", "runtime vs plain PyTorch loop, 1 rank, tiny model",
        "`python bench/runtime_overhead.py --skip-demo`", overhead, load=True),
    Row("predictor", "predictor ranks 17 local CPU plans of one job (1-4 ranks, stages, replicas, TP, emulated slow "
        "kind and link, 1F1B/GPipe/ZB-H1)", "`python bench/predictor_accuracy.py` (~4 min idle)", predictor_accuracy,
        load=True, long=True),
    Row("memory", "predicted vs measured memory per part (weights, grads, optimizer, in-flight activations, "
        "grad-sync buffer; local CPU plans through the runtime)", "`python bench/memory_accuracy.py`",
        memory_accuracy, long=True),
]


# ---- the table ------------------------------------------------------------------------------------------
def stamp(row: Row, commit: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: depends on load" if row.load else ""
    return f" ({when}, {commit}{load})"


def current_cells(text: str) -> dict[str, str]:
    """The result cell of each row now in the README, by its "what" cell."""
    cells = {}
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split(" | ")]
        if len(parts) == 3 and not line.startswith("|---") and parts[0] != "what":
            cells[parts[0]] = parts[1]
    return cells


def render(cells: dict[str, str], commit: str) -> str:
    lines = [BEGIN, f"Generated by `python bench/readme_figures.py` (last at {commit}); each result carries its own "
             "date and commit, and says where its figures depend on the machine's load.", "",
             "| what | result | how |", "|---|---|---|"]
    lines += [f"| {r.what} | {cells.get(r.what, 'not measured yet')} | {r.how} |" for r in ROWS]
    return "\n".join([*lines, END])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated keys of the rows to run (--list shows them); default: every "
                                   "row that is not long")
    ap.add_argument("--long", action="store_true", help="also run the long rows (demo, multi-rank tests, accuracy)")
    ap.add_argument("--demo-runs", type=int, default=3, help="hethub demo runs in a row for its row (default 3)")
    ap.add_argument("--planner-sizes", default="32,128,512,4096", help="device counts of the planner-speed row")
    ap.add_argument("--dry-run", action="store_true", help="print the new table instead of writing README.md")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    args = ap.parse_args()
    if args.list:
        for r in ROWS:
            print(f"{r.key:<14} {'long' if r.long else '':<5} {'load' if r.load else '':<5} {r.what[:80]}")
        return 0
    keys = {r.key for r in ROWS}
    chosen = set(args.rows.split(",")) if args.rows else {r.key for r in ROWS if args.long or not r.long}
    if chosen - keys:
        ap.error(f"unknown row(s) {', '.join(sorted(chosen - keys))}; rows: {', '.join(r.key for r in ROWS)}")
    text = README.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block: nothing to regenerate")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True,
                            check=False).stdout.strip() or "unknown commit"
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "bench"], cwd=REPO, check=False).returncode:
        commit += " + uncommitted changes"
    cells = current_cells(text)
    for r in ROWS:
        if r.key in chosen:
            t0 = time.perf_counter()
            print(f"{r.key}: running {r.how} ...", flush=True)
            cells[r.what] = r.run(args) + stamp(r, commit)
            print(f"{r.key}: {cells[r.what]} [{time.perf_counter() - t0:.0f} s]", flush=True)
    table = render(cells, commit)
    if args.dry_run:
        print(table)
        return 0
    # Read again: the rows can take an hour, and the README may have been edited meanwhile.
    head, rest = README.read_text(encoding="utf-8").split(BEGIN, 1)
    README.write_text(head + table + rest.split(END, 1)[1], encoding="utf-8")
    print(f"README.md: {len(chosen)} row(s) regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
