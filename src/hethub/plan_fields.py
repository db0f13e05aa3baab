"""Reading a plan file's fields (``Plan.from_dict`` assembles them): each value checked against its
type, with the field's full path and the fix in the error."""

from __future__ import annotations

from typing import Any

from hethub.plan_check import fail
from hethub.plan_parts import Pipeline, Recompute, ShardWeights, Stage

_TYPE_WORDS = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object"}


def typed_field(obj: dict[str, Any], key: str, where: str, typ: type, *, default: Any = None) -> Any:
    """obj[key] checked against `typ`, with the field's full path in the error."""
    path = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        fail(where or "(top level)", "must be an object", "see docs/plan-format.md")
    if key not in obj:
        if default is not None:
            return default
        fail(path, "is missing", "add it (see docs/plan-format.md)")
    value = obj[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        fail(path, f"must be {_TYPE_WORDS[typ]}, got {value!r}", f"write {_TYPE_WORDS[typ]}")
    return value


def kind_settings_of(training: dict[str, Any]) -> dict[str, dict[str, str]]:
    kinds = training.get("kinds", {})
    if not isinstance(kinds, dict) or not all(isinstance(v, dict) for v in kinds.values()):
        fail("training.kinds", f"must map kind names to objects, got {kinds!r}",
             'write e.g. {"v100-16gb": {"precision": "fp32", "attention": "math"}}')
    for k, v in kinds.items():
        for key, val in v.items():
            if not isinstance(val, str):
                fail(f"training.kinds.{k}.{key}", f"must be a string, got {val!r}", "write a string")
    return {k: dict(v) for k, v in kinds.items()}


def shard_weights_of(training: dict[str, Any]) -> ShardWeights | None:
    where = "training.optimizer_shard_weights"
    if "optimizer_shard_weights" not in training:
        return None
    got = typed_field(training, "optimizer_shard_weights", "training", dict)
    headroom, by_rank = got.get("mem_headroom"), typed_field(got, "by_rank", where, list)
    if isinstance(headroom, bool) or not isinstance(headroom, int | float):
        fail(f"{where}.mem_headroom", f"must be a number, got {headroom!r}", "write the fraction, e.g. 0.1")
    if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in by_rank):
        fail(f"{where}.by_rank", "must be a list of numbers, one per rank", "re-create the plan with 'hethub plan'")
    return ShardWeights(mem_headroom=float(headroom), by_rank=tuple(float(w) for w in by_rank))


def pipeline_from_dict(p: Any, where: str) -> Pipeline:
    stages = []
    for si, s in enumerate(typed_field(p, "stages", where, list)):
        sw = f"{where}.stages[{si}]"
        devices = typed_field(s, "devices", sw, list)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
            fail(f"{sw}.devices", f"must be a list of device ids, got {devices!r}", "write e.g. [0, 1]")
        chunks: tuple[tuple[int, int], ...] = ()
        if "chunks" in s:
            if "layers" in s:
                fail(f"{sw}.layers", "is given beside 'chunks'", "give either 'layers' or 'chunks', not both")
            raw = typed_field(s, "chunks", sw, list)
            if len(raw) < 2:
                fail(f"{sw}.chunks", f"lists {len(raw)} range(s)",
                     "give two or more layer ranges, or write 'layers' for one")
            chunks = tuple(_layer_range(r, f"{sw}.chunks[{c}]") for c, r in enumerate(raw))
            layers = chunks[0]
        else:
            layers = _layer_range(typed_field(s, "layers", sw, list), f"{sw}.layers")
        cp = typed_field(s, "cp", sw, int, default=1)
        if cp < 1:
            fail(f"{sw}.cp", f"is {cp}", "give the context-parallel degree, an integer >= 1")
        if "tp" in s and s["tp"] * cp != len(devices):
            fail(f"{sw}.tp", f"is {s['tp']!r} but the stage lists {len(devices)} devices for cp {cp}",
                 "a stage's TP degree times its CP degree equals its number of devices")
        stages.append(Stage(kind=typed_field(s, "kind", sw, str), devices=tuple(devices), layers=layers,
                            embedding=typed_field(s, "embedding", sw, bool, default=False),
                            head=typed_field(s, "head", sw, bool, default=False),
                            recompute=_recompute(s, sw), chunks=chunks, cp=cp,
                            sequence_parallel=typed_field(s, "sequence_parallel", sw, bool, default=False)))
    pipe = Pipeline(micro_batch_size=typed_field(p, "micro_batch_size", where, int),
                    num_micro_batches=typed_field(p, "num_micro_batches", where, int), stages=tuple(stages))
    v = typed_field(p, "virtual_stages", where, int, default=1)
    if stages and v != pipe.virtual_stages:
        fail(f"{where}.virtual_stages", f"is {v} but stage 0 lists {pipe.virtual_stages} layer chunk(s)",
             "make it the number of ranges in each stage's 'chunks' (1: 'layers' only)")
    return pipe


def _layer_range(r: Any, fieldname: str) -> tuple[int, int]:
    if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
        fail(fieldname, f"must be [start, end), got {r!r}", "write e.g. [0, 16]")
    return (r[0], r[1])


def _recompute(stage: dict[str, Any], where: str) -> Recompute:
    """A stage's "recompute": a mode's word, or true/false as plans before version 3 wrote it."""
    value = stage.get("recompute", Recompute.NONE.value)
    return Recompute.of(value, where=f"{where}.recompute")
