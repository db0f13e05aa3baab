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

from conftest import EXAMPLES, two_stage_plan
from hethub import cli
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
