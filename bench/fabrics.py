"""The fabric curves (predict/fabrics.py) against the cited collective measurements (predict/cited_comm.py).

Prints, per fabric, every cited point: the measured time, the time hethub prices the same collective
at (its steps x latency + link bytes at the curve's efficiency) and the error; held-out points are
marked. ``--fit`` refits each fitted curve's three numbers (eff_max, half_bytes, shape; Nelder-Mead on
squared log error, calibrate.nelder_mead) and prints them beside the ones in predict/fabrics.py.

Run: PYTHONPATH=src python bench/fabrics.py [--fit] (well under a second).
"""

from __future__ import annotations

import math
import statistics
import sys

from hethub.predict.calibrate import nelder_mead
from hethub.predict.cited_comm import POINTS, CommPoint, measured_time_s
from hethub.predict.fabrics import FABRICS, NVLS, Fabric


def curve_of(point: CommPoint) -> Fabric:
    return NVLS if point.collective == "nvls" else FABRICS[point.fabric]


def priced_s(point: CommPoint, fabric: Fabric) -> float:
    eff = fabric.efficiency(point.link_bytes)
    return point.steps * point.latency_s + point.link_bytes / (point.line_bytes_per_s * eff)


def fit(points: list[CommPoint]) -> tuple[float, float, float]:
    def loss(x: list[float]) -> float:
        eff = 1 / (1 + math.exp(-x[0]))
        f = Fabric("fit", eff, math.exp(x[1]), math.exp(x[2]), "")
        return sum(math.log(priced_s(p, f) / measured_time_s(p)) ** 2 for p in points)

    best = min((nelder_mead(loss, [1.5, math.log(h), math.log(g)], iters=4000, tol=1e-12)
                for h in (1e6, 1e7, 1e8) for g in (0.3, 1.0)), key=loss)
    return 1 / (1 + math.exp(-best[0])), math.exp(best[1]), math.exp(best[2])


def main(argv: list[str]) -> None:
    groups: dict[str, list[CommPoint]] = {}
    for p in POINTS:
        groups.setdefault("nvls" if p.collective == "nvls" else p.fabric, []).append(p)
    for name, pts in groups.items():
        f = curve_of(pts[0])
        errs = []
        print(f"{name}: eff_max {f.eff_max:.4f}, half {f.half_bytes:.3g} B, shape {f.shape:.3f} ({f.source})")
        for p in pts:
            m, t = priced_s(p, f), measured_time_s(p)
            if p.fitted:
                errs.append(abs(m / t - 1))
            print(f"  {p.collective:>14} {p.ranks:>2} ranks {p.payload_bytes / 2**20:>9.1f} MiB: measured "
                  f"{t * 1e6:>10.1f} us, priced {m * 1e6:>10.1f} us ({100 * (m / t - 1):+6.1f}%)"
                  f"{'' if p.fitted else '  held out'}")
        if errs:
            print(f"  fitted points: median |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%")
        if "--fit" in argv and len([p for p in pts if p.fitted]) >= 3:
            e, h, g = fit([p for p in pts if p.fitted])
            print(f"  refit: eff_max {e:.4f}, half_bytes {h:.3g}, shape {g:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
