"""Property test: malformed cluster, model and plan files are answered with one clear paragraph.

Every generated file is broken on purpose in one named field. The CLI must exit non-zero, print a
single-paragraph error that names that field, and never print a traceback.
"""

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, gpu_two_kind_plan, two_stage_plan
from hethub import cli
from hethub.plan import Pipeline, Stage
from hethub.spec._toml import read_toml

FUZZ = settings(max_examples=180, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

BAD_NUMBERS = st.sampled_from([0, -1, -2.5, "fast", True, [1, 2], {"x": 1}, math.inf])
BAD_INTS = st.sampled_from([0, -3, 1.5, "four", False, [4], {"n": 4}])


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"


def to_toml(d: dict) -> str:
    """Enough TOML for cluster files: scalars, [kinds.X] tables, [[group]] arrays, [network]."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict | list) or k == "name"]
    for name, table in d.get("kinds", {}).items():
        lines.append(f'\n[kinds."{name}"]')
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    for g in d.get("group", []):
        lines.append("\n[[group]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in g.items()]
    if "network" in d:
        lines.append("\n[network]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in d["network"].items()]
    return "\n".join(lines) + "\n"


def _run(argv, capsys) -> tuple[int, str]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, err


def _assert_clear(code: int, err: str, field: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    text = err.strip()
    assert text.count("\n") == 0, f"expected one paragraph, got:\n{err}"
    assert field in text, f"error does not name {field!r}: {text}"
    assert "Fix" in text


BASE_CLUSTER = read_toml(EXAMPLES / "local-cpu.toml", what="cluster")
CLUSTER_FIELDS = (
    [("group", i, k) for i in range(len(BASE_CLUSTER["group"])) for k in ("nodes", "devices_per_node")]
    + [("network", k) for k in BASE_CLUSTER.get("network", {})]
    + [("kinds", n, k) for n, t in BASE_CLUSTER.get("kinds", {}).items() for k in t if k not in ("base", "notes")]
)


@FUZZ
@given(data=st.data())
def test_malformed_cluster_files(tmp_path, capsys, data):
    d = copy.deepcopy(BASE_CLUSTER)
    how = data.draw(st.sampled_from(["bad_value", "unknown_key", "unknown_kind", "drop_required"]))
    if how == "bad_value":
        path = data.draw(st.sampled_from(CLUSTER_FIELDS))
        parent = d[path[0]] if len(path) == 2 else d[path[0]][path[1]]
        key = path[-1]
        is_int = key in ("nodes", "devices_per_node")
        value = data.draw(BAD_INTS if is_int else BAD_NUMBERS)
        if key.endswith("latency_s") and value == 0:
            value = -1  # zero latency is legal
        if key == "emulated_slowdown" and value == 0:
            value = 0.5
        parent[key] = value
        field = key
    elif how == "unknown_key":
        field = data.draw(st.sampled_from(["nodez", "mem_gb", "bandwidth", "devices"]))
        target = data.draw(st.sampled_from(["group", "network", "top"]))
        (d["group"][0] if target == "group" else d.setdefault("network", {}) if target == "network" else d)[field] = 1
    elif how == "unknown_kind":
        field = data.draw(st.sampled_from(["h900", "a100", "tpu-v9"]))
        d["group"][0]["kind"] = field
    else:
        key = data.draw(st.sampled_from(["kind", "nodes", "devices_per_node"]))
        del d["group"][0][key]
        field = key
    path = tmp_path / "cluster.toml"
    path.write_text(to_toml(d))
    code, err = _run(["plan", "--cluster", str(path), "--model", "tiny", "--global-batch", "4", "--seq-len", "16"],
                     capsys)
    _assert_clear(code, err, field)


LLAMA_CFG = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


@FUZZ
@given(data=st.data())
def test_malformed_model_configs(tmp_path, capsys, data):
    cfg = dict(LLAMA_CFG)
    how = data.draw(st.sampled_from(["bad_value", "drop", "model_type", "indivisible"]))
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
    if how == "bad_value":
        field = data.draw(st.sampled_from([*required, "num_key_value_heads", "max_position_embeddings"]))
        cfg[field] = data.draw(BAD_INTS)
    elif how == "drop":
        field = data.draw(st.sampled_from(required))
        del cfg[field]
    elif how == "model_type":
        field = "model_type"
        cfg[field] = data.draw(st.sampled_from(["bert", "t5", "mamba"]))
    else:
        field = "num_kv_heads"
        cfg["num_key_value_heads"] = 3
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(cfg))
    code, err = _run(["plan", "--cluster", str(EXAMPLES / "local-cpu.toml"), "--model", str(path),
                      "--global-batch", "4", "--seq-len", "16"], capsys)
    _assert_clear(code, err, field)


BASE_PLAN = two_stage_plan().to_dict()
PLAN_INT_FIELDS = [("training", "global_batch"), ("training", "seq_len"), ("pipelines", 0, "micro_batch_size"),
                   ("pipelines", 0, "num_micro_batches"), ("model", "num_layers"), ("model", "hidden_size"),
                   ("model", "vocab_size")]
STAGE_FIELDS = ["kind", "devices", "layers", "embedding", "head", "tp", "ranks", "recompute"]


@FUZZ
@given(data=st.data())
def test_malformed_plan_files(tmp_path, capsys, data):
    d = copy.deepcopy(BASE_PLAN)
    how = data.draw(st.sampled_from(["int_field", "stage_field", "drop", "cluster_number"]))
    if how == "int_field":
        path = data.draw(st.sampled_from(PLAN_INT_FIELDS))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        field = path[-1]
        parent[field] = data.draw(BAD_INTS)
    elif how == "stage_field":
        si = data.draw(st.integers(0, 1))
        field = data.draw(st.sampled_from(STAGE_FIELDS))
        bad = {"kind": st.sampled_from(["tpu", 7, None]), "devices": st.sampled_from([[99], [0, 0], "0", [True]]),
               "layers": st.sampled_from([[0], [3, 1], "0-4", [0, 99]]),
               "embedding": st.sampled_from(["yes", 1, None]), "head": st.sampled_from(["no", 0, None]),
               "tp": st.sampled_from([3, 0, "2"]), "ranks": st.sampled_from([[7], "0", [1, 2]]),
               "recompute": st.sampled_from(["on", 2])}[field]
        value = data.draw(bad)
        if field in ("embedding", "head") and value is None:
            value = "null"
        d["pipelines"][0]["stages"][si][field] = value
        if field == "devices" and value == [0, 0]:
            field = "devices"
    elif how == "drop":
        field = data.draw(st.sampled_from(["training", "pipelines", "model", "cluster", "stages", "layers"]))
        if field == "stages":
            del d["pipelines"][0]["stages"]
        elif field == "layers":
            del d["pipelines"][0]["stages"][0]["layers"]
        else:
            del d[field]
    else:
        kind = data.draw(st.sampled_from(sorted(d["cluster"]["kinds"])))
        field = data.draw(st.sampled_from(["mem_bytes", "peak_flops", "intra_node_bw_bytes_per_s"]))
        d["cluster"]["kinds"][kind][field] = data.draw(BAD_NUMBERS)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    code, err = _run(["predict", "--plan", str(path)], capsys)
    _assert_clear(code, err, field)


def test_garbage_files_are_rejected(tmp_path, capsys):
    bad = tmp_path / "c.toml"
    bad.write_text("[[group]\nkind = ")
    argv = ["plan", "--cluster", str(bad), "--model", "tiny", "--global-batch", "4", "--seq-len", "8"]
    code, err = _run(argv, capsys)
    _assert_clear(code, err, "TOML")
    badj = tmp_path / "p.json"
    badj.write_bytes(b"\xff\xfe{")
    code, err = _run(["predict", "--plan", str(badj)], capsys)
    _assert_clear(code, err, "JSON")


@pytest.mark.parametrize("argv", [["plan", "--cluster", "nope.toml", "--model", "tiny", "--global-batch", "4",
                                   "--seq-len", "8"], ["predict", "--plan", "nope.json"]])
def test_missing_files(argv, capsys):
    code, err = _run(argv, capsys)
    _assert_clear(code, err, "nope")


# ---- one table of malformed and extreme inputs across the commands --------------------------------------
# Each row: (name, argv with {placeholders} for files made in `bad`, documented exit code, text the message
# must name: the field, flag or file). Every row must: exit with that code (docs/cli.md), print no
# traceback, name what is wrong, and print its message once. No row may start a training rank.
DOCUMENTED_CODES = {1, 2, 3, 4, 5, 6, 7}
LOCAL = str(EXAMPLES / "local-cpu.toml")
A100 = str(EXAMPLES / "a100-v100-32.toml")
SAILOR_PLAN = str(EXAMPLES.parent / "sailor" / "opt350m-a100-v100-plan.json")
PLAN = ["plan", "--cluster", LOCAL, "--model", "tiny", "--global-batch", "4", "--seq-len", "32"]
CASES = [
    # plan: cluster numbers out of physical range, device counts, flags, files
    ("plan peak_flops 1e30", ["plan", "--cluster", "{c_flops}", "--model", "tiny", "--global-batch", "4",
                              "--seq-len", "32"], 2, "peak_flops"),
    ("plan peak_flops 1e3", ["plan", "--cluster", "{c_slowflops}", "--model", "tiny", "--global-batch", "4",
                             "--seq-len", "32"], 2, "peak_flops"),
    ("plan 10M devices", ["plan", "--cluster", "{c_huge}", "--model", "tiny", "--global-batch", "4",
                          "--seq-len", "32"], 2, "10,000,000 devices"),
    ("plan 2048 per node", ["plan", "--cluster", "{c_pernode}", "--model", "tiny", "--global-batch", "4",
                            "--seq-len", "32"], 2, "devices_per_node"),
    ("plan bandwidth 1e20", ["plan", "--cluster", "{c_bw}", "--model", "tiny", "--global-batch", "4",
                             "--seq-len", "32"], 2, "inter_node_bw_bytes_per_s"),
    ("plan latency 5 s", ["plan", "--cluster", "{c_lat}", "--model", "tiny", "--global-batch", "4",
                          "--seq-len", "32"], 2, "cross_kind_latency_s"),
    ("plan memory 1 kB", ["plan", "--cluster", "{c_mem}", "--model", "tiny", "--global-batch", "4",
                          "--seq-len", "32"], 2, "mem_bytes"),
    ("plan mem_gib 1e6", ["plan", "--cluster", "{c_gib}", "--model", "tiny", "--global-batch", "4",
                          "--seq-len", "32"], 2, "mem_gib"),
    ("plan global batch 0", [*PLAN[:6], "0", "--seq-len", "32"], 2, "--global-batch"),
    ("plan seq-len -1", [*PLAN[:8], "-1"], 2, "--seq-len"),
    ("plan seq-len beyond model", [*PLAN[:8], "100000"], 2, "--seq-len"),
    ("plan unknown model", ["plan", "--cluster", LOCAL, "--model", "gpt-9", "--global-batch", "4", "--seq-len",
                            "32"], 2, "gpt-9"),
    ("plan missing cluster", ["plan", "--cluster", "{missing}", "--model", "tiny", "--global-batch", "4",
                              "--seq-len", "32"], 2, "missing.toml"),
    ("plan too big for the cluster", ["plan", "--cluster", LOCAL, "--model", "llama-140b", "--global-batch", "8",
                                      "--seq-len", "4096"], 5, "llama-140b"),
    ("plan zero-time profile", [*PLAN, "--profiles", "{p_zero}"], 2, "fwd_s"),
    ("plan NaN profile", [*PLAN, "--profiles", "{p_nan}"], 2, "bwd_s"),
    ("plan missing profile", [*PLAN, "--profiles", "{missing}"], 2, "missing.toml"),
    ("plan profile of another seq_len", [*PLAN, "--profiles", "{p_seq}"], 2, "seq_len"),
    ("plan --out unwritable", [*PLAN, "--out", "/proc/hethub/plan.json"], 1, "--out"),
    ("plan missing links", [*PLAN, "--links", "{missing}"], 2, "missing.toml"),
    # predict: plan files
    ("predict world_size disagrees", ["predict", "--plan", "{plan_world}"], 3, "world_size"),
    ("predict missing plan", ["predict", "--plan", "{missing}"], 3, "missing.toml"),
    ("predict truncated plan", ["predict", "--plan", "{plan_cut}"], 3, "JSON"),
    ("predict plan peak_flops 1e30", ["predict", "--plan", "{plan_flops}"], 3, "peak_flops"),
    ("predict plan short of its batch", ["predict", "--plan", "{plan_batch}"], 3, "global batch"),
    ("predict zero-time profile", ["predict", "--plan", "{plan}", "--profiles", "{p_zero}"], 2, "fwd_s"),
    # train: everything refused before any rank starts
    ("train steps 0", ["train", "--plan", "{plan}", "--steps", "0"], 2, "--steps"),
    ("train steps -5", ["train", "--plan", "{plan}", "--steps", "-5"], 2, "--steps"),
    ("train lr -1", ["train", "--plan", "{plan}", "--lr", "-1"], 2, "--lr"),
    ("train lr nan", ["train", "--plan", "{plan}", "--lr", "nan"], 2, "--lr"),
    ("train warmup beyond steps", ["train", "--plan", "{plan}", "--steps", "4", "--warmup-steps", "9"], 2,
     "--warmup-steps"),
    ("train resume auto without dir", ["train", "--plan", "{plan}", "--resume", "auto"], 2, "--checkpoint-dir"),
    ("train resume missing dir", ["train", "--plan", "{plan}", "--resume", "{missing}"], 7, "missing.toml"),
    ("train GPU plan on this host", ["train", "--plan", "{plan_gpu}"], 6, "a100-40gb"),
    ("train plan over device memory", ["train", "--plan", "{plan_big}"], 4, "GiB"),
    ("train metrics unwritable", ["train", "--plan", "{plan}", "--metrics", "/proc/hethub/m.jsonl"], 1,
     "--metrics"),
    ("train missing plan", ["train", "--plan", "{missing}"], 3, "missing.toml"),
    # train: what used to fail only inside every rank (issue 34)
    ("train zero1 on one replica", ["train", "--plan", "{plan_zero1}"], 3, "optimizer_sharding"),
    ("train empty data", ["train", "--plan", "{plan}", "--data", "{d_empty}"], 2, "d_empty.txt"),
    ("train binary data", ["train", "--plan", "{plan}", "--data", "{d_binary}"], 2, "binary data"),
    ("train missing data", ["train", "--plan", "{plan}", "--data", "{missing}"], 2, "missing.toml"),
    ("train missing tokenizer", ["train", "--plan", "{plan}", "--tokenizer", "{out}/tok.json"], 2, "--tokenizer"),
    ("train init-from truncated shard", ["train", "--plan", "{plan_hf}", "--init-from", "{hf_cut}"], 2,
     "truncated"),
    ("train init-from missing shard", ["train", "--plan", "{plan_hf}", "--init-from", "{hf_gap}"], 2,
     "is missing"),
    ("train init-from another model", ["train", "--plan", "{plan}", "--init-from", "{hf_cut}"], 3, "--init-from"),
    ("train metrics under a file", ["train", "--plan", "{plan}", "--metrics", "{plan}/m.jsonl"], 1, "is a file"),
    ("train checkpoint-dir name too long", ["train", "--plan", "{plan}", "--checkpoint-dir", "{out}/" + "c" * 300],
     1, "bytes long"),
    ("train config steps as a string", ["train", "--plan", "{plan}", "--config", "{cfg_steps}"], 2,
     "'train.steps'"),
    ("train config lr -1", ["train", "--plan", "{plan}", "--config", "{cfg_lr}"], 2, "'optim.lr'"),
    ("plan out name too long", [*PLAN, "--out", "{out}/" + "p" * 300 + ".json"], 1, "bytes long"),
    ("export out under a file", ["export", "--checkpoint", "{missing}", "--out", "{plan}/hf"], 1, "is a file"),
    ("export out name too long", ["export", "--checkpoint", "{missing}", "--out", "{out}/" + "e" * 300], 1,
     "bytes long"),
    ("export out unwritable", ["export", "--checkpoint", "{missing}", "--out", "/proc/hethub/hf"], 1, "--out"),
    # report: metrics that do not belong to the plan
    ("report truncated metrics", ["report", "--plan", "{plan}", "--metrics", "{m_cut}", "--out", "{out}"], 1,
     "m_cut.jsonl"),
    ("report another plan's metrics", ["report", "--plan", "{plan}", "--metrics", "{m_other}", "--out", "{out}"],
     3, "'tokens'"),
    ("report metrics of a rank not in the plan", ["report", "--plan", "{plan}", "--metrics", "{m_rank}", "--out",
                                                  "{out}"], 3, "'rank'"),
    ("report missing metrics", ["report", "--plan", "{plan}", "--metrics", "{missing}", "--out", "{out}"], 1,
     "missing.toml"),
    ("report out unwritable", ["report", "--plan", "{plan}", "--out", "/proc/hethub/r"], 1, "--out"),
    # import-plan: Sailor plans
    ("import missing file", ["import-plan", "--format", "sailor", "{missing}", "--cluster", A100, "--model",
                             "opt-350m"], 3, "Sailor plan file"),
    ("import not JSON", ["import-plan", "--format", "sailor", "{plan_cut}", "--cluster", A100, "--model",
                         "opt-350m"], 3, "JSON"),
    ("import mbs 0", ["import-plan", "--format", "sailor", "{s_gbs}", "--cluster", A100, "--model",
                      "opt-350m"], 3, "mbs"),
    ("import other model's layers", ["import-plan", "--format", "sailor", SAILOR_PLAN, "--cluster", A100,
                                     "--model", "llama-3-8b"], 3, "layers_per_stage"),
    ("import bad cluster", ["import-plan", "--format", "sailor", SAILOR_PLAN, "--cluster", "{c_flops}",
                            "--model", "opt-350m"], 2, "peak_flops"),
    # profile: refused before measuring anything
    ("profile tp 3", ["profile", "--model", "small", "--tp", "3", "--out", "{out}/p.json"], 2, "--tp"),
    ("profile seq-len beyond model", ["profile", "--model", "small", "--seq-len", "4096", "--out",
                                      "{out}/p.json"], 2, "--seq-len"),
    ("profile out unwritable", ["profile", "--model", "small", "--out", "/proc/hethub/p.json"], 1, "--out"),
    ("profile mbs 0", ["profile", "--model", "small", "--mbs", "0", "--out", "{out}/p.json"], 2, "--mbs"),
    ("profile no GPU", ["profile", "--model", "small", "--device", "cuda:3", "--out", "{out}/p.json"], 6,
     "--device"),
    ("profile two kinds into one file", ["profile", "--model", "small", "--kind", "a,b", "--out", "{out}/p.json"],
     2, "--out"),
    ("profile repeats 0", ["profile", "--model", "small", "--repeats", "0", "--out", "{out}/p.json"], 2,
     "--repeats"),
]


def _cluster_with(path, kind_line: str = "", group: str = "nodes = 1\ndevices_per_node = 2", net: str = ""):
    path.write_text(f'name = "bad"\n[kinds.k]\nbase = "cpu"\n{kind_line}\n[[group]]\nkind = "k"\n{group}\n'
                    + (f"[network]\n{net}\n" if net else ""))
    return str(path)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """The input files of CASES, made once."""
    from hethub.plan import Plan
    from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry
    from hethub.profile.format import profile_to_dict
    from hethub.spec.model import get_model

    d = tmp_path_factory.mktemp("bad")
    f = {"missing": str(d / "missing.toml"), "out": str(d / "out")}
    f["c_flops"] = _cluster_with(d / "c_flops.toml", "peak_flops = 1e30")
    f["c_slowflops"] = _cluster_with(d / "c_slowflops.toml", "peak_flops = 1e3")
    f["c_huge"] = _cluster_with(d / "c_huge.toml", group="nodes = 1250000\ndevices_per_node = 8")
    f["c_pernode"] = _cluster_with(d / "c_pernode.toml", group="nodes = 1\ndevices_per_node = 2048")
    f["c_bw"] = _cluster_with(d / "c_bw.toml", net="inter_node_bw_bytes_per_s = 1e20")
    f["c_lat"] = _cluster_with(d / "c_lat.toml", net="cross_kind_latency_s = 5")
    f["c_mem"] = _cluster_with(d / "c_mem.toml", "mem_bytes = 1000")
    f["c_gib"] = _cluster_with(d / "c_gib.toml", "mem_gib = 1e6")
    assert cli.main([*PLAN, "--precision", "fp32", "--out", str(d / "plan.json")]) == 0
    f["plan"] = str(d / "plan.json")
    data = json.loads((d / "plan.json").read_text())
    for name, change in (("plan_world", lambda x: x.update(world_size=x["world_size"] + 30)),
                         ("plan_flops", lambda x: next(iter(x["cluster"]["kinds"].values())).update(peak_flops=1e30)),
                         ("plan_batch", lambda x: x["training"].update(global_batch=3 * x["training"]["global_batch"]))
                         ):
        x = copy.deepcopy(data)
        change(x)
        (d / f"{name}.json").write_text(json.dumps(x))
        f[name] = str(d / f"{name}.json")
    (d / "plan_cut.json").write_text((d / "plan.json").read_text()[:200])
    f["plan_cut"] = str(d / "plan_cut.json")
    gpu_two_kind_plan().save(d / "gpu.json")
    f["plan_gpu"] = str(d / "gpu.json")
    cluster = load_cluster_for_big()
    model = get_model("llama-2-7b")
    stage = Stage("cpu-fast", (0,), (0, model.num_layers), embedding=True, head=True)
    Plan(model=model, cluster=cluster, global_batch=1, seq_len=128,
         pipelines=(Pipeline(1, 1, (stage,)),)).validate().save(d / "big.json")
    f["plan_big"] = str(d / "big.json")
    tiny = get_model("tiny")
    t = LayerTimes(1e-3, 2e-3, 1e-4)
    prof = KindProfile(kind="cpu-fast", model="tiny", seq_len=32, entries={(1, 1): ProfileEntry(t, t, t)})
    good = profile_to_dict(prof, model=tiny, device="cpu")
    for name, value, seq in (("p_zero", 0.0, 32), ("p_nan", math.nan, 32), ("p_seq", 1e-3, 64)):
        x = copy.deepcopy(good)
        x["seq_len"] = seq
        for e in x["entries"]:
            for part in ("layer", "head"):
                e[part]["fwd_s" if name == "p_zero" else "bwd_s"] = value
        (d / f"{name}.json").write_text(json.dumps(x))
        f[name] = str(d / f"{name}.json")
    plan = Plan.load(d / "plan.json")
    (d / "m_cut.jsonl").write_text('{"step": 0, "loss"')
    (d / "m_other.jsonl").write_text(json.dumps({"step": 0, "step_time_s": 1.0, "tokens": plan.tokens_per_step * 2})
                                     + "\n")
    (d / "m_rank.jsonl").write_text(json.dumps({"step": 0, "step_time_s": 1.0, "ranks": [
        {"rank": plan.world_size + 5, "events": []}]}) + "\n")
    for name in ("m_cut", "m_other", "m_rank"):
        f[name] = str(d / f"{name}.jsonl")
    _issue34_inputs(d, f)
    sailor = json.loads(open(SAILOR_PLAN).read())
    sailor["mbs"] = 0
    (d / "s_gbs.json").write_text(json.dumps(sailor))
    f["s_gbs"] = str(d / "s_gbs.json")
    return f


def _issue34_inputs(d, f) -> None:
    """Inputs that pass the older pre-launch checks and used to fail inside every rank."""
    from dataclasses import replace

    from hethub.runtime.hf_io import spec_from_folder, write_random_model

    replace(two_stage_plan(), optimizer_sharding="zero1").save(d / "zero1.json")
    f["plan_zero1"] = str(d / "zero1.json")
    (d / "d_empty.txt").write_text("")
    (d / "d_binary.txt").write_bytes(bytes(range(256)) * 64)
    f["d_empty"], f["d_binary"] = str(d / "d_empty.txt"), str(d / "d_binary.txt")
    cfg = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
    (d / "hf.json").write_text(json.dumps(cfg))
    write_random_model(d / "hf.json", d / "hf_cut")
    shard = d / "hf_cut" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    from hethub.runtime.hf_io import write_folder
    from hethub.runtime.model import StageModel

    spec = spec_from_folder(d / "hf_cut")[0]
    model = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True)
    write_folder(d / "hf_gap", config=json.loads((d / "hf_cut" / "config.json").read_text()),
                 tensors=list(model.named_parameters()), max_shard_bytes=20_000)
    next(iter(sorted((d / "hf_gap").glob("model-*.safetensors")))).unlink()
    two_stage_plan(model=spec, split=2).save(d / "plan_hf.json")
    f["hf_cut"], f["hf_gap"], f["plan_hf"] = str(d / "hf_cut"), str(d / "hf_gap"), str(d / "plan_hf.json")
    (d / "cfg_steps.toml").write_text('[train]\nsteps = "5"\n')
    (d / "cfg_lr.toml").write_text("[optim]\nlr = -1\n")
    f["cfg_steps"], f["cfg_lr"] = str(d / "cfg_steps.toml"), str(d / "cfg_lr.toml")


def load_cluster_for_big():
    from hethub.spec.cluster import load_cluster

    return load_cluster(LOCAL)


@pytest.mark.parametrize("name,argv,code,names", CASES, ids=[c[0] for c in CASES])
def test_bad_inputs_get_one_clear_message_and_a_documented_code(bad, capsys, monkeypatch, name, argv, code, names):
    from hethub.runtime import launch

    def no_ranks(*a, **k):
        raise AssertionError("a training rank was started")

    monkeypatch.setattr(launch, "launch_local", no_ranks)
    argv = [a.format(**bad) for a in argv]
    try:
        got = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors: documented as 2
        got = exc.code
    out = capsys.readouterr()
    err = out.err
    assert got == code and got in DOCUMENTED_CODES, f"{name}: exit {got}, expected {code}\n{err}"
    assert "Traceback" not in err + out.out
    assert names in err, f"{name}: the message does not name {names!r}:\n{err}"
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1, f"{name}: expected one error message, got:\n{err}"


def test_the_table_is_broad():
    assert len(CASES) >= 40
    assert {c[1][0] for c in CASES} >= {"plan", "predict", "train", "report", "import-plan", "profile"}
