"""SANITY CHECK (not a validation): hethub's memory model on Sailor-like settings beside Sailor's own.

    python bench/memory_sailor_sanity.py

Sailor's runs (OPT-350M and GPT-Neo-2.7B at seq 2048, fp32, Adam; its planner's models and sizes in
../shared/reference/sailor/) are not given to us measured. This prints, for a grid of plausible
plans (micro-batch size, TP, pipeline depth, data-parallel replicas), the peak of the first stage
(the one holding the most micro-batches) as hethub predicts it for an imported Sailor plan (fp32,
math attention, ``interop/sailor.py``), beside the estimate of Sailor's planner: per-layer
parameter and activation sizes from ``llm_info.json`` x (24 bytes per parameter + activations x
micro-batch x 4 bytes x in-flight micro-batches) + 2 GB (TP 1) or 3 GB (TP > 1) of framework memory.
The issue's real ranges (7-27 GB on GH200, 4-9 GB on workstation GPUs) are printed for orientation;
which plans produced them is not known, so no error is computed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import catalog
from hethub.spec.model import PRESETS

SAILOR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "sailor"
MODELS = {"OPT-350": "opt-350m", "GPT-Neo-2.7": "gpt-neo-2.7b"}
GB = 1e9


def sailor_estimate(info: dict, *, tp: int, pp: int, mbs: int, stage_layers: list[int]) -> float:
    """Sailor planner's memory of stage 0 (sailor_planner: params x 24 B + acts x mbs x 4 x (pp - 0) + framework)."""
    t = info[str(tp)]
    params = sum(t[str(i)]["params_floats"] for i in stage_layers)
    acts = sum(t[str(i)]["act_mem_floats"] for i in stage_layers) * mbs * 4
    return params * 24 + acts * pp + (2e9 if tp == 1 else 3e9)


def hethub_peak(model_name: str, kind: str, *, tp: int, pp: int, mbs: int, dp: int) -> tuple[float, dict]:
    model = PRESETS[model_name]
    per_node = 8 if kind.startswith(("rtx", "titan")) else 4
    n_dev = tp * pp * dp
    nodes = -(-n_dev // per_node)
    cluster = Cluster(name="s", kinds={kind: catalog()[kind]}, groups=(NodeGroup(kind, nodes, per_node),),
                      inter_node=Link(12.5e9, 1e-5), cross_kind=Link(12.5e9, 1e-5))
    L = model.num_layers
    bounds = [round(L * i / pp) for i in range(pp + 1)]
    pipes = []
    for r in range(dp):
        stages = []
        for s in range(pp):
            first = (r * pp + s) * tp
            stages.append(Stage(kind, tuple(range(first, first + tp)), (bounds[s], bounds[s + 1]),
                                embedding=s == 0, head=s == pp - 1))
        pipes.append(Pipeline(mbs, 8, tuple(stages)))
    plan = Plan(model=model, cluster=cluster, global_batch=8 * mbs * dp, seq_len=2048, pipelines=tuple(pipes),
                precision="fp32", kind_settings={kind: {"attention": "math"}}).validate()
    sp = predict(plan).stages[0]
    return sp.peak_mem_bytes, sp.memory.parts


def main() -> None:
    if not (SAILOR / "llm_info.json").exists():
        print("no ../shared/reference/sailor here; skipped")
        return
    info = json.loads((SAILOR / "llm_info.json").read_text())
    print("SANITY CHECK, not validation: stage 0 peak per GPU, GB (1e9)")
    print(f"{'model':<12} {'kind':<10} {'tp':>2} {'pp':>2} {'dp':>2} {'mbs':>3} {'hethub':>7} {'sailor':>7} "
          f"{'ratio':>6}  hethub's largest parts")
    for sname, mname in MODELS.items():
        n_all = PRESETS[mname].num_layers + 2  # Sailor's layer list: embedding, blocks, head
        for kind in ("gh200", "rtx-3090", "titan-rtx"):
            for tp, pp, mbs, dp in ((1, 1, 1, 4), (1, 2, 2, 2), (2, 2, 1, 2), (1, 4, 1, 1), (4, 1, 2, 1),
                                    (2, 4, 4, 1)):
                if str(tp) not in info[sname]:
                    continue
                bounds = [round(n_all * i / pp) for i in range(pp + 1)]
                s = sailor_estimate(info[sname], tp=tp, pp=pp, mbs=mbs, stage_layers=list(range(bounds[0], bounds[1])))
                h, parts = hethub_peak(mname, kind, tp=tp, pp=pp, mbs=mbs, dp=dp)
                top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
                print(f"{sname:<12} {kind:<10} {tp:>2} {pp:>2} {dp:>2} {mbs:>3} {h / GB:>7.1f} {s / GB:>7.1f} "
                      f"{h / s:>6.2f}  " + ", ".join(f"{k} {v / GB:.1f}" for k, v in top))
    print("issue 15's measured ranges: GH200 7-27 GB per GPU, workstation GPUs 4-9 GB (plans unknown)")


if __name__ == "__main__":
    sys.exit(main())
