import functools
import pathlib
from dataclasses import replace

import pytest
from hypothesis import settings

from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "clusters"
# Sailor's measured GPU profiles and a plan in its format, vendored with their source and licence
# (tests/data/sailor/README.md): a clone runs every test without data from outside the repository.
SAILOR_DATA = REPO / "tests" / "data" / "sailor"

# No hypothesis test may fail on time: its 200 ms deadline per example tripped on a loaded 2-core box
# (test_data: 377 ms once, 0.5 ms on the re-run). Tests that set their own settings keep them.
settings.register_profile("hethub", deadline=None)
settings.load_profile("hethub")


SLOW_TESTS = REPO / "tests" / "slow_tests.txt"


def pytest_configure(config):
    # xdist registers its mark only where it is loaded; a run with -p no:xdist reads the marks too.
    config.addinivalue_line("markers", "xdist_group(name): tests that share a worker under --dist loadgroup")


def slow_test_ids() -> set[str]:
    """The node ids (without parameters) that tests/slow_tests.txt puts in the slow tier."""
    lines = SLOW_TESTS.read_text(encoding="utf-8").splitlines()
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its hook names them in node ids)
def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in tests/slow_tests.txt `slow`: the list is the tier's one home, so
    moving a test between tiers edits one line, not the test's file.

    And puts the tests that use a module-scoped fixture of their own module in one xdist group per
    module (unless they name a group): `--dist loadgroup` then runs them on one worker, which builds
    the fixture (a planner search, a profile, a tokenizer) once instead of once per worker."""
    slow = slow_test_ids()
    for item in items:
        if item.nodeid.split("[", 1)[0] in slow:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group") is None and _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            _tag_group(item)


def _tag_group(item) -> None:
    """Appends ``@group`` to the node id, which is how the controller's loadgroup scheduler learns the
    group. pytest-xdist's own hook writes ``item._nodeid``, which pytest 9.2 no longer reads (node ids
    live in ``item._id``): without this every group was silently spread over both workers."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None or "@" in item.nodeid or not hasattr(item, "_id"):
        return
    name = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
    item._id = type(item._id).parse(f"{item.nodeid}@{name}")


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return False
    return any(d.scope == "module" and d.baseid == item.parent.nodeid.split("::")[0]
               and not name.startswith("_xunit_setup")  # setup_module: no result to share
               for name, defs in info.name2fixturedefs.items() for d in defs)


def small_cluster(*, fast: int = 4, slow: int = 4, per_node: int = 2) -> Cluster:
    """Two kinds: 'fast' (100 TFLOP/s) and 'slow' (40 TFLOP/s), `per_node` devices per node."""
    def kind(name: str, flops: float, mem_gb: float) -> DeviceKind:
        return DeviceKind(name=name, vendor="test", mem_bytes=int(mem_gb * 1e9), peak_flops=flops,
                          intra_node_bw_bytes_per_s=100e9, intra_node_latency_s=5e-6, efficiency=0.5,
                          mem_bw_bytes_per_s=1e12, backend="gloo")

    groups = []
    if fast:
        groups.append(NodeGroup("fast", fast // per_node, per_node))
    if slow:
        groups.append(NodeGroup("slow", slow // per_node, per_node))
    return Cluster(name="small", kinds={"fast": kind("fast", 100e12, 40), "slow": kind("slow", 40e12, 16)},
                   groups=tuple(groups), inter_node=Link(12.5e9, 1e-5), cross_kind=Link(5e9, 5e-5))


def two_islands(cluster: Cluster) -> Cluster:
    """``small_cluster``'s kinds in two vendor islands, both on NCCL: syncs across kinds then take the
    bridge's two-level all-reduce (``hethub.islands``)."""
    return replace(cluster, kinds={**cluster.kinds, "fast": replace(cluster.kinds["fast"], backend="nccl"),
                                   "slow": replace(cluster.kinds["slow"], vendor="other", backend="nccl")})


def laid_out_layouts(monkeypatch, *, global_batch: int) -> list[tuple[Plan, dict]]:
    """The layouts (and ``choose_modes``'s memory arguments) a serial default search of llama-2-7b on
    a100-v100-32 lays out: V100s' stages recompute there, so memory binds."""
    from hethub.search import PlannerConfig, finalists, make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model
    cfg = PlannerConfig(global_batch=global_batch, seq_len=2048, micro_batch_sizes=(1, 2), schedule="auto",
                        optimizer_sharding="auto")
    laid: list[tuple[Plan, dict]] = []
    choose = finalists.choose_modes
    monkeypatch.setenv("HETHUB_PLAN_WORKERS", "1")  # the layouts recorded in this process
    monkeypatch.setattr(finalists, "choose_modes", lambda p, **k: laid.append(
        (p, {n: v for n, v in k.items() if n not in ("fits", "orders")})) or choose(p, **k))
    make_plan(cluster=load_cluster(EXAMPLES / "a100-v100-32.toml"), model=get_model("llama-2-7b"), config=cfg)
    return laid


def tiny_model(layers: int = 6) -> ModelSpec:
    return ModelSpec(name="t", num_layers=layers, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                     vocab_size=256, max_seq_len=64)


def two_stage_plan(cluster: Cluster | None = None, model: ModelSpec | None = None, *, split: int = 4) -> Plan:
    cluster = cluster or small_cluster()
    model = model or tiny_model()
    stages = (Stage("fast", (0,), (0, split), embedding=True),
              Stage("slow", (4,), (split, model.num_layers), head=True))
    return Plan(model=model, cluster=cluster, global_batch=8, seq_len=32,
                pipelines=(Pipeline(2, 4, stages),)).validate()


def three_stage_plan() -> Plan:
    """Three stages on three nodes of the small cluster (inter-node links between them), 8 micro-batches."""
    stages = (Stage("fast", (0,), (0, 2), embedding=True), Stage("fast", (2,), (2, 4)),
              Stage("slow", (4,), (4, 6), head=True))
    return Plan(model=tiny_model(), cluster=small_cluster(), global_batch=16, seq_len=32,
                pipelines=(Pipeline(2, 8, stages),)).validate()


def gpu_two_kind_plan() -> Plan:
    """A hand-made plan of the tiny model over one A100-40GB (stage 0) and one V100-16GB (stage 1) of
    examples/clusters/a100-v100-32.toml: for tests that need a plan on two GPU kinds, not a search
    (`hethub plan` there searches for ~15 CPU s)."""
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    cluster = load_cluster(EXAMPLES / "a100-v100-32.toml")
    model = get_model("tiny")
    first = {kind: min(d.id for d in cluster.devices if d.kind == kind) for kind in ("a100-40gb", "v100-16gb")}
    half = model.num_layers // 2
    stages = (Stage("a100-40gb", (first["a100-40gb"],), (0, half), embedding=True),
              Stage("v100-16gb", (first["v100-16gb"],), (half, model.num_layers), head=True))
    return Plan(model=model, cluster=cluster, global_batch=8, seq_len=32,
                pipelines=(Pipeline(1, 8, stages),)).validate()


@functools.cache
def plan_768():
    """The paper-scale search (hethub-768, llama-140b, 1536 x 4096, the planner's default settings),
    once per test process: several tests only read its result, and it is one of the suite's costliest
    searches (the README tour runs `hethub plan` on it separately, as a command). Tests sharing it
    carry ``@pytest.mark.xdist_group("plan_768")`` so that `make test`'s workers (``--dist loadgroup``)
    run them in one process. Callers must not mutate it."""
    from hethub.search import PlannerConfig, make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    return make_plan(cluster=load_cluster(EXAMPLES / "hethub-768.toml"), model=get_model("llama-140b"),
                     config=PlannerConfig(global_batch=1536, seq_len=4096))


@pytest.fixture
def cluster() -> Cluster:
    return small_cluster()


@pytest.fixture
def model() -> ModelSpec:
    return tiny_model()
