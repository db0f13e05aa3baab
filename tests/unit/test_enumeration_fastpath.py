"""The enumeration's shortcuts (hethub/memo.py) give exactly the plain search's answers: the kept
candidates' fit checks run only when a decision reads them (`hetero.Results`, `memo.Later`), and
stage models are shared between the cost books of one job (`split.CostBook.stage`). On made-up
candidates, every pruning answer, the kept places and the ranked list equal the reference path's,
which checks each kept candidate as it comes; on real clusters the whole enumeration does."""

from __future__ import annotations

import random

import pytest

from conftest import EXAMPLES
from hethub.memo import reference_path
from hethub.predict.stage_links import LinkBook
from hethub.search import PlannerConfig
from hethub.search.combine import Estimate, Group
from hethub.search.hetero import Results, plan_key
from hethub.search.planner import SHARD_HOLDERS_OPTIMISM, _enumeration
from hethub.search.split import PipeCost, Slot
from hethub.search.variants import enumeration_variants, variants_of
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


def _est(step_s: float, mbs: int, ident: int) -> Estimate:
    pipe = PipeCost(slots=(Slot("k", 1),), mbs=mbs, layers=(ident,), recompute=(False,), fwd_s=(step_s,),
                    bwd_s=(0.0,), update_s=(0.0,), p2p_s=(), params=(1.0,), schedule="gpipe")
    return Estimate(groups=(Group(pipe, 1),), micro_batches=((1,),), step_time_s=step_s)


def _replay(seed: int) -> tuple[list, list, int]:
    """Candidates of a seeded stream (some repeated, a third not fitting) through Results: every
    answer its pruning gave, the ranked list, and the fit checks run."""
    rng = random.Random(seed)
    ests = [_est(round(rng.uniform(1, 2), 2), rng.choice((1, 2)), rng.randrange(40)) for _ in range(120)]
    checked = []

    def fits(est: Estimate) -> bool:
        checked.append(plan_key(est))
        return est.groups[0].pipe.layers[0] % 3 != 0

    results = Results(keep=5, fits=fits, per_size=rng.choice((0, 2)))
    answers = []
    for est in ests:
        answers.append(results.may_enter(est.step_time_s * rng.uniform(0.95, 1.05)))
        results.add(est)
    return answers, [plan_key(e) for e in results.ranked(first=rng.choice((None, 8)))], len(checked)


@pytest.mark.parametrize("seed", range(20))
def test_kept_candidates_checked_when_read_equal_checked_at_once(seed):
    with reference_path():
        want_answers, want_ranked, want_checks = _replay(seed)
    answers, ranked, checks = _replay(seed)
    assert answers == want_answers
    assert ranked == want_ranked
    assert checks <= want_checks


def test_checks_no_decision_reads_are_not_run():
    with reference_path():
        want = sum(_replay(seed)[2] for seed in range(20))
    assert sum(_replay(seed)[2] for seed in range(20)) < want


def test_enumeration_equals_the_reference_path():
    cluster = load_cluster(EXAMPLES / "nvidia-amd-32.toml")
    model = get_model("llama-2-7b")
    config = PlannerConfig(global_batch=256, seq_len=2048)

    def shapes() -> tuple:
        variants, shardings = variants_of(config)
        links = LinkBook(cluster, runtime=config.runtime)
        enums = [v.searcher(config, cluster=cluster, model=model, profiles=None, links=links,
                            holders=SHARD_HOLDERS_OPTIMISM * cluster.num_devices)
                 for v in enumeration_variants(variants, shardings)]
        mixed, alone = _enumeration(enums, host=None, mixed=True)
        return [(plan_key(e), e.step_time_s) for e in mixed], {k: [plan_key(e) for e in v] for k, v in alone.items()}

    with reference_path():
        want = shapes()
    assert shapes() == want
