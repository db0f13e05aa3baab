"""hethub's own profile file: measured per-layer times of one model on one device kind (JSON, versioned).

A file holds one (model, kind, seq_len) and, per (micro-batch size, TP degree), the forward, backward
and optimizer-update seconds of the embedding, of one decoder layer and of the head. The model's full
shape travels with it so that a profile is never silently applied to a different model. The field
by field description is in docs/profiles.md.

:func:`load_profiles` also reads Sailor's ``profile.json`` files (through :mod:`hethub.interop.sailor`),
so a directory may mix both.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hethub.emulation.effects import HostEffects, effects_from_dict, effects_to_dict
from hethub.errors import SpecError, field_error, load_json, positive_int
from hethub.interop.sailor import is_sailor_profile, read_sailor_profile
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.spec.model import ModelSpec

PROFILE_FORMAT = "hethub-profile"
PROFILE_VERSION = 1
_PARTS = ("embedding", "layer", "head")
_TIMES = ("fwd_s", "bwd_s", "update_s")


@dataclass(frozen=True)
class ProfileFile:
    """One profile as read from disk, with what the file says about where it came from."""

    profile: KindProfile
    model_shape: ModelSpec | None  # None where the format does not carry a shape (Sailor: preset by name)
    device: str
    # What the file measured about its host (optional fields wake_penalty, speed_spread; local
    # emulation hosts only): hethub.emulation's, not the kind's.
    host: HostEffects | None = None


@dataclass(frozen=True)
class ScanResult:
    profiles: ProfileSet
    skipped: tuple[str, ...]  # one line per file not used: "<path>: <reason>"
    host_effects: dict[str, HostEffects] = field(default_factory=dict)  # by kind, where files measured them


# ---- writing ---------------------------------------------------------------------------------------
def profile_to_dict(profile: KindProfile, *, model: ModelSpec, device: str, measured_at: str | None = None,
                    host: HostEffects | None = None) -> dict[str, Any]:
    """The file's JSON; `host`: the host effects measured with it (local emulation hosts), if any."""
    if profile.model != model.name:
        raise SpecError(f"profile of kind {profile.kind!r} is for model {profile.model!r}, not {model.name!r}. "
                        "Fix: pass the ModelSpec the profile was measured with.")
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": model.name,
        "model_shape": model.to_dict(),
        "kind": profile.kind,
        "device": device,
        "seq_len": profile.seq_len,
        "measured_at": measured_at or datetime.now(UTC).isoformat(timespec="seconds"),
        "entries": [
            {"mbs": mbs, "tp": tp,
             **{part: _times_dict(getattr(e, part)) for part in _PARTS},
             "peak_mem_bytes": e.peak_mem_bytes,
             **({} if e.tp_comm_included else {"tp_comm_included": False}),
             **({"layer_depths": [{"layers": k, **_times_dict(t)} for k, t in e.layer_by_depth]}
                if e.layer_by_depth else {}),
             **({"cpu_fraction": e.cpu_fraction} if e.cpu_fraction != 1.0 else {})}
            for (mbs, tp), e in sorted(profile.entries.items())
        ],
        **effects_to_dict(host),
    }


def write_profile(path: str | Path, profile: KindProfile, *, model: ModelSpec, device: str,
                  measured_at: str | None = None, host: HostEffects | None = None) -> None:
    from hethub.outfiles import write_text_atomic

    data = profile_to_dict(profile, model=model, device=device, measured_at=measured_at, host=host)
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _times_dict(t: LayerTimes) -> dict[str, float]:
    return {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s, "update_s": t.update_s}


# ---- reading ---------------------------------------------------------------------------------------
def read_profile(path: str | Path) -> KindProfile:
    """Read one profile file, hethub's or Sailor's ``profile.json``."""
    return read_profile_file(path).profile


def read_profile_file(path: str | Path) -> ProfileFile:
    p = Path(path)
    data = read_json_file(p)
    if isinstance(data, dict) and "format" in data:
        return profile_from_dict(data, where=str(p), source=str(p))
    if is_sailor_profile(data):
        sp = read_sailor_profile(p, data=data)
        return ProfileFile(profile=sp.profile, model_shape=sp.model_shape, device=sp.device)
    raise SpecError(f"{p}: not a profile: field 'format' is missing. Fix: pass a file written by 'hethub profile' "
                    f"(format {PROFILE_FORMAT!r}) or a Sailor profile.json.")


def profile_from_dict(data: Any, *, where: str, source: str = "") -> ProfileFile:
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a JSON object. Fix: pass a file written by 'hethub profile'.")
    if data.get("format") != PROFILE_FORMAT:
        raise _err(where, "format", f"is {data.get('format')!r}, not {PROFILE_FORMAT!r}",
                   "pass a file written by 'hethub profile'")
    if data.get("version") != PROFILE_VERSION:
        raise _err(where, "version", f"is {data.get('version')!r}; this hethub reads version {PROFILE_VERSION}",
                   "re-measure with this version's 'hethub profile' (or use the hethub that wrote it)")
    for key in ("model", "model_shape", "kind", "device", "seq_len", "entries"):
        if key not in data:
            raise _err(where, key, "is missing", "add it (see docs/profiles.md)")
    model = data["model"]
    kind = data["kind"]
    for key, v in (("model", model), ("kind", kind), ("device", data["device"])):
        if not isinstance(v, str) or (key != "device" and not v):
            raise _err(where, key, f"must be a non-empty string, got {v!r}", "write a name")
    try:
        shape = ModelSpec.from_dict(data["model_shape"], where=f"{where}: field 'model_shape'")
    except SpecError as err:  # ModelSpec's own checks do not know the file
        msg = str(err)
        raise SpecError(msg if msg.startswith(where) else f"{where}: field 'model_shape': {msg}") from None
    if shape.name != model:
        raise _err(where, "model_shape.name", f"is {shape.name!r} but field 'model' is {model!r}",
                   "make them the same")
    seq_len = _pos_int(data["seq_len"], where, "seq_len")
    if not isinstance(data["entries"], list) or not data["entries"]:
        raise _err(where, "entries", "must be a non-empty list", "add at least one measured (mbs, tp) entry")
    entries: dict[tuple[int, int], ProfileEntry] = {}
    for i, e in enumerate(data["entries"]):
        f = f"entries[{i}]"
        if not isinstance(e, dict):
            raise _err(where, f, "must be an object", "write {\"mbs\": .., \"tp\": .., \"layer\": {..}, ..}")
        for key in ("mbs", "tp", *_PARTS):
            if key not in e:
                raise _err(where, f"{f}.{key}", "is missing", "add it (see docs/profiles.md)")
        mbs, tp = _pos_int(e["mbs"], where, f"{f}.mbs"), _pos_int(e["tp"], where, f"{f}.tp")
        if (mbs, tp) in entries:
            raise _err(where, f, f"repeats mbs={mbs}, tp={tp}", "keep one entry per (mbs, tp)")
        mem = e.get("peak_mem_bytes")
        if mem is not None:
            mem = _pos_int(mem, where, f"{f}.peak_mem_bytes")
        included = e.get("tp_comm_included", True)  # optional (absent in older files): collectives inside
        if not isinstance(included, bool):
            raise _err(where, f"{f}.tp_comm_included", f"must be true or false, got {included!r}",
                       "write true if the TP all-reduces are inside the times")
        cpu_fraction = e.get("cpu_fraction", 1.0)  # optional: wall-clock TP entries on CPU
        if isinstance(cpu_fraction, bool) or not isinstance(cpu_fraction, int | float) or not 0 < cpu_fraction <= 1:
            raise _err(where, f"{f}.cpu_fraction", f"must be a number in (0, 1], got {cpu_fraction!r}",
                       "re-measure with 'hethub profile' or leave it out")
        entries[(mbs, tp)] = ProfileEntry(*(_times(e[part], where, f"{f}.{part}", busy=part != "embedding")
                                            for part in _PARTS),
                                          peak_mem_bytes=mem, tp_comm_included=included,
                                          layer_by_depth=_depths(e.get("layer_depths", []), where, f"{f}.layer_depths"),
                                          cpu_fraction=float(cpu_fraction))
    prof = KindProfile(kind=kind, model=model, seq_len=seq_len, entries=entries, source=source or where)
    return ProfileFile(profile=prof, model_shape=shape, device=data["device"],
                       host=effects_from_dict(data, where=where))


def _times(t: Any, where: str, f: str, *, busy: bool = True) -> LayerTimes:
    """Times of one part. With ``busy`` (decoder layers, the head) forward and backward must be > 0: a
    layer that takes no time is not a measurement, and would make every plan look infinitely fast."""
    if not isinstance(t, dict):
        raise _err(where, f, "must be an object", 'write {"fwd_s": .., "bwd_s": .., "update_s": ..}')
    vals = []
    for key in _TIMES:
        v = t.get(key)
        positive = busy and key != "update_s"
        if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0
                or (positive and v == 0)):
            raise _err(where, f"{f}.{key}", f"must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
                       f"got {v!r}", "write the measured time in seconds (re-measure with 'hethub profile')")
        vals.append(float(v))
    return LayerTimes(*vals)


def _depths(v: Any, where: str, f: str) -> tuple[tuple[int, LayerTimes], ...]:
    """Optional (absent in older files): per-layer times measured on stacks of k > 1 decoder layers."""
    if not isinstance(v, list):
        raise _err(where, f, "must be a list", 'write [{"layers": k, "fwd_s": .., "bwd_s": .., "update_s": ..}, ..]')
    out: dict[int, LayerTimes] = {}
    for i, d in enumerate(v):
        if not isinstance(d, dict):
            raise _err(where, f"{f}[{i}]", "must be an object",
                       'write {"layers": k, "fwd_s": .., "bwd_s": .., "update_s": ..}')
        k = _pos_int(d.get("layers"), where, f"{f}[{i}].layers")
        if k < 2 or k in out:
            raise _err(where, f"{f}[{i}].layers", f"is {k}: must be >= 2 and appear once",
                       "list each stack depth above 1 once (depth 1 is field 'layer')")
        out[k] = _times(d, where, f"{f}[{i}]")
    return tuple(sorted(out.items()))


def _pos_int(v: Any, where: str, f: str) -> int:
    return positive_int(v, where=where, field=f, cls=SpecError)


def _err(where: str, f: str, problem: str, fix: str) -> SpecError:
    return field_error(where, f, problem, fix, cls=SpecError)


def read_json_file(p: Path) -> Any:
    return load_json(p, missing=f"profile file '{p}' does not exist. Fix: pass an existing profile file or directory.",
                     invalid_fix="re-measure or restore the file")


# ---- loading many --------------------------------------------------------------------------------
def scan_profiles(sources: str | Path | Iterable[str | Path], *, model: ModelSpec | None = None,
                  seq_len: int | None = None) -> ScanResult:
    """Read profile files and directories (searched recursively for ``*.json``) into one ProfileSet.

    A profile for another model shape or sequence length than the requested ones would mislead the
    predictor. A file named explicitly raises SpecError; a file found in a directory is skipped and
    reported in ``skipped`` (a directory may well hold profiles of several models), as is any JSON
    there that is not a profile or that is malformed.
    """
    if isinstance(sources, str | Path):
        sources = [sources]
    found: list[KindProfile] = []
    skipped: list[str] = []
    effects: dict[str, HostEffects] = {}
    for src in sources:
        p = Path(src)
        if p.is_dir():
            for f in sorted(p.rglob("*.json")):
                try:
                    pf = read_profile_file(f)
                    _check_match(pf, model=model, seq_len=seq_len)
                except SpecError as err:
                    skipped.append(str(err))
                    continue
                found.append(pf.profile)
                _note_effects(effects, pf)
        else:
            pf = read_profile_file(p)
            _check_match(pf, model=model, seq_len=seq_len)
            found.append(pf.profile)
            _note_effects(effects, pf)
    return ScanResult(profiles=merge_profiles(found), skipped=tuple(skipped), host_effects=effects)


def _note_effects(effects: dict[str, HostEffects], pf: ProfileFile) -> None:
    """Keep a file's host effects under its kind; a later file's measurement wins, field by field."""
    if pf.host:
        effects[pf.profile.kind] = pf.host.merged_over(effects.get(pf.profile.kind))


def load_profiles(sources: str | Path | Iterable[str | Path], *, model: ModelSpec | None = None,
                  seq_len: int | None = None) -> ProfileSet:
    """:func:`scan_profiles`, with each skipped file reported as a warning (a CLI prints ``skipped``)."""
    res = scan_profiles(sources, model=model, seq_len=seq_len)
    for line in res.skipped:
        warnings.warn(f"profile skipped: {line}", stacklevel=2)
    return res.profiles


def load_host_effects(sources: str | Path | Iterable[str | Path], *, model: ModelSpec | None = None,
                      seq_len: int | None = None) -> dict[str, HostEffects]:
    """The host effects (wake penalty, speed spread) the profile files of :func:`load_profiles` carry,
    by kind: for :func:`hethub.emulation.host.host_model` (local emulation hosts)."""
    return scan_profiles(sources, model=model, seq_len=seq_len).host_effects


def _check_match(pf: ProfileFile, *, model: ModelSpec | None, seq_len: int | None) -> None:
    prof = pf.profile
    if model is not None and pf.model_shape is not None and not same_shape(pf.model_shape, model):
        diff = [k for k, v in model.to_dict().items() if k != "name" and pf.model_shape.to_dict()[k] != v]
        raise SpecError(f"{prof.source}: profile is for model {prof.model!r}, whose shape differs from "
                        f"{model.name!r} in {', '.join(diff)}. Fix: profile {model.name!r} "
                        "('hethub profile') or leave this file out.")
    if seq_len is not None and prof.seq_len != seq_len:
        raise SpecError(f"{prof.source}: profile was measured at seq_len {prof.seq_len}, the plan uses "
                        f"{seq_len}. Fix: profile at seq_len {seq_len} or leave this file out.")


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    """Equal in everything that affects layer times (the name does not)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("name")
    db.pop("name")
    return da == db


def merge_profiles(profiles: Iterable[KindProfile | ProfileSet]) -> ProfileSet:
    """Combine profiles into one set. Several profiles of one kind are united entry by entry (a later
    (mbs, tp) entry replaces an earlier one, so a re-measurement wins); they must agree on model and
    seq_len, else SpecError."""
    by_kind: dict[str, KindProfile] = {}
    for item in profiles:
        for prof in item.by_kind.values() if isinstance(item, ProfileSet) else (item,):
            old = by_kind.get(prof.kind)
            if old is None:
                by_kind[prof.kind] = prof
                continue
            if (old.model, old.seq_len) != (prof.model, prof.seq_len):
                raise SpecError(f"{prof.source}: profile of kind {prof.kind!r} is for model {prof.model!r} at "
                                f"seq_len {prof.seq_len}, but {old.source} has {old.model!r} at seq_len "
                                f"{old.seq_len}. Fix: load one model's profiles at one sequence length at a time.")
            by_kind[prof.kind] = KindProfile(kind=prof.kind, model=prof.model, seq_len=prof.seq_len,
                                             entries={**old.entries, **prof.entries},
                                             source=f"{old.source}; {prof.source}")
    return ProfileSet(by_kind=by_kind)
