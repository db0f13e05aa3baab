"""The import structure of ``src/hethub`` (docs/architecture.md), read with ``ast`` without importing anything.

* No import cycle, between modules or between packages, counting imports inside functions too: a
  lazy import hides a cycle from the interpreter, not from the design. Packages are checked at two
  grains: each directory, and each top-level package with everything under it (so
  ``emulation.measure`` is part of ``emulation``).
* The runtime reads everything it needs from the plan: no runtime module reaches the planner
  (``search``) or the predictor (``predict``), directly or through anything it imports.
* The torch-free parts never import torch, directly or through anything they import (including
  the ``__init__`` of every package on the way).

Plus two dynamic checks: importing the core leaves torch unloaded, and ``hethub plan`` runs in a
process where importing torch fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# Packages and modules that must work without torch (``pip install hethub`` without the train extra).
PURE = ("hethub.errors", "hethub.spec", "hethub.plan", "hethub.plan_parts", "hethub.plan_check", "hethub.plan_fields",
        "hethub.predict", "hethub.search", "hethub.report", "hethub.profile", "hethub.interop", "hethub.schedules",
        "hethub.layout", "hethub.layout_parts", "hethub.layout_units", "hethub.emulation", "hethub.tables",
        "hethub.progress", "hethub.rebalance", "hethub.runtimes", "hethub.fanout")
# ... except these, which measure with torch.
NOT_PURE = ("hethub.emulation.measure",)
HEAVY = ("torch",)
# The runtime never reaches these: the plan file carries what it needs, and re-planning is the entry point's.
RUNTIME = ("hethub.runtime",)
NOT_FROM_RUNTIME = ("hethub.search", "hethub.predict")


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module under src/hethub."""
    out = {}
    for path in sorted((SRC / "hethub").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imports(mods: dict[str, tuple[Path, bool]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(hethub module -> hethub modules it imports, module -> third-party top-level names it imports).
    ``from a.b import c`` counts as importing module a.b.c where that is a module, else a.b."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            for t in targets:
                if not t.startswith("hethub"):
                    external[m].add(t.split(".")[0])
                    continue
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    edges[m].add(t)
    return edges, external


MODS = _modules()
EDGES, EXTERNAL = _imports(MODS)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _package(module: str) -> str:
    """The directory a module lives in (a package's __init__ belongs to its package); top-level
    modules of hethub are units of their own."""
    _, is_pkg = MODS[module]
    if is_pkg or module.count(".") == 1:
        return module
    return module.rpartition(".")[0]


def _top_package(module: str) -> str:
    """The top-level package (or top-level module) of hethub a module belongs to, subpackages included."""
    return ".".join(module.split(".")[:2])


def _why(graph: dict[str, set[str]], comp: list[str], detail: dict[tuple[str, str], list[str]]) -> str:
    inside = set(comp)
    return "; ".join(f"{a} -> {b} ({', '.join(sorted(detail.get((a, b), []))[:3])})"
                     for a in comp for b in sorted(graph[a]) if b in inside)


def _grouped(edges: dict[str, set[str]], unit: Callable[[str], str],
             ) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The module graph with modules merged into ``unit(module)``, and which imports make each edge."""
    graph: dict[str, set[str]] = {}
    detail: dict[tuple[str, str], list[str]] = {}
    for a, bs in edges.items():
        pa = unit(a)
        graph.setdefault(pa, set())
        for b in bs:
            pb = unit(b)
            # A package's modules import its parent's __init__ and vice versa without a layering
            # problem only when one is the other's __init__; anything else across packages counts.
            if pa != pb:
                graph[pa].add(pb)
                detail.setdefault((pa, pb), []).append(f"{a} imports {b}")
    for p in set().union(*graph.values()):
        graph.setdefault(p, set())
    return graph, detail


def test_no_module_import_cycle() -> None:
    cycles = _cycles(EDGES)
    assert not cycles, "import cycles between modules: " + " | ".join(_why(EDGES, c, {}) for c in cycles)


@pytest.mark.parametrize("grain", ["directory", "top-level package"])
def test_no_package_import_cycle(grain: str) -> None:
    graph, detail = _grouped(EDGES, _package if grain == "directory" else _top_package)
    cycles = _cycles(graph)
    assert not cycles, "import cycles between packages: " + " | ".join(_why(graph, c, detail) for c in cycles)


def _chain(start: str, hit: Callable[[str], bool]) -> list[str] | None:
    """The import chain from `start` to the first module `hit` accepts, if any (breadth first; a
    module's import also runs every package ``__init__`` above it)."""
    def deps(m: str) -> set[str]:
        parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
        return EDGES[m] | {p for p in parents if p in MODS}

    prev: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        m = queue.pop(0)
        if hit(m):
            chain = [m]
            while prev[chain[-1]] is not None:
                chain.append(prev[chain[-1]])
            return chain[::-1]
        for d in sorted(deps(m)):
            if d not in prev:
                prev[d] = m
                queue.append(d)
    return None


@pytest.mark.parametrize("module", sorted(m for m in MODS if _under(m, RUNTIME)))
def test_runtime_never_reaches_planner_or_predictor(module: str) -> None:
    chain = _chain(module, lambda m: _under(m, NOT_FROM_RUNTIME))
    assert chain is None, (f"{module} reaches {chain[-1]}: {' -> '.join(chain)}. The runtime takes what it needs "
                           "from the plan; what needs the planner or predictor belongs to the entry point")


def _chain_to_heavy(start: str) -> list[str] | None:
    """The import chain from `start` to a module that imports torch, if any."""
    return _chain(start, lambda m: bool(EXTERNAL[m] & set(HEAVY)))


PURE_MODULES = sorted(m for m in MODS if _under(m, PURE) and not _under(m, NOT_PURE))


def test_the_pure_parts_exist() -> None:
    """The check below must look at something: the core's packages are all there."""
    for pkg in ("hethub.spec", "hethub.plan", "hethub.predict", "hethub.search", "hethub.profile",
                "hethub.interop", "hethub.emulation", "hethub.report"):
        assert pkg in MODS, f"{pkg} is missing: update PURE in this test"
    assert "hethub.runtime.trainer" not in PURE_MODULES


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_never_reaches_torch(module: str) -> None:
    chain = _chain_to_heavy(module)
    assert chain is None, f"{module} reaches torch: {' -> '.join(chain)} (imports torch)"


def test_the_checks_can_fail() -> None:
    """The walker sees a cycle and a torch import where there is one (a graph with both planted)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "torch" in EXTERNAL["hethub.runtime.trainer"]
    assert _chain_to_heavy("hethub.runtime.trainer") == ["hethub.runtime.trainer"]
    # Merged into top-level packages, modules that form no cycle can: a.x -> b.y -> a.z.
    graph, _ = _grouped({"h.a.x": {"h.b.y"}, "h.b.y": {"h.a.z"}, "h.a.z": set()}, lambda m: m.rpartition(".")[0])
    assert _cycles(graph) == [["h.a", "h.b"]]
    # The entry point's re-planning reaches the planner, so the runtime check sees such a chain.
    chain = _chain("hethub.commands.replan", lambda m: _under(m, NOT_FROM_RUNTIME))
    assert chain is not None and chain[0] == "hethub.commands.replan" and _under(chain[-1], NOT_FROM_RUNTIME)


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import hethub.cli, hethub.plan, hethub.spec, hethub.tables\n"
        "import hethub.predict.predictor, hethub.predict.links, hethub.predict.fit\n"
        "import hethub.search.planner, hethub.commands.replan\n"
        "import hethub.profile.format, hethub.interop.sailor, hethub.emulation.host\n"
        "hethub.cli.build_parser()\n"
        "assert 'torch' not in sys.modules, 'the core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_planning_command_runs_without_torch(tmp_path):
    """`hethub plan` end to end in a process where importing torch fails."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hethub.cli import main\n"
        f"sys.exit(main(['plan', '--cluster', {str(tmp_path / 'c.toml')!r}, '--model', 'tiny',\n"
        "               '--global-batch', '8', '--seq-len', '32', '--json']))\n"
    )
    (tmp_path / "c.toml").write_text('name = "x"\n[[group]]\nkind = "a100-40gb"\nnodes = 1\ndevices_per_node = 2\n')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"tokens_per_s"' in out.stdout


_BLOCK_TORCH = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    "sys.meta_path.insert(0, Block())\n"
)


@pytest.mark.parametrize("argv", [["train", "--plan", "PLAN", "--steps", "1"],
                                  ["profile", "--model", "tiny", "--out", "x.json"],
                                  ["bench", "comm", "--cluster", "CLUSTER"], ["demo"]])
def test_commands_that_need_torch_name_the_extra(tmp_path, argv):
    """Without torch (``pip install hethub``), a torch command says which extra to install: one line
    on stderr, exit code 8 (docs/cli.md), no traceback."""
    from hethub.plan import Plan

    (tmp_path / "c.toml").write_text('name = "x"\n[[group]]\nkind = "a100-40gb"\nnodes = 1\ndevices_per_node = 2\n')
    argv = [a.replace("CLUSTER", str(tmp_path / "c.toml")) for a in argv]
    if "PLAN" in argv:
        from hethub.search import PlannerConfig, make_plan
        from hethub.spec.cluster import load_cluster
        from hethub.spec.model import PRESETS

        plan: Plan = make_plan(cluster=load_cluster(tmp_path / "c.toml"), model=PRESETS["tiny"],
                               config=PlannerConfig(global_batch=4, seq_len=32)).plan
        plan.save(tmp_path / "plan.json")
        argv = [a.replace("PLAN", str(tmp_path / "plan.json")) for a in argv]
    code = _BLOCK_TORCH + f"from hethub.cli import main\nsys.exit(main({argv!r}))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 8, out.stderr
    assert "hethub[train]" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_python_m_hethub_train_without_torch_names_the_extra(tmp_path):
    code = _BLOCK_TORCH + "import runpy\nrunpy.run_module('hethub.train', run_name='__main__')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 8, out.stderr
    assert "hethub[train]" in out.stderr and "Traceback" not in out.stderr


def test_report_without_matplotlib_writes_trace_and_summary(tmp_path):
    """``pip install hethub`` without the plots extra: the report skips only the pictures, and says so."""
    (tmp_path / "c.toml").write_text('name = "x"\n[[group]]\nkind = "a100-40gb"\nnodes = 1\ndevices_per_node = 2\n')
    block = _BLOCK_TORCH.replace("'torch'", "'matplotlib'").replace("'torch.'", "'matplotlib.'")
    code = block + (
        "from hethub.cli import main\n"
        "assert main(['plan', '--cluster', 'c.toml', '--model', 'tiny', '--global-batch', '4', '--seq-len', '32',\n"
        "             '--out', 'plan.json']) == 0\n"
        "sys.exit(main(['report', '--plan', 'plan.json', '--out', 'rep']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "hethub[plots]" in out.stdout
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["summary.md", "trace.json"]
