"""The finish-only simulation of interleaved pipelines (schedules/chunked_sim.py, chunked_finish, what
``simulate_pipeline_time`` runs with chunks) against the records' simulation (``simulate_pipeline``):
the same finishes bit for bit on random pipelines, asynchronous and blocking sends, with and without
a trailing hop, fewer micro-batches than devices included; and the same error on a bad input."""

import random

import pytest

from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time


def _pipeline(rng: random.Random, n: int) -> tuple[list[float], list[float], list[float]]:
    levels = [rng.uniform(1e-3, 0.05) for _ in range(rng.randint(1, 3))]
    fwd = [rng.choice(levels) if rng.random() < 0.7 else rng.uniform(1e-3, 0.05) for _ in range(n)]
    bwd = [f * rng.choice((2.0, rng.uniform(1.5, 3.0))) for f in fwd]
    scale = rng.choice((0.0, 0.01, 0.2, 1.5))  # none ... link-bound
    hops = [scale * rng.uniform(0.5, 1.0) * fwd[0] for _ in range(n - 1 + rng.randint(0, 1))]
    return fwd, bwd, hops


@pytest.mark.parametrize("p2p", ["async", "blocking"])
def test_finish_only_equals_the_records_simulation(p2p: str) -> None:
    rng = random.Random(7 if p2p == "async" else 8)
    for _ in range(120):
        p, v = rng.randint(1, 6), rng.randint(2, 4)
        m = rng.choice((rng.randint(1, p + 1), rng.randint(p, 3 * p + 5)))
        fwd, bwd, hops = _pipeline(rng, p * v)
        kw = {"fwd_s": fwd, "bwd_s": bwd, "p2p_s": hops, "num_micro_batches": m, "schedule": "interleaved",
              "chunks": v, "p2p": p2p}
        try:
            records = simulate_pipeline(**kw)
        except RuntimeError:  # a deadlocked order (m < p) deadlocks in both
            with pytest.raises(RuntimeError, match="deadlocked"):
                simulate_pipeline_time(**kw)
            continue
        assert simulate_pipeline_time(**kw) == [st.finish_s for st in records], (p, v, m)


def test_finish_only_refuses_what_the_records_refuse() -> None:
    with pytest.raises(ValueError, match="need a multiple of 2"):
        simulate_pipeline_time(fwd_s=[1.0] * 3, bwd_s=[1.0] * 3, p2p_s=[0.0] * 2, num_micro_batches=4,
                               schedule="interleaved", chunks=2)
