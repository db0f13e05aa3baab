"""Co-run slowdown in the emulation host's replay (HostEffects.corun, emulation/contention.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hethub.emulation.contention import StageWork, simulate_shared_cores
from hethub.emulation.effects import HostEffects, effects_from_dict, effects_to_dict
from hethub.errors import SpecError

WORK = StageWork(fwd_cpu_s=1.0, fwd_idle_s=0.0, bwd_cpu_s=2.0, bwd_idle_s=0.0, p2p_s=0.0, update_cpu_s=0.0, ranks=1)


def run(stages: dict, *, cores: int, schedule: str = "1f1b", m: int = 1, background: float = 0.0) -> float:
    return simulate_shared_cores(stages=stages, num_micro_batches=[m] * (1 + max(p for p, _ in stages)),
                                 schedule=schedule, cores=cores, groups=[], background_procs=background)[0]


def test_ranks_computing_together_pay_the_corun_factor_and_a_lone_rank_does_not():
    slow = replace(WORK, corun=1.3)
    # One rank: nobody computes beside it, so the factor never applies.
    assert run({(0, 0): slow}, cores=2) == pytest.approx(3.0)
    # Two replicas on two cores compute side by side all the time: 1.3x.
    assert run({(0, 0): slow, (1, 0): slow}, cores=2) == pytest.approx(3.0 * 1.3)
    assert run({(0, 0): WORK, (1, 0): WORK}, cores=2) == pytest.approx(3.0)
    # On four cores one other busy rank fills a third of the other cores: a third of the extra.
    assert run({(0, 0): slow, (1, 0): slow}, cores=4) == pytest.approx(3.0 * 1.1)
    # A busy process of someone else beside a lone rank counts too.
    assert run({(0, 0): slow}, cores=2, background=1.0) == pytest.approx(3.0 * 1.3)


def test_corun_applies_only_while_the_other_core_computes():
    # A 2-stage pipeline, one micro-batch: the stages never compute at the same time (F0 then F1,
    # B1 then B0), so the factor changes nothing; with 8 micro-batches they overlap most of the step.
    a, b = replace(WORK, corun=1.5), replace(WORK, corun=1.5)
    assert run({(0, 0): a, (0, 1): b}, cores=2) == pytest.approx(run({(0, 0): WORK, (0, 1): WORK}, cores=2))
    plain, together = run({(0, 0): WORK, (0, 1): WORK}, cores=2, m=8), run({(0, 0): a, (0, 1): b}, cores=2, m=8)
    assert plain * 1.3 < together < plain * 1.5


def test_a_tp_stage_alone_does_not_pay_for_its_own_ranks():
    # Its profile was measured with its ranks side by side already.
    tp = replace(WORK, ranks=2, corun=1.4)
    assert run({(0, 0): tp}, cores=2) == pytest.approx(3.0)


def test_an_emulated_kind_sleeps_on_the_extra_cpu_time_too():
    # The runtime sleeps (k-1) x the chunk's *thread CPU time*; co-running inflates that CPU time.
    k = 2.0
    emu = replace(WORK, fwd_cpu_s=1.0, fwd_idle_s=1.0, bwd_cpu_s=2.0, bwd_idle_s=2.0, slowdown=k, corun=1.5)
    busy = replace(WORK, fwd_cpu_s=100.0, corun=1.0)  # computes beside it the whole time
    step = simulate_shared_cores(stages={(0, 0): emu, (1, 0): busy}, num_micro_batches=[1, 1], schedule="1f1b",
                                 cores=2, groups=[], record=(events := []))[0]
    assert step == pytest.approx(102.0)
    f = next(e for e in events if e.stage == (0, 0) and e.name == "F0")
    assert f.end_s - f.start_s == pytest.approx(1.5 * k)  # 1.5 s CPU, then a 1.5 s sleep


def test_corun_factor_by_nearest_size_and_the_profile_field_round_trips():
    eff = HostEffects(corun=((1, 1.27), (2, 1.02), (4, 1.0)))
    assert [eff.corun_factor(m) for m in (1, 2, 3, 4, 8)] == [1.27, 1.02, 1.02, 1.0, 1.0]
    assert HostEffects().corun_factor(1) == 1.0
    data = json.loads(json.dumps(effects_to_dict(eff)))
    assert data["corun"][0] == {"mbs": 1, "factor": 1.27}
    assert effects_from_dict(data, where="p.json") == eff
    for bad in ([{"mbs": 1, "factor": 0.9}], [{"mbs": 2, "factor": 1.1}, {"mbs": 1, "factor": 1.1}], {"mbs": 1}):
        with pytest.raises(SpecError, match="corun"):
            effects_from_dict({"corun": bad}, where="p.json")
