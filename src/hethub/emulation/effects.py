"""What a profile measured about its host beyond layer times: wake penalty, core speed spread, the
split backward's cost and the co-run slowdown.

They matter only where every rank is a process of one host (local emulation), so they are not part
of a device kind's profile (:class:`hethub.predict.profiles.KindProfile`); the profile file keeps
them as optional fields, ``wake_penalty``, ``speed_spread``, ``split_backward`` and ``corun``
(docs/profiles.md), read and written here and used by :mod:`hethub.emulation.host`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from hethub.emulation.stragglers import SpeedSpread
from hethub.errors import SpecError, field_error


@dataclass(frozen=True)
class HostEffects:
    # Extra CPU seconds of a chunk of work after the rank sat idle for gap_s, ((gap_s, extra_s), ..)
    # by gap (hethub.emulation.measure.wake). Empty: not measured.
    wake_penalty: tuple[tuple[float, float], ...] = ()
    # How much a core's speed wanders against another's, by window length, shortest first
    # (hethub.emulation.measure.spread). Empty: not measured.
    speed_spread: tuple[SpeedSpread, ...] = ()
    # The runtime's split backward (ZB-H1): (B, W) CPU time, each a fraction of one whole backward
    # (hethub.emulation.measure.split). None: not measured (the predictor's halves stand).
    split_backward: tuple[float, float] | None = None
    # Thread CPU time of work while every core computes over the same work alone, ((mbs, factor), ..)
    # by micro-batch size (hethub.emulation.measure.corun). Empty: not measured (no slowdown).
    corun: tuple[tuple[int, float], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.wake_penalty or self.speed_spread or self.split_backward or self.corun)

    def corun_factor(self, mbs: int) -> float:
        """The co-run factor at micro-batch size `mbs`: that of the nearest measured size (the smaller on
        a tie, whose per-op overheads weigh more); 1 where none was measured."""
        if not self.corun:
            return 1.0
        return min(self.corun, key=lambda row: (abs(row[0] - mbs), row[0]))[1]

    def wake_extra_s(self, gap_s: float) -> float:
        """The wake penalty after an idle gap: linear between measured gaps (from 0 at 0), flat beyond."""
        points = [(0.0, 0.0), *self.wake_penalty]
        for (g0, e0), (g1, e1) in itertools.pairwise(points):
            if gap_s <= g1:
                return e0 + (e1 - e0) * max(0.0, gap_s - g0) / (g1 - g0)
        return points[-1][1]

    def merged_over(self, old: HostEffects | None) -> HostEffects:
        """These effects, with `old`'s where these lack one (a later measurement wins)."""
        if old is None:
            return self
        return HostEffects(wake_penalty=self.wake_penalty or old.wake_penalty,
                           speed_spread=self.speed_spread or old.speed_spread,
                           split_backward=self.split_backward or old.split_backward,
                           corun=self.corun or old.corun)


# ---- the profile file's fields ----------------------------------------------------------------------
def effects_to_dict(effects: HostEffects | None) -> dict[str, Any]:
    """The profile file's ``wake_penalty``, ``speed_spread``, ``split_backward`` and ``corun`` fields
    (absent when not measured)."""
    if effects is None:
        return {}
    return {
        **({"wake_penalty": [{"gap_s": g, "extra_s": x} for g, x in effects.wake_penalty]}
           if effects.wake_penalty else {}),
        **({"speed_spread": [{"window_s": sp.window_s, "sigma": sp.sigma} for sp in effects.speed_spread]}
           if effects.speed_spread else {}),
        **({"split_backward": {"b": effects.split_backward[0], "w": effects.split_backward[1]}}
           if effects.split_backward else {}),
        **({"corun": [{"mbs": m, "factor": f} for m, f in effects.corun]} if effects.corun else {}),
    }


def effects_from_dict(data: dict[str, Any], *, where: str) -> HostEffects | None:
    """The optional fields of a profile file, validated; None when none is there."""
    out = HostEffects(wake_penalty=_wake(data.get("wake_penalty", []), where),
                      speed_spread=_spread(data.get("speed_spread", []), where),
                      split_backward=_split(data.get("split_backward"), where),
                      corun=_corun(data.get("corun", []), where))
    return out if out else None


def _err(where: str, f: str, problem: str, fix: str) -> SpecError:
    return field_error(where, f, problem, fix, cls=SpecError)


def _numbers(row: Any, *keys: str) -> bool:
    """Whether `row` is an object whose `keys` all hold numbers (booleans excluded)."""
    return isinstance(row, dict) and all(isinstance(row.get(k), int | float) and not isinstance(row.get(k), bool)
                                         for k in keys)


def _wake(v: Any, where: str) -> tuple[tuple[float, float], ...]:
    """Optional ``wake_penalty``: [{"gap_s": .., "extra_s": ..}, ..] with increasing positive gaps."""
    fix = "re-measure with 'hethub profile --wake-penalty' or leave it out"
    if not isinstance(v, list):
        raise _err(where, "wake_penalty", "must be a list", fix)
    out: list[tuple[float, float]] = []
    for i, row in enumerate(v):
        if not _numbers(row, "gap_s", "extra_s") or row["gap_s"] <= (out[-1][0] if out else 0.0) or row["extra_s"] < 0:
            raise _err(where, f"wake_penalty[{i}]", f"must be {{\"gap_s\": > previous gap, \"extra_s\": >= 0}}, "
                       f"got {row!r}", fix)
        out.append((float(row["gap_s"]), float(row["extra_s"])))
    return tuple(out)


def _spread(v: Any, where: str) -> tuple[SpeedSpread, ...]:
    """Optional ``speed_spread``: [{"window_s": > previous window, "sigma": >= 0}, ..]."""
    fix = "re-measure with 'hethub profile --speed-spread' or leave it out"
    if not isinstance(v, list):
        raise _err(where, "speed_spread", "must be a list", fix)
    out: list[SpeedSpread] = []
    for i, row in enumerate(v):
        shape = '{"window_s": > previous window, "sigma": >= 0}'
        if not _numbers(row, "sigma", "window_s") or (out and row["window_s"] <= out[-1].window_s):
            raise _err(where, f"speed_spread[{i}]", f"must be {shape}, got {row!r}", fix)
        try:
            out.append(SpeedSpread(sigma=float(row["sigma"]), window_s=float(row["window_s"])))
        except ValueError as e:
            raise _err(where, f"speed_spread[{i}]", str(e), fix) from None
    return tuple(out)


def _split(v: Any, where: str) -> tuple[float, float] | None:
    """Optional ``split_backward``: {"b": > 0, "w": >= 0}, fractions of one whole backward."""
    if v is None:
        return None
    if not _numbers(v, "b", "w") or v["b"] <= 0 or v["w"] < 0:
        raise _err(where, "split_backward", f'must be {{"b": > 0, "w": >= 0}}, got {v!r}',
                   "re-measure with 'hethub profile --split-backward' or leave it out")
    return float(v["b"]), float(v["w"])


def _corun(v: Any, where: str) -> tuple[tuple[int, float], ...]:
    """Optional ``corun``: [{"mbs": > previous size, "factor": >= 1}, ..]."""
    fix = "re-measure it (bench/predictor_accuracy.py measures it with the host) or leave it out"
    if not isinstance(v, list):
        raise _err(where, "corun", "must be a list", fix)
    out: list[tuple[int, float]] = []
    for i, row in enumerate(v):
        if (not _numbers(row, "mbs", "factor") or not isinstance(row["mbs"], int) or row["mbs"] < 1
                or (out and row["mbs"] <= out[-1][0]) or row["factor"] < 1):
            raise _err(where, f"corun[{i}]", f'must be {{"mbs": integer > previous size, "factor": >= 1}}, got {row!r}',
                       fix)
        out.append((int(row["mbs"]), float(row["factor"])))
    return tuple(out)
