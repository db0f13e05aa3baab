"""`hethub profile` end to end on the tiny preset, the profile's use by the predictor, and the memory
model against storage accounting of the runtime's own modules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hethub.cli import main
from hethub.emulation.contention import StageWork, simulate_shared_cores
from hethub.emulation.host import host_model
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.profile.format import load_profiles, read_profile, read_profile_file, write_profile
from hethub.profiler.stage_memory import measure_stage_memory
from hethub.spec.cluster import EmulationHost, load_cluster
from hethub.spec.model import PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"

TINY = PRESETS["tiny"]


def _plan(*, tp: int = 1, schedule: str = "1f1b", stages: int = 2, attention: str | None = None,
          recompute: str = "none", precision: str = "fp32") -> Plan:
    """A plan on the local CPU kinds; in mixed precision their kinds are told they run it (the
    runtime autocasts CPU ranks only on request: ``measure_stage_memory(precision=...)``)."""
    from dataclasses import replace

    cluster = load_cluster(EXAMPLES / "local-cpu.toml")
    if precision != "fp32":
        kinds = {n: replace(k, precisions=(precision, "fp32")) for n, k in cluster.kinds.items()}
        cluster = replace(cluster, kinds=kinds)
    if tp > 1:
        st = (Stage("cpu-fast", (0, 1), (0, 4), embedding=True, recompute=recompute),
              Stage("cpu-slow", (2,), (4, 6), head=True, recompute=recompute))
    elif stages == 2:
        st = (Stage("cpu-fast", (0,), (0, 4), embedding=True, recompute=recompute),
              Stage("cpu-slow", (2,), (4, 6), head=True, recompute=recompute))
    else:
        st = (Stage("cpu-fast", (0,), (0, 6), embedding=True, head=True, recompute=recompute),)
    settings = {k: {"attention": attention} for k in cluster.kind_names} if attention else {}
    return Plan(model=TINY, cluster=cluster, global_batch=6, seq_len=32, pipelines=(Pipeline(2, 3, st),),
                schedule=schedule, precision=precision, kind_settings=settings).validate()


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("prof") / "tiny.json"
    assert main(["profile", "--model", "tiny", "--mbs", "1,2", "--tp", "1,2", "--seq-len", "32",
                 "--kind", "cpu-fast", "--warmup", "1", "--repeats", "3", "--out", str(out)]) == 0
    return out


def test_profile_file_round_trips_and_is_used(tiny_profile):
    data = json.loads(tiny_profile.read_text())
    assert data["format"] == "hethub-profile" and data["kind"] == "cpu-fast" and data["seq_len"] == 32
    assert {(e["mbs"], e["tp"]) for e in data["entries"]} == {(1, 1), (2, 1), (1, 2), (2, 2)}
    prof = read_profile(tiny_profile)
    for e in prof.entries.values():
        assert e.layer.fwd_s > 0 and e.layer.bwd_s > 0 and e.layer.update_s > 0 and e.peak_mem_bytes > 0
        assert e.tp_comm_included  # TP 2 ran on two real gloo ranks
    # Single-thread entries are timed by CPU time; TP entries by wall time, of which only a share is
    # CPU work (the rest waits in collectives): the share an emulated kind's sleep stretches.
    assert all(e.cpu_fraction == 1.0 for (_, tp), e in prof.entries.items() if tp == 1)
    # What the profiler wrote (read_profile would refuse a share outside (0, 1] before this point).
    assert all(0 < e["cpu_fraction"] <= 1.0 for e in data["entries"] if "cpu_fraction" in e)
    again = tiny_profile.with_name("again.json")
    write_profile(again, prof, model=TINY, device=data["device"], measured_at=data["measured_at"])
    assert json.loads(again.read_text()) == data
    profiles = load_profiles(tiny_profile, model=TINY, seq_len=32)
    pred = predict(_plan(stages=1), profiles=profiles)
    assert pred.compute_sources == {"cpu-fast": "profile"}
    mixed = predict(_plan(), profiles=profiles)
    assert mixed.compute_sources == {"cpu-fast": "profile", "cpu-slow": "analytic, constant efficiency"}


def test_entry_without_tp_collectives_gets_them_added():
    plan = _plan(tp=2)
    times = LayerTimes(0.01, 0.02, 0.001)
    entry = ProfileEntry(times, times, times)
    with_comm = ProfileSet({"cpu-fast": KindProfile("cpu-fast", "tiny", 32, {(2, 2): entry})})
    without = ProfileSet({"cpu-fast": KindProfile("cpu-fast", "tiny", 32,
                                                  {(2, 2): ProfileEntry(times, times, times,
                                                                        tp_comm_included=False)})})
    a, b = predict(plan, profiles=with_comm).stages[0], predict(plan, profiles=without).stages[0]
    assert b.fwd_s > a.fwd_s and b.bwd_s > a.bwd_s


def test_profiled_selective_recomputation_is_an_estimate_that_says_so():
    from hethub.predict.compute import core_flop_share

    times = LayerTimes(0.01, 0.02, 0.001)
    entry = ProfileEntry(times, times, times)
    profiles = ProfileSet({"cpu-fast": KindProfile("cpu-fast", "tiny", 32, {(2, 1): entry})})
    none, sel = (predict(_plan(recompute=rc), profiles=profiles) for rc in ("none", "selective"))
    share = core_flop_share(TINY, seq_len=32)
    assert 0 < share < 1
    assert sel.stages[0].bwd_s - none.stages[0].bwd_s == pytest.approx(4 * 0.01 * share)  # 4 layers
    assert "estimated on profiled kinds cpu-fast" in sel.sources["recomputation"]
    assert "recomputation" not in none.sources


CASES = [(1, "1f1b", None, "none"), (1, "gpipe", None, "none"), (2, "1f1b", None, "none"), (1, "1f1b", "math", "none"),
         (2, "gpipe", "math", "none"), (1, "1f1b", None, "selective"), (2, "1f1b", "math", "selective"),
         (1, "1f1b", "math", "full")]


@pytest.mark.parametrize("tp,schedule,attention,recompute", CASES)
def test_predicted_memory_matches_the_runtime(tp, schedule, attention, recompute):
    # With math attention the runtime runs SDPA's math kernel, which keeps the s x s scores;
    # selective recomputation checkpoints the attention core (the tiny preset has GQA: 4 heads, 2 KV).
    plan = _plan(tp=tp, schedule=schedule, attention=attention, recompute=recompute)
    for sp in predict(plan).stages:
        got = measure_stage_memory(plan, pipeline=sp.pipeline, stage=sp.stage)
        # fp32 training state is exact: 4 (weights) + 4 (grads) + 8 (AdamW moments) bytes per parameter.
        assert sp.weights_bytes == got.state.weights_bytes
        assert sp.grads_bytes == got.state.grads_bytes
        assert sp.optimizer_bytes == got.state.optimizer_bytes
        # The activation formula counts what the runtime saves tensor by tensor, to the byte.
        assert sp.activations_bytes == got.activations_bytes


@pytest.mark.parametrize("tp,schedule,attention,recompute", CASES)
def test_predicted_activations_match_the_runtime_in_bf16(tp, schedule, attention, recompute):
    """The lean mixed-precision recipe (bf16 residual stream, fused-kernel norms, native GQA, bf16
    RoPE tables) saves exactly what the memory model counts; its bf16 weight copies (autocast's
    cache: the GEMMs' weights, once however many micro-batches) are counted apart."""
    plan = _plan(tp=tp, schedule=schedule, attention=attention, recompute=recompute, precision="bf16-mixed")
    for sp in predict(plan).stages:
        assert sp.precision == "bf16-mixed"
        got = measure_stage_memory(plan, pipeline=sp.pipeline, stage=sp.stage, precision="bf16-mixed")
        assert sp.activations_bytes == got.activations_bytes
        # 2 bytes per parameter at most (the norms' weights and the embedding table are not cast); a
        # fully recomputed layer saves nothing of its GEMMs in forward (the head stage's head does).
        if recompute == "full" and sp.stage == 0:
            assert got.weight_copy_bytes == 0
        else:
            assert 0 < got.weight_copy_bytes <= sp.weights_bytes


def test_predicted_memory_matches_the_runtime_with_unequal_chunks():
    # Interleaved: 3 chunks of unequal layer counts per stage (one empty), the peak weighed per chunk.
    from dataclasses import replace

    from hethub.plan import interleave

    base = _plan(schedule="interleaved")
    pipe = interleave(replace(base.pipelines[0], num_micro_batches=5), [[2, 0, 1], [1, 2, 0]])
    plan = replace(base, pipelines=(pipe,), global_batch=pipe.num_samples).validate()
    for sp in predict(plan).stages:
        got = measure_stage_memory(plan, pipeline=sp.pipeline, stage=sp.stage)
        assert sp.in_flight == got.in_flight
        assert sp.weights_bytes == got.state.weights_bytes and sp.optimizer_bytes == got.state.optimizer_bytes
        assert sp.activations_bytes == got.activations_bytes


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_selective_recomputation_saves_exactly_what_the_model_drops(attention):
    modes = ("none", "selective", "full")
    plans = {rc: _plan(tp=2, attention=attention, recompute=rc) for rc in modes}
    got = {rc: measure_stage_memory(p, pipeline=0, stage=0).activations_bytes for rc, p in plans.items()}
    pred = {rc: predict(p).stages[0].activations_bytes for rc, p in plans.items()}
    assert got["none"] > got["selective"] > got["full"]
    assert pred["none"] - pred["selective"] == got["none"] - got["selective"]
    assert pred["selective"] - pred["full"] == got["selective"] - got["full"]


def test_shared_cores_slow_down_only_computing_ranks():
    work = StageWork(fwd_cpu_s=1.0, fwd_idle_s=0.0, bwd_cpu_s=2.0, bwd_idle_s=0.0, p2p_s=0.0, update_cpu_s=0.0,
                     ranks=1)
    sleepy = StageWork(fwd_cpu_s=1.0, fwd_idle_s=3.0, bwd_cpu_s=2.0, bwd_idle_s=6.0, p2p_s=0.0, update_cpu_s=0.0,
                       ranks=1)

    def run(stages, cores):
        return simulate_shared_cores(stages=stages, num_micro_batches=[1] * len(stages), schedule="1f1b",
                                     cores=cores, groups=[])[0]

    four = {(i, 0): work for i in range(4)}
    assert run(four, 4) == pytest.approx(3.0)
    assert run(four, 2) == pytest.approx(6.0)  # four busy ranks on two cores: half speed
    # Two sleeping ranks leave the cores to the others while they sleep.
    mixed = {(0, 0): work, (1, 0): work, (2, 0): sleepy, (3, 0): sleepy}
    # t=0-2: four forwards share two cores; then the fast ranks' backwards (2-4) overlap the sleepy
    # ranks' sleep (2-5), whose backwards then run at full speed (5-7) and sleep (7-13).
    assert run(mixed, 2) == pytest.approx(13.0)


def test_contention_applies_only_beyond_the_host_cores():
    from dataclasses import replace

    plan = _plan()  # two ranks

    def on_host(cores: int) -> float:
        pl = replace(plan, cluster=replace(plan.cluster, host=EmulationHost(cores=cores)))
        return predict(pl, host=host_model(pl.cluster)).step_time_s

    # As many cores as ranks (and no measured host effects): the replay is the plain prediction,
    # world barriers (loss and gradient-norm all-reduces) included, which both model.
    free = predict(replace(plan, cluster=replace(plan.cluster, host=None))).step_time_s
    assert on_host(2) == pytest.approx(free, rel=1e-9)
    assert on_host(1) > 1.2 * on_host(2)


def test_speed_spread_is_measured_on_request(tmp_path):
    out = tmp_path / "spread.json"
    assert main(["profile", "--model", "tiny", "--mbs", "1", "--seq-len", "32", "--kind", "cpu-fast",
                 "--warmup", "1", "--repeats", "2", "--speed-spread", "--out", str(out)]) == 0
    host = read_profile_file(out).host
    spread = host.speed_spread if host is not None else ()
    if not spread:  # one usable core: no second core to wander against
        assert len(os.sched_getaffinity(0)) < 2
        return
    assert [sp.window_s for sp in spread] == pytest.approx([0.1, 0.2, 0.4])
    assert all(0.0 <= sp.sigma < 1.0 for sp in spread)


def test_wake_penalty_is_measured_on_request(tmp_path):
    out = tmp_path / "woken.json"
    assert main(["profile", "--model", "tiny", "--mbs", "1", "--seq-len", "32", "--kind", "cpu-fast",
                 "--warmup", "1", "--repeats", "2", "--wake-penalty", "--out", str(out)]) == 0
    host = read_profile_file(out).host
    gaps = [g for g, _ in host.wake_penalty]
    assert gaps == sorted(gaps) and len(gaps) >= 2 and gaps[0] > 0
    # The penalty is the chunk's extra CPU time (clamped at 0), never the idle gap itself: a tiny
    # model's chunk takes about a millisecond, so timing the sleep by mistake would exceed the gap.
    assert all(extra < gap for gap, extra in host.wake_penalty)


def test_corun_factor_is_measured_on_request(tmp_path):
    from hethub.emulation.host import usable_cores

    out = tmp_path / "corun.json"
    assert main(["profile", "--model", "tiny", "--mbs", "1", "--seq-len", "32", "--kind", "cpu-fast",
                 "--warmup", "1", "--repeats", "2", "--corun", "--out", str(out)]) == 0
    host = read_profile_file(out).host
    if usable_cores() < 2:  # one core: nothing runs beside a chunk, so nothing is measured
        assert host is None or host.corun == ()
        return
    assert [m for m, _ in host.corun] == [1]
    assert all(f >= 1.0 for _, f in host.corun)
