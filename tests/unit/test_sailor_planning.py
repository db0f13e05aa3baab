"""Planning with Sailor's measured GPU profiles puts less work on the slower kind's devices."""


from conftest import EXAMPLES, SAILOR_DATA
from hethub.profile.format import load_profiles
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

OPT350 = SAILOR_DATA / "profiles" / "OPT-350"


def test_opt350_on_a100_v100_gives_v100_fewer_layers_per_device():
    model = get_model("opt-350m")
    profiles = load_profiles([OPT350 / "A100-40" / "profile.json", OPT350 / "V100-16" / "profile.json"],
                             model=model, seq_len=2048)
    # Sailor's own training config for these profiles: global batch 1024 x 2048 tokens.
    res = make_plan(cluster=load_cluster(EXAMPLES / "a100-v100-32.toml"), model=model,
                    config=PlannerConfig(global_batch=1024, seq_len=2048), profiles=profiles)
    assert set(res.prediction.compute_sources.values()) == {"profile"}
    per_device: dict[str, list[float]] = {"a100-40gb": [], "v100-16gb": []}
    for p in res.plan.pipelines:
        for s in p.stages:
            per_device[s.kind] += [s.num_layers / s.tp] * s.tp
    a100, v100 = per_device["a100-40gb"], per_device["v100-16gb"]
    assert a100 and v100, "the plan should use both kinds"
    assert sum(v100) / len(v100) < sum(a100) / len(a100)
    assert max(v100) < max(a100)
