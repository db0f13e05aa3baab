"""Cluster files, the device-kind catalog, links and validation errors."""

import json
from importlib import resources
from pathlib import Path

import pytest

from hethub.errors import SpecError
from hethub.spec.cluster import Cluster, Link, load_cluster, parse_cluster
from hethub.spec.kind import BACKENDS, catalog

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"

REQUIRED_KINDS = (
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h200",
    "v100-16gb",
    "mi250x",
    "mi300x",
    "ascend-910b",
    "rtx-3090",
    "titan-rtx",
    "rtx-2080",
    "gh200",
    "cpu",
)

EXPECTED_COUNTS = {
    "hethub-768.toml": {"mi250x": 128, "gpu-b": 640},
    "a100-v100-32.toml": {"a100-40gb": 16, "v100-16gb": 16},
    "three-kinds-48.toml": {"h100-sxm": 16, "a100-80gb": 16, "mi300x": 16},
    "cluster-4096.toml": {"h100-sxm": 2048, "a100-80gb": 1024, "mi300x": 1024},
    "local-cpu.toml": {"cpu-fast": 2, "cpu-slow": 2},
    "demo-cpu.toml": {"cpu-fast": 2, "cpu-slow": 2},
    "nvidia-amd-32.toml": {"a100-80gb": 16, "mi250x": 16},
    "nvidia-ascend-32.toml": {"a100-80gb": 16, "ascend-910b": 16},
    "nvidia-iluvatar-32.toml": {"a100-80gb": 16, "iluvatar-bi-v150": 16},
    "nvidia-metax-32.toml": {"a100-80gb": 16, "metax-c500": 16},
    "nvidia-mthreads-32.toml": {"a100-80gb": 16, "mthreads-s4000": 16},
}

GOOD_KIND = """
[kinds.mine]
vendor = "x"
mem_gib = 16
peak_flops = 1e14
intra_node_bw_bytes_per_s = 1e11
intra_node_latency_s = 5e-6
backend = "nccl"
efficiency = 0.5
source = "https://example.org/datasheet"
"""


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def one_group(kind: str = "a100-80gb", nodes: int = 1, per_node: int = 2) -> str:
    return f'[[group]]\nkind = "{kind}"\nnodes = {nodes}\ndevices_per_node = {per_node}\n'


# ---------------------------------------------------------------- examples


def test_every_example_is_listed_and_loads():
    files = sorted(p.name for p in EXAMPLES.glob("*.toml"))
    assert files == sorted(EXPECTED_COUNTS)
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for name in files:
        assert name in readme


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_example_device_counts(name):
    c = load_cluster(EXAMPLES / name)
    assert c.count_by_kind() == EXPECTED_COUNTS[name]
    assert c.num_devices == sum(EXPECTED_COUNTS[name].values())
    assert [d.id for d in c.devices] == list(range(c.num_devices))
    assert c.description
    for k in c.kinds.values():
        assert k.backend in BACKENDS
        assert 0 < k.efficiency <= 1
        assert k.effective_flops > 0


def test_hethub_768_matches_paper_split():
    c = load_cluster(EXAMPLES / "hethub-768.toml")
    assert c.num_devices == 768
    assert len(c.devices_of_kind("mi250x")) == 128
    assert len(c.devices_of_kind("gpu-b")) == 640
    assert all(g.devices_per_node == 8 for g in c.groups)
    # The cross-vendor path is host-staged: slower and higher latency than inter-node RDMA.
    assert c.cross_kind.bw_bytes_per_s < c.inter_node.bw_bytes_per_s
    assert c.cross_kind.latency_s > c.inter_node.latency_s
    gpu_b = c.kinds["gpu-b"]
    assert gpu_b.mem_bytes == 64_000_000_000
    assert 256e12 <= gpu_b.peak_flops <= 300e12


def test_local_cpu_is_an_emulation_with_a_slow_kind():
    path = EXAMPLES / "local-cpu.toml"
    head = path.read_text(encoding="utf-8").splitlines()[0]
    assert "EMULATION" in head
    c = load_cluster(path)
    fast, slow = c.kinds["cpu-fast"], c.kinds["cpu-slow"]
    assert fast.backend == slow.backend == "gloo"
    assert not fast.emulated and fast.emulated_slowdown == 1.0
    assert slow.emulated and slow.emulated_slowdown == 2.5
    assert fast.effective_flops == pytest.approx(2.5 * slow.effective_flops)
    # Inherited from the catalog's cpu kind.
    assert slow.peak_flops == catalog()["cpu"].peak_flops
    assert slow.source == catalog()["cpu"].source


# ---------------------------------------------------------------- catalog


def test_catalog_has_required_kinds_with_sources():
    cat = catalog()
    for name in REQUIRED_KINDS:
        assert name in cat, name
        k = cat[name]
        assert k.name == name
        assert k.source.startswith("https://"), name
        assert k.mem_bytes > 0 and k.peak_flops > 0
        assert k.intra_node_bw_bytes_per_s > 0 and k.intra_node_latency_s >= 0
        assert k.mem_bw_bytes_per_s is not None and k.mem_bw_bytes_per_s > 0
        assert 0.3 <= k.efficiency <= 0.6
        assert k.emulated_slowdown == 1.0


def test_catalog_backends_and_per_gcd_mi250x():
    cat = catalog()
    assert cat["cpu"].backend == "gloo"
    assert cat["ascend-910b"].backend == "hccl"
    assert cat["mi300x"].backend == cat["mi250x"].backend == cat["h100-sxm"].backend == "nccl"
    # One MI250X device is one GCD: half of 128 GB and of 383 TFLOP/s.
    assert cat["mi250x"].mem_bytes == 64_000_000_000
    assert cat["mi250x"].peak_flops == pytest.approx(383e12 / 2)
    # Dense, not sparse: an H100 is ~3x an A100 in bf16, not ~6x.
    assert cat["h100-sxm"].peak_flops / cat["a100-80gb"].peak_flops == pytest.approx(989 / 312)


def test_catalog_numeric_lines_carry_a_comment():
    text = resources.files("hethub.spec").joinpath("catalog.toml").read_text(encoding="utf-8")
    numeric = (
        "mem_bytes",
        "mem_gib",
        "peak_flops",
        "intra_node_bw_bytes_per_s",
        "intra_node_latency_s",
        "mem_bw_bytes_per_s",
        "efficiency",
    )
    for line in text.splitlines():
        if line.split("=")[0].strip() in numeric:
            assert "#" in line, line


# ---------------------------------------------------------------- links


def test_links_intra_inter_and_cross_kind():
    c = load_cluster(EXAMPLES / "hethub-768.toml")
    mi, gb = c.kinds["mi250x"], c.kinds["gpu-b"]
    # Devices 0..7 are node 0 (mi250x); 8..15 node 1 (mi250x); 128.. are gpu-b.
    assert c.devices[0].node == c.devices[7].node == 0
    assert c.devices[8].node == 1
    assert c.devices[128].kind == "gpu-b" and c.devices[128].node == 16

    assert c.link(0, 7) == Link(mi.intra_node_bw_bytes_per_s, mi.intra_node_latency_s, "infinity-fabric")
    assert c.link(128, 135) == Link(gb.intra_node_bw_bytes_per_s, gb.intra_node_latency_s, gb.intra_node_fabric)
    # Same kind, different node: the group's NIC override (mi250x) or the network default (gpu-b).
    assert c.link(0, 8) == Link(25e9, c.inter_node.latency_s, "infiniband")
    # mi250x: 2 GCDs per NIC; gpu-b: a NIC per device.
    assert c.devices[0].nic == c.devices[1].nic != c.devices[2].nic
    assert c.devices[128].nic != c.devices[129].nic
    assert c.link(128, 136) == Link(c.inter_node.bw_bytes_per_s, c.inter_node.latency_s, "infiniband")
    # Cross kind: the slowest of both NICs and the cross-kind path, the larger latency.
    cross = c.link(0, 128)
    assert cross == Link(1.07e9, 175e-6)  # a cited achieved rate (cross_kind_source): no fabric curve on top
    assert c.link(128, 0) == cross
    assert cross.time_s(1.07e9) == pytest.approx(175e-6 + 1.0)


def test_cross_kind_link_min_with_nic(tmp_path):
    p = write(
        tmp_path,
        one_group("a100-80gb")
        + one_group("h100-sxm")
        + """
[network]
inter_node_bw_bytes_per_s = 5e9
inter_node_latency_s = 1e-5
cross_kind_bw_bytes_per_s = 20e9
cross_kind_latency_s = 2e-6
""",
    )
    c = load_cluster(p)
    # Cross-kind is never faster than the NIC, nor lower-latency than a plain inter-node hop.
    assert c.link(0, 2) == Link(5e9, 1e-5, "infiniband")


def test_network_defaults(tmp_path):
    c = load_cluster(write(tmp_path, one_group(nodes=2)))
    assert c.name == "cluster"
    assert c.cross_kind == c.inter_node
    assert c.link(0, 2) == c.inter_node


# ---------------------------------------------------------------- local kinds


def test_local_kind_full_definition_and_override(tmp_path):
    p = write(
        tmp_path,
        GOOD_KIND
        + """
[kinds.fat-a100]
base = "a100-80gb"
mem_gib = 96
efficiency = 0.6
"""
        + one_group("mine")
        + one_group("fat-a100"),
    )
    c = load_cluster(p)
    mine, fat = c.kinds["mine"], c.kinds["fat-a100"]
    assert mine.mem_bytes == 16 * 1024**3 and mine.mem_bw_bytes_per_s is None
    assert fat.mem_bytes == 96 * 1024**3 and fat.efficiency == 0.6
    base = catalog()["a100-80gb"]
    assert fat.peak_flops == base.peak_flops and fat.source == base.source and fat.name == "fat-a100"


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_to_dict_from_dict_round_trip(name):
    c = load_cluster(EXAMPLES / name)
    d = json.loads(json.dumps(c.to_dict()))
    back = Cluster.from_dict(d)
    assert back == c
    assert back.devices == c.devices
    assert back.to_dict() == c.to_dict()


def test_from_dict_malformed():
    d = load_cluster(EXAMPLES / "local-cpu.toml").to_dict()
    del d["network"]
    with pytest.raises(SpecError, match="malformed"):
        Cluster.from_dict(d, where="plan.json")
    d = load_cluster(EXAMPLES / "local-cpu.toml").to_dict()
    d["kinds"]["cpu-fast"]["bogus"] = 1
    with pytest.raises(SpecError, match=r"plan\.json"):
        Cluster.from_dict(d, where="plan.json")


# ---------------------------------------------------------------- validation errors


def bad_kind(tmp_path: Path, replace: str, by: str) -> Path:
    assert replace in GOOD_KIND
    return write(tmp_path, GOOD_KIND.replace(replace, by) + one_group("mine"))


def test_error_unknown_kind(tmp_path):
    p = write(tmp_path, one_group("a100-81gb"))
    with pytest.raises(SpecError, match=r"unknown device kind 'a100-81gb'") as err:
        load_cluster(p)
    assert "a100-80gb" in str(err.value)  # lists the catalog kinds to pick from
    assert str(p) in str(err.value)


def test_error_unknown_base(tmp_path):
    p = write(tmp_path, '[kinds.x]\nbase = "nope"\n' + one_group("x"))
    with pytest.raises(SpecError, match=r"field 'base' names unknown catalog kind 'nope'"):
        load_cluster(p)


def test_error_base_not_a_string(tmp_path):
    p = write(tmp_path, '[kinds.x]\nbase = ["a100-80gb"]\n' + one_group("x"))
    with pytest.raises(SpecError, match=r"field 'base'"):
        load_cluster(p)


@pytest.mark.parametrize(
    ("replace", "by", "field"),
    [
        ("mem_gib = 16", "mem_gib = -16", "mem_gib"),
        ("mem_gib = 16", "mem_bytes = -1", "mem_bytes"),
        ("mem_gib = 16", 'mem_gib = "16"', "mem_gib"),
        ("mem_gib = 16", "mem_gib = 16\nmem_bytes = 1", "mem_gib"),
        ("efficiency = 0.5", "efficiency = 1.5", "efficiency"),
        ("efficiency = 0.5", "efficiency = 0", "efficiency"),
        ("peak_flops = 1e14", "peak_flop = 1e14", "peak_flop"),
        ("peak_flops = 1e14", "", "peak_flops"),
        ('backend = "nccl"', 'backend = "cuda"', "backend"),
        ("intra_node_latency_s = 5e-6", "intra_node_latency_s = -1.0", "intra_node_latency_s"),
        ("efficiency = 0.5", "efficiency = 0.5\nemulated_slowdown = 0.5", "emulated_slowdown"),
        ("peak_flops = 1e14", "peak_flops = nan", "peak_flops"),
    ],
)
def test_error_bad_kind_field(tmp_path, replace, by, field):
    p = bad_kind(tmp_path, replace, by)
    with pytest.raises(SpecError, match=rf"kinds\.mine: field '{field}'"):
        load_cluster(p)


def test_error_negative_mem_message_is_clear(tmp_path):
    with pytest.raises(SpecError) as err:
        load_cluster(bad_kind(tmp_path, "mem_gib = 16", "mem_gib = -16"))
    msg = str(err.value)
    assert "field 'mem_gib' must be > 0, got -16" in msg and "Fix:" in msg


def test_error_efficiency_above_one_message(tmp_path):
    with pytest.raises(SpecError, match=r"field 'efficiency' must be <= 1, got 1.5"):
        load_cluster(bad_kind(tmp_path, "efficiency = 0.5", "efficiency = 1.5"))


def test_error_emulated_slowdown_below_one_via_base(tmp_path):
    p = write(tmp_path, '[kinds.c]\nbase = "cpu"\nemulated_slowdown = 0.5\n' + one_group("c"))
    with pytest.raises(SpecError, match=r"kinds\.c: field 'emulated_slowdown' must be >= 1, got 0.5"):
        load_cluster(p)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('nam = "x"\n' + one_group(), "nam"),
        ('[[group]]\nkind = "a100-80gb"\nnode = 1\ndevices_per_node = 2\n', "node"),
        ('[[group]]\nkind = "a100-80gb"\ndevices_per_node = 2\n', "nodes"),
        ('[[group]]\nkind = "a100-80gb"\nnodes = 0\ndevices_per_node = 2\n', "nodes"),
        ('[[group]]\nkind = "a100-80gb"\nnodes = 1.5\ndevices_per_node = 2\n', "nodes"),
        ("[[group]]\nnodes = 1\ndevices_per_node = 2\n", "kind"),
        (one_group() + "[network]\ninter_node_bw = 1e9\n", "inter_node_bw"),
        (one_group() + "[network]\ninter_node_bw_bytes_per_s = -1e9\n", "inter_node_bw_bytes_per_s"),
        (one_group() + "[network]\ncross_kind_latency_s = -1.0\n", "cross_kind_latency_s"),
        ("name = 3\n" + one_group(), "name"),
    ],
)
def test_error_bad_cluster_field(tmp_path, text, field):
    with pytest.raises(SpecError, match=rf"field '{field}'"):
        load_cluster(write(tmp_path, text))


@pytest.mark.parametrize("text", ['name = "x"\n', 'name = "x"\ngroup = []\n', 'group = "a100"\n'])
def test_error_missing_group(tmp_path, text):
    with pytest.raises(SpecError, match=r"field 'group' is missing or empty") as err:
        load_cluster(write(tmp_path, text))
    assert "[[group]]" in str(err.value)


def test_error_kinds_not_a_table(tmp_path):
    with pytest.raises(SpecError, match="expected a table"):
        load_cluster(write(tmp_path, 'kinds = "a100"\n' + one_group()))
    with pytest.raises(SpecError, match="expected a table"):
        load_cluster(write(tmp_path, "[kinds]\nx = 3\n" + one_group("x")))


def test_error_malformed_toml(tmp_path):
    p = write(tmp_path, 'name = "x"\n[[group]\nkind = "a100-80gb"\n')
    with pytest.raises(SpecError, match="not valid TOML") as err:
        load_cluster(p)
    assert str(p) in str(err.value) and "Fix:" in str(err.value)


def test_error_not_utf8(tmp_path):
    p = tmp_path / "c.toml"
    p.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(SpecError, match="UTF-8"):
        load_cluster(p)


def test_error_missing_file(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(SpecError, match="does not exist") as err:
        load_cluster(p)
    assert "nope.toml" in str(err.value)
    with pytest.raises(SpecError, match="does not exist"):
        load_cluster(tmp_path)  # a directory is not a cluster file


def test_emulated_links_are_for_emulation_clusters_only() -> None:
    base = {"name": "x", "group": [{"kind": "cpu", "nodes": 2, "devices_per_node": 1}]}
    with pytest.raises(SpecError, match=r"emulated_links.*host_cores"):
        parse_cluster({**base, "emulated_links": True}, where="x")
    with pytest.raises(SpecError, match="emulated_links"):
        parse_cluster({**base, "host_cores": 2, "emulated_links": "yes"}, where="x")
    c = parse_cluster({**base, "host_cores": 2, "emulated_links": True}, where="x")
    assert c.host.links and Cluster.from_dict(c.to_dict()).host.links
    assert not Cluster.from_dict(parse_cluster({**base, "host_cores": 2}, where="x").to_dict()).host.links


HOST_STAGED = ["nvidia-amd-32", "nvidia-ascend-32", "nvidia-iluvatar-32", "nvidia-metax-32", "nvidia-mthreads-32",
               "hethub-768", "three-kinds-48", "cluster-4096"]


@pytest.mark.parametrize("name", HOST_STAGED)
def test_host_staged_cross_kind_figures_are_cited_and_travel_with_the_plan(name: str) -> None:
    """The bridge's host-staged path is priced from a cited public figure for gloo over TCP, never the
    NIC's RDMA rate; the citation travels in the plan's embedded cluster."""
    c = load_cluster(EXAMPLES / f"{name}.toml")
    assert c.cross_kind_source.startswith("cited:") and "gloo" in c.cross_kind_source
    assert c.cross_kind.bw_bytes_per_s < c.inter_node.bw_bytes_per_s / 10
    again = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again.cross_kind_source == c.cross_kind_source and again.cross_kind == c.cross_kind


def test_cross_kind_source_must_be_text() -> None:
    data = {"group": [{"kind": "a100-80gb", "nodes": 1, "devices_per_node": 2}],
            "network": {"cross_kind_source": 3}}
    with pytest.raises(SpecError, match="cross_kind_source"):
        parse_cluster(data, where="c")
