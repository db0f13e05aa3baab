"""The ranking figures of bench/predictor_accuracy.py on inputs whose answers are known by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _ranking import average_ranks, misordered_pairs, regret, separated, spearman


def test_average_ranks_share_ties():
    assert average_ranks([30, 10, 20, 10]) == [4.0, 1.5, 3.0, 1.5]
    assert average_ranks([5, 5, 5]) == [2.0, 2.0, 2.0]


def test_spearman_perfect_reversed_and_a_hand_computed_case():
    assert spearman([1, 2, 3, 4], [10, 20, 35, 90]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [9, 7, 5, 1]) == pytest.approx(-1.0)
    # One swap among 5: d = (0, 0, 1, -1, 0), sum d^2 = 2, rho = 1 - 6*2 / (5*24) = 0.9
    assert spearman([1, 2, 3, 4, 5], [1, 2, 4, 3, 5]) == pytest.approx(0.9)


def test_spearman_with_ties_is_pearson_on_average_ranks():
    # ranks x = (1, 2.5, 2.5, 4), y = (1, 2, 3, 4): cov 4.5, var x 4.5, var y 5 -> 4.5 / sqrt(22.5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / 22.5**0.5)


def test_spearman_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="equal"):
        spearman([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="one per plan"):
        spearman([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="at least 2"):
        spearman([1], [1])


def test_regret_of_the_plan_ranked_first():
    # the predictor picks plan 2 (0.9), measured 1.1; the best measured is plan 0 at 1.0 -> 10 %
    chosen, r = regret([1.0, 1.2, 0.9], [1.0, 1.3, 1.1])
    assert chosen == 2 and r == pytest.approx(0.1)
    assert regret([3.0, 1.0, 2.0], [3.0, 1.0, 2.0]) == (1, 0.0)
    # a tie for first counts the worse of the tied plans
    assert regret([1.0, 1.0, 2.0], [1.0, 1.5, 0.5]) == (1, pytest.approx(2.0))


def test_misordered_pairs_largest_gap_first():
    pairs = misordered_pairs([1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 2.4, 1.5])
    # measured order 0 < 3 < 1 < 2; predicted 0 < 2 < 1 < 3: plan 3 (1.5) predicted slower than 1 and 2
    # gaps: 3 vs 2 measured 60 % apart, 3 vs 1 33 %, 1 vs 2 20 %
    assert [(p.faster, p.slower) for p in pairs] == [(3, 2), (3, 1), (1, 2)]
    assert pairs[0].measured_gap == pytest.approx(2.4 / 1.5 - 1)
    assert misordered_pairs([1, 2, 3], [1, 2, 3]) == []


def test_separated_only_when_the_runs_do_not_overlap():
    assert separated([1.0, 1.1, 1.05], [1.2, 1.3])
    assert separated([1.2, 1.3], [1.0, 1.1])
    assert not separated([1.0, 1.25], [1.2, 1.3])  # one slow run of the faster plan: cannot tell
    assert not separated([1.0], [1.0])
    with pytest.raises(ValueError, match="at least one run"):
        separated([], [1.0])
