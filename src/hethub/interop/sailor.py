"""Sailor's formats (eth-easl/sailor): per-layer profiles in, plans in and out.

Pure (no torch). It imports only the core (spec, plan, the predictor's profile types); hethub's own
profile loader (:mod:`hethub.profile.format`) reads Sailor's profile files through this module.

Sailor indexes a model's "layers" as 0 = embedding, 1..L = decoder blocks, then the head; its Llama
profiles carry the final norm as a separate entry before the head, which we fold into the head.
Plans: each stage has ``dp`` replicas, listed in ``tmp_per_stage`` one entry per replica,
``[[[sailor_gpu, device_count, zone]], tp]`` (Sailor's simulator indexes the entries replica by replica;
its planners write ``device_count`` = GPUs per VM). Replica r of every stage forms hethub pipeline r.
We write that form (``device_count`` = tp) and also read older grouped entries of ``device_count / tp``
replicas each. Details and caveats: docs/profiles.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hethub.errors import PlanError, SpecError, field_error, load_json, positive_int
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry
from hethub.spec.cluster import Cluster
from hethub.spec.model import PRESETS, ModelSpec

# Sailor's "RTX-2080" GPUs are RTX 2080 Ti cards: its basic_cluster_config.json gives them 11 GiB
# (11811160064 bytes); the RTX 2080 has 8 GB, the 2080 Ti 11 GB (NVIDIA Turing whitepaper).
SAILOR_KINDS = {"A100-40": "a100-40gb", "A100-80": "a100-80gb", "V100-16": "v100-16gb", "GH-96": "gh200",
                "RTX-2080": "rtx-2080-ti", "RTX-3090": "rtx-3090", "Titan-RTX": "titan-rtx"}
# A Sailor plan's GPU name also matches these hethub kinds (a cluster written before the mapping above
# named Sailor's cards rtx-2080); profiles are not registered under them: they are 2080 Ti measurements.
SAILOR_KIND_ALIASES = {"RTX-2080": ("rtx-2080",)}
# Sailor model dir -> (hethub preset, seq_len). Sequence lengths from llm_info.json (activation floats
# per sample / hidden size) and training_config_*.json; Sailor's LLAMA-3-8 is not exactly Llama-3-8B
# (multi-head KV, FFN 16384, vocab 50304 per llm_info.json), so its layer times are ~10% high for it.
SAILOR_MODELS = {"OPT-350": ("opt-350m", 2048), "GPT-Neo-2.7": ("gpt-neo-2.7b", 2048),
                 "LLAMA-3-8": ("llama-3-8b", 8192), "OPT-30": ("opt-30b", 2048)}
DEFAULT_ZONE = "us-central1-a"


@dataclass(frozen=True)
class SailorProfile:
    """One Sailor profile.json as read: the per-layer times, the model it was measured for (Sailor
    names a preset rather than carrying a shape) and a device description."""

    profile: KindProfile
    model_shape: ModelSpec
    device: str


# ---- profiles ---------------------------------------------------------------------------------------
def is_sailor_profile(data: Any) -> bool:
    return (isinstance(data, dict) and bool(data) and all(isinstance(k, str) and k.isdigit() for k in data)
            and all(isinstance(v, dict) for v in data.values()))


def read_sailor_profile(path: str | Path, *, data: Any = None, model: ModelSpec | None = None,
                        kind: str | None = None, seq_len: int | None = None) -> SailorProfile:
    """Read ``<MODEL>/<GPU>/profile.json``; model, kind and seq_len default to what the two directory
    names map to (SAILOR_MODELS, SAILOR_KINDS)."""
    p = Path(path)
    where = str(p)
    if data is None:
        data = load_json(p, missing=f"profile file '{p}' does not exist. Fix: pass an existing Sailor profile.json.",
                         invalid_fix="restore Sailor's file")
    if model is None or seq_len is None:
        mdir = p.parent.parent.name
        if mdir not in SAILOR_MODELS:
            raise SpecError(f"{where}: model directory {mdir!r} is not one of Sailor's "
                            f"({', '.join(SAILOR_MODELS)}). Fix: keep Sailor's <MODEL>/<GPU>/profile.json layout "
                            "or pass model and seq_len explicitly.")
        model = model or PRESETS[SAILOR_MODELS[mdir][0]]
        seq_len = seq_len or SAILOR_MODELS[mdir][1]
    if kind is None:
        gdir = p.parent.name
        if gdir not in SAILOR_KINDS:
            raise SpecError(f"{where}: GPU directory {gdir!r} is not one of Sailor's ({', '.join(SAILOR_KINDS)}). "
                            "Fix: keep Sailor's <MODEL>/<GPU>/profile.json layout or pass kind explicitly.")
        kind = SAILOR_KINDS[gdir]
    if not is_sailor_profile(data):
        raise SpecError(f"{where}: not a Sailor profile (expected mbs -> tp -> layer -> [fwd_s, bwd_s, update_s] "
                        "with integer keys). Fix: pass Sailor's profile.json unchanged.")
    entries: dict[tuple[int, int], ProfileEntry] = {}
    for mbs_key, by_tp in data.items():
        for tp_key, layers in by_tp.items():
            f = f"{mbs_key}.{tp_key}"
            if not tp_key.isdigit() or not isinstance(layers, dict):
                raise SpecError(f"{where}: field '{f}' must map layer indices to times. Fix: restore the file.")
            entries[(int(mbs_key), int(tp_key))] = _entry(layers, where=where, f=f, model=model)
    prof = KindProfile(kind=kind, model=model.name, seq_len=seq_len, entries=entries, source=f"sailor:{where}")
    return SailorProfile(profile=prof, model_shape=model, device=f"sailor: {p.parent.name}")


def _entry(layers: dict[str, Any], *, where: str, f: str, model: ModelSpec) -> ProfileEntry:
    times = {}
    for k, v in layers.items():
        ok = (k.isdigit() and isinstance(v, list) and len(v) == 3
              and all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in v))
        if not ok:
            raise SpecError(f"{where}: field '{f}.{k}' must be [forward_s, backward_s, update_s] under an "
                            f"integer layer index, got {v!r}. Fix: restore Sailor's profile.json.")
        times[int(k)] = LayerTimes(float(v[0]), float(v[1]), float(v[2]))
    for k, t in times.items():  # Sailor's embedding has a 0 backward at times; a layer or the head never does
        if k > 0 and not (t.fwd_s > 0 and t.bwd_s > 0):
            raise SpecError(f"{where}: field '{f}.{k}' has forward/backward times {t.fwd_s}/{t.bwd_s} s: a decoder "
                            "layer or head takes time. Fix: restore Sailor's profile.json, or re-measure.")
    n, L = len(times), model.num_layers
    if sorted(times) != list(range(n)) or n not in (L + 2, L + 3):
        raise SpecError(f"{where}: field '{f}' has layer entries {min(times)}..{max(times)} ({n}), but "
                        f"{model.name!r} needs {L + 2} (embedding, {L} decoder layers, head) or {L + 3} (with "
                        "the final norm apart). Fix: this profile belongs to another model; use that model's.")
    dec = [times[i] for i in range(1, L + 1)]
    head = times[n - 1]
    if n == L + 3:  # the final norm runs where the head runs; its update is one more tiny step
        norm = times[L + 1]
        head = LayerTimes(head.fwd_s + norm.fwd_s, head.bwd_s + norm.bwd_s, head.update_s + norm.update_s)
    layer = LayerTimes(*(sum(getattr(t, a) for t in dec) / L for a in ("fwd_s", "bwd_s", "update_s")))
    return ProfileEntry(embedding=times[0], layer=layer, head=head)


# ---- plans: import ---------------------------------------------------------------------------------
def sailor_plan_model(data: Any) -> ModelSpec | None:
    """The model a Sailor plan names, if it does: Sailor's plans usually don't (then the caller's --model
    decides). Accepts a Sailor model name (``"OPT-350"``) or a hethub preset under a ``model`` key."""
    name = data.get("model") if isinstance(data, dict) else None
    if not isinstance(name, str):
        return None
    preset = SAILOR_MODELS[name][0] if name in SAILOR_MODELS else name
    if preset not in PRESETS:
        raise PlanError(f"sailor plan: field 'model' is {name!r}, not a Sailor model ({', '.join(SAILOR_MODELS)}) "
                        "or hethub preset. Fix: remove it and pass --model.")
    return PRESETS[preset]


def import_sailor_plan(data: Any, *, cluster: Cluster, model: ModelSpec, seq_len: int, where: str = "sailor plan"
                       ) -> Plan:
    """Convert a Sailor plan into a validated hethub Plan on concrete devices of ``cluster``.

    Every ``pipeline_list`` entry is imported: Sailor's simulator runs them together as one plan
    (its step is the slowest entry's pipeline time plus the gradient syncs within and across
    entries; its FlashFlex baseline writes one entry per pipeline), so each entry's ``dp`` replicas
    become hethub pipelines of the same plan, entry after entry. Each replica runs
    ceil(gbs / (mbs x dp x entries)) micro-batches, as Sailor's simulator computes it (``dp`` of the
    last entry); when that rounds up, the plan's global batch is larger than ``gbs`` and
    ``plan.meta["sailor"]`` keeps the file's ``gbs`` (and says so in ``note``).

    The plan's ``p2p`` is "lockstep": Sailor trains with a fork of DeepSpeed's pipeline engine, whose
    TrainSchedule runs each stage's sends and receives in a fixed order, each a blocking rendezvous
    (``p2p_note`` says so; docs/predictor.md, "Runtime profiles").
    """
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object with pipeline_list, mbs and gbs. Fix: pass a Sailor plan.")
    for key in ("pipeline_list", "mbs", "gbs"):
        if key not in data:
            raise _perr(where, key, "is missing", "add it (Sailor plans carry pipeline_list, mbs and gbs)")
    mbs, gbs = _pint(data["mbs"], where, "mbs"), _pint(data["gbs"], where, "gbs")
    plist = data["pipeline_list"]
    if not isinstance(plist, list) or not plist:
        raise _perr(where, "pipeline_list", "must be a non-empty list of pipeline definitions", "add one")
    entries = [_entry_def(pdef, pw=f"pipeline_list[{i}]", where=where, model=model) for i, pdef in enumerate(plist)]
    dp_last = entries[-1][2]
    m = -(-gbs // (mbs * dp_last * len(entries)))  # Sailor's simulator: math.ceil(gbs / (mbs * dp * pipelines))
    zones: set[str] = set()
    free = {d.id for d in cluster.devices}
    pipelines: list[Pipeline] = []
    for i, (spans, tmps, dp) in enumerate(entries):
        f = f"pipeline_list[{i}].tmp_per_stage"
        replicas = [_replicas(tmps[s], dp, where=where, f=f"{f}[{s}]", cluster=cluster, zones=zones)
                    for s in range(len(spans))]
        stage_devs = [[_take(cluster, free, kind, tp, where=where) for kind, tp in reps] for reps in replicas]
        pipelines += [Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(
            Stage(kind=replicas[s][r][0], devices=stage_devs[s][r], layers=spans[s][0],
                  embedding=spans[s][1], head=spans[s][2]) for s in range(len(spans))))
            for r in range(dp)]
    total = m * mbs * len(pipelines)
    meta: dict[str, Any] = {"zone": sorted(zones)[0] if len(zones) == 1 else DEFAULT_ZONE,
                            "final_norm_apart": entries[0][0][-1][3], "gbs": gbs,
                            "entries": [dp for _, _, dp in entries]}
    if total != gbs:
        meta["note"] = (f"gbs {gbs} is not {mbs} (mbs) x {len(pipelines)} replicas x a whole number of "
                        f"micro-batches; like Sailor's simulator, each replica runs ceil(gbs / (mbs x dp x "
                        f"pipelines)) = {m}, so the global batch is {total}")
    meta["p2p_note"] = ("p2p set to lockstep: Sailor runs DeepSpeed's pipeline engine, whose TrainSchedule runs "
                        "in lock-step, each blocking send meeting its blocking receive; 'hethub predict --p2p async' "
                        "predicts hethub's own runtime instead")
    # What Sailor's runs used: fp32 training (its configs and memory model count 4-byte floats) and
    # attention that materialises the scores (its measured per-layer activations, llm_info.json, grow
    # with heads x seq^2: LLaMA-3-8 keeps 92 floats per token per hidden unit at s=8192, hethub's math
    # formula 88, a flash kernel's 24). Recorded per kind so the predictor counts the same.
    kinds = sorted({s.kind for p in pipelines for s in p.stages})
    plan = Plan(model=model, cluster=cluster, global_batch=total, seq_len=seq_len, pipelines=tuple(pipelines),
                strategy="sailor", meta={"sailor": meta}, precision="fp32",
                kind_settings={k: {"attention": "math"} for k in kinds}, p2p="lockstep")
    return plan.validate()


def _entry_def(pdef: Any, *, pw: str, where: str, model: ModelSpec) -> tuple[list, list, int]:
    """(layer spans, tmp_per_stage, dp) of one pipeline_list entry, checked."""
    for key in ("layers_per_stage", "tmp_per_stage", "dp"):
        if not isinstance(pdef, dict) or not isinstance(pdef.get(key), list):
            raise _perr(where, f"{pw}.{key}", "is missing or not a list", "write it as in Sailor's plans")
    layers_ps, tmps, dps = pdef["layers_per_stage"], pdef["tmp_per_stage"], pdef["dp"]
    n = len(layers_ps)
    if not n or len(tmps) != n or len(dps) != n or pdef.get("num_stages", n) != n:
        raise _perr(where, f"{pw}.num_stages", f"disagrees with layers_per_stage ({n}), tmp_per_stage "
                    f"({len(tmps)}) and dp ({len(dps)})", "give one entry per stage in each")
    dp = _pint(dps[0], where, f"{pw}.dp[0]")
    if any(d != dp for d in dps):
        raise _perr(where, f"{pw}.dp", f"is {dps}; hethub pipelines need the same replica count in every stage",
                    "use one dp for all stages")
    return _layer_spans(layers_ps, model=model, where=where, pw=pw), tmps, dp


def _layer_spans(layers_ps: list[Any], *, model: ModelSpec, where: str, pw: str
                 ) -> list[tuple[tuple[int, int], bool, bool, bool]]:
    flat = [x for st in layers_ps for x in (st if isinstance(st, list) else [None])]
    L, total = model.num_layers, len(flat)
    if flat != list(range(total)) or total not in (L + 2, L + 3) or any(not st for st in layers_ps):
        raise _perr(where, f"{pw}.layers_per_stage", f"must list Sailor layers 0..{L + 1} (embedding, "
                    f"{L} decoder layers of {model.name!r}, head) in order, each stage non-empty",
                    f"check the plan belongs to {model.name!r} (pass the right --model)")
    spans, start = [], 0
    for st in layers_ps:
        dec = [i - 1 for i in st if 1 <= i <= L]
        end = dec[-1] + 1 if dec else start
        head = total - 1 in st
        if total == L + 3 and (L + 1 in st) != head:
            raise _perr(where, f"{pw}.layers_per_stage", f"puts the final norm (layer {L + 1}) and the head "
                        f"(layer {L + 2}) on different stages", "keep them on one stage")
        spans.append(((start, end), 0 in st, head, total == L + 3))
        start = end
    return spans


def _replicas(groups: Any, dp: int, *, where: str, f: str, cluster: Cluster, zones: set[str]
              ) -> list[tuple[str, int]]:
    """The (kind, tp) of each replica of one stage, in order."""
    if not isinstance(groups, list) or not groups:
        raise _perr(where, f, "must be a non-empty list of [[[gpu, count, zone], ...], tp]", "write it so")
    parsed = []
    for gi, g in enumerate(groups):
        gw = f"{f}[{gi}]"
        ok = isinstance(g, list) and len(g) == 2 and isinstance(g[0], list) and g[0] and all(
            isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) for v in g[0])
        if not ok:
            raise _perr(where, gw, f"is {g!r}", "write [[[gpu, device_count, zone], ...], tp]")
        tp = _pint(g[1], where, f"{gw}[1]")
        names = {v[0] for v in g[0]}
        if len(names) > 1:
            raise _perr(where, gw, f"mixes GPU kinds {sorted(names)} in one group", "give each kind its own group")
        count = sum(_pint(v[1], where, f"{gw}[0][*][1]") for v in g[0])
        zones.update(str(v[2]) for v in g[0])
        parsed.append((_kind(names.pop(), cluster=cluster, where=where, f=f"{gw}[0][0][0]"), tp, count))
    if sum(c // t for _, t, c in parsed) == dp and all(c % t == 0 for _, t, c in parsed):
        return [(k, t) for k, t, c in parsed for _ in range(c // t)]  # groups of count/tp replicas
    if len(parsed) == dp:
        return [(k, t) for k, t, _ in parsed]  # Sailor planners' form: one entry per replica
    raise _perr(where, f, f"describes {sum(c // t for _, t, c in parsed)} replicas (device_count / tp per group), "
                f"but dp is {dp}", "make the groups' device counts add up to dp x tp")


def _kind(name: str, *, cluster: Cluster, where: str, f: str) -> str:
    for k in (SAILOR_KINDS.get(name), *SAILOR_KIND_ALIASES.get(name, ()), name):
        if k in cluster.kinds:
            return k
    raise _perr(where, f, f"names GPU {name!r} (hethub kind {SAILOR_KINDS.get(name, name)!r}), which cluster "
                f"{cluster.name!r} does not have",
                f"use a cluster with that kind (this one has {', '.join(cluster.kind_names)})")


def _take(cluster: Cluster, free: set[int], kind: str, tp: int, *, where: str) -> tuple[int, ...]:
    """The lowest-numbered ``tp`` free devices of ``kind`` on the first node that has that many."""
    by_node: dict[int, list[int]] = {}
    for d in cluster.devices:
        if d.kind == kind and d.id in free:
            by_node.setdefault(d.node, []).append(d.id)
    for ids in by_node.values():
        if len(ids) >= tp:
            free.difference_update(ids[:tp])
            return tuple(ids[:tp])
    raise PlanError(f"{where}: cluster {cluster.name!r} has no node with {tp} more free {kind!r} devices for the "
                    f"next tensor-parallel replica (it has {cluster.count_by_kind().get(kind, 0)} of that kind). "
                    "Fix: use a cluster with more devices of that kind, or a plan with fewer/smaller replicas.")


# ---- plans: export ---------------------------------------------------------------------------------
def export_sailor_plan(plan: Plan, *, nearest_equal: bool = False) -> dict[str, Any]:
    """Sailor's form of ``plan``; PlanError says what Sailor's format cannot express.

    Pipelines that split the layers alike form one ``pipeline_list`` entry, one ``tmp_per_stage``
    entry per replica; pipelines split differently form separate entries (Sailor's simulator runs
    all entries as one plan). Sailor gives every replica the same micro-batch count,
    ceil(gbs / (mbs x dp x entries)); a plan whose replicas take unequal shares is refused, or with
    ``nearest_equal`` written with every replica at the mean count rounded to the nearest whole
    number (gbs then written for that count). Refused, naming the feature: several micro-batch
    sizes, a schedule other than 1F1B, recomputation, ZeRO (any optimizer sharding), interleaved
    chunks, context or sequence parallelism, a stage with nothing on it.
    """
    ps = plan.pipelines
    mbs = {p.micro_batch_size for p in ps}
    if len(mbs) > 1:
        _nope(f"pipelines use different micro-batch sizes {sorted(mbs)}; Sailor's plan has one 'mbs'")
    if plan.schedule != "1f1b":
        _nope(f"the schedule is {plan.schedule!r}; Sailor runs 1F1B")
    if any(s.recompute for p in ps for s in p.stages):
        _nope("some stages recompute activations; Sailor's plan format has no recomputation flag")
    if plan.optimizer_sharding != "none":
        _nope(f"the optimizer state is sharded (training.optimizer_sharding {plan.optimizer_sharding!r}: ZeRO-"
              f"{plan.zero_stage}); Sailor's plan format has no ZeRO stage and its runs keep whole optimizer state "
              "on every replica", zero=True)
    if any(p.virtual_stages > 1 for p in ps):
        _nope("some pipelines interleave model chunks (virtual stages); Sailor runs one chunk per stage")
    if any(s.cp > 1 for p in ps for s in p.stages):
        _nope("some stages use context parallelism (cp > 1); Sailor's plan format has only TP per stage")
    if any(s.sequence_parallel for p in ps for s in p.stages):
        _nope("some stages use sequence parallelism; Sailor's plan format has no such flag")
    if any(s.layers[0] == s.layers[1] and not s.embedding and not s.head for p in ps for s in p.stages):
        _nope("a stage holds no layer, embedding or head; Sailor's layers_per_stage needs a layer on every stage")
    nmb = sorted({p.num_micro_batches for p in ps})
    m = nmb[0]
    if len(nmb) > 1:
        if not nearest_equal:
            _nope(f"pipelines take unequal batch shares ({nmb} micro-batches); Sailor gives every data-parallel "
                  "replica ceil(gbs / (mbs x dp x pipelines)) micro-batches", nearest=True)
        m = max(1, round(sum(p.num_micro_batches for p in ps) / len(ps)))
    # Zone and a Llama-style separate final-norm entry are Sailor-only facts kept from an import.
    info = plan.meta.get("sailor") if isinstance(plan.meta.get("sailor"), dict) else {}
    zone, apart = str(info.get("zone", DEFAULT_ZONE)), bool(info.get("final_norm_apart", False))
    groups = _entries(ps, info.get("entries"))
    k, dp_last = len(groups), len(groups[-1])
    if len({len(g) for g in groups}) > 1:  # Sailor's count uses the last entry's dp: one entry per pipeline
        groups, k, dp_last = [[p] for p in ps], len(ps), 1
    gbs = info.get("gbs") if isinstance(info.get("gbs"), int) else None
    if gbs is None or -(-gbs // (ps[0].micro_batch_size * dp_last * k)) != m:
        gbs = m * ps[0].micro_batch_size * len(ps)
    return {"pipeline_list": [_entry_out(g, zone=zone, apart=apart, n_layers=plan.model.num_layers) for g in groups],
            "mbs": ps[0].micro_batch_size, "gbs": gbs}


def _entries(ps: tuple[Pipeline, ...], counts: Any) -> list[list[Pipeline]]:
    """Pipelines grouped into pipeline_list entries: by an import's entry sizes where they still fit
    (each a run of pipelines with one layer split), else by layer split in order of appearance."""
    def split(p: Pipeline) -> tuple:
        return tuple(s.layers for s in p.stages)

    if isinstance(counts, list) and all(isinstance(c, int) and c > 0 for c in counts) and sum(counts) == len(ps):
        out, i = [], 0
        for c in counts:
            out.append(list(ps[i:i + c]))
            i += c
        if all(len({split(p) for p in g}) == 1 for g in out):
            return out
    by_split: dict[tuple, list[Pipeline]] = {}
    for p in ps:
        by_split.setdefault(split(p), []).append(p)
    return list(by_split.values())


def _entry_out(group: list[Pipeline], *, zone: str, apart: bool, n_layers: int) -> dict[str, Any]:
    names = {a: k for k, al in SAILOR_KIND_ALIASES.items() for a in al} | {v: k for k, v in SAILOR_KINDS.items()}
    layers_ps, tmps = [], []
    stages = group[0].stages
    for si, stage in enumerate(stages):
        (start, end), first, last = stage.layers, si == 0, si == len(stages) - 1
        idx = ([0] if first else []) + [i + 1 for i in range(start, end)]
        idx += ([n_layers + 1, n_layers + 2] if apart else [n_layers + 1]) if last else []
        layers_ps.append(idx)
        # One entry per data-parallel replica, as Sailor's planners write it: its simulator indexes
        # tmp_per_stage[stage][replica] and fails on grouped entries.
        tmps.append([[[[names.get(p.stages[si].kind, p.stages[si].kind), p.stages[si].tp, zone]],
                      p.stages[si].tp] for p in group])
    n = len(layers_ps)
    return {"num_stages": n, "layers_per_stage": layers_ps, "tmp_per_stage": tmps, "dp": [len(group)] * n}


def _nope(why: str, *, nearest: bool = False, zero: bool = False) -> None:
    fix = ("export the nearest equal-share plan instead (export_sailor_plan(plan, nearest_equal=True), "
           "'hethub export-plan --nearest-equal'), or keep hethub's plan format" if nearest else
           "plan without ZeRO ('hethub plan --runtime deepspeed --optimizer-sharding none'), or keep hethub's "
           "plan format" if zero else
           "plan for Sailor's runtime ('hethub plan --runtime deepspeed --optimizer-sharding none': 1F1B, equal "
           "replica shares, no recomputation), or keep hethub's plan format")
    raise PlanError(f"cannot write this plan in Sailor's format: {why}. Fix: {fix}.")


def _pint(v: Any, where: str, f: str) -> int:
    return positive_int(v, where=where, field=f, cls=PlanError)


def _perr(where: str, f: str, problem: str, fix: str) -> PlanError:
    return field_error(where, f, problem, fix, cls=PlanError)
