"""``StageFits.over``'s answers kept between plans (``stage_fits._FLOORS_OVER``) are each plan's own: over
the plans of test_stage_fits_fastpath (ZeRO 0-3, equal and proportional shares, SP, CP, mixed TP
degrees in a sync group, interleaving) at headrooms on both sides of each stage's peak, with and
without the point-to-point bound, every mode, the memo filled by all of them in one pass, the answers
equal the reference path's (hethub/memo.py), which keeps none."""

from __future__ import annotations

from test_stage_fits_fastpath import PLANS, _tight

from hethub.memo import clear_caches, reference_path
from hethub.plan import Recompute
from hethub.predict.stage_fits import StageFits


def _answers(cases: list) -> list[tuple[int, ...]]:
    out = []
    for plan, headroom in cases:
        everyone = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]
        for bound in (False, True):
            fits = StageFits(plan, mem_headroom=headroom, p2p_bound=bound)
            out += [tuple(sorted(fits.over(mode, asked=everyone))) for mode in (None, *Recompute)]
    return out


def test_the_floors_kept_between_plans_are_each_plans_own() -> None:
    with reference_path():
        cases = [(plan, h) for plan in PLANS.values() for h in _tight(plan)]
        want = _answers(cases)
    clear_caches()
    assert _answers(cases) == want
    assert _answers(cases) == want  # again, every answer from the memo
    # Some stages are refused and some not, at one plan's several headrooms: a key without one of them fails.
    assert any(want) and not all(want)
