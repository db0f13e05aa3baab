"""The launcher's part of a training config file (``hethub train --config``): what must happen once,
before any rank starts — writing the starting model folder and making the plan. The ranks read the
rest of the file themselves (``hethub.runtime.train_config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hethub.errors import SpecError
from hethub.runtime.train_config import read as read_config


def prepare_launch(path: str | Path, *, out_dir: str | Path = "runs") -> dict[str, Any]:
    """What ``hethub train --config`` does before starting the ranks. Writes the random-weight model
    folder (``model.create_from_config``, only when ``model.init_from`` has no config.json yet) and the
    plan (``plan.cluster``: the planner's best plan for the init_from model, saved at ``plan.out``).
    Returns ``{"plan": path, "steps": int | None, "metrics": path | None}`` for the launcher."""
    data = read_config(path)
    plan_sec, model_sec = data.get("plan", {}), data.get("model", {})
    init, create = model_sec.get("init_from"), model_sec.get("create_from_config")
    if create:
        if not init:
            raise SpecError(f"{path}: field 'model.create_from_config' needs 'model.init_from' (the folder "
                                    "to write). Fix: add init_from.")
        if not (Path(init) / "config.json").is_file():
            from hethub.runtime.hf_io import write_random_model

            write_random_model(create, init, seed=int(data.get("train", {}).get("seed", 0)))
            print(f"wrote a randomly initialised model from {create} to {init}", flush=True)
    plan_path = plan_sec.get("file")
    if plan_sec.get("cluster"):
        if plan_path:
            raise SpecError(f"{path}: [plan] has both 'file' and 'cluster'. Fix: keep one (a plan file, "
                                    "or a cluster to plan for).")
        plan_path = _make_plan(plan_sec, init=init, where=str(path), out_dir=Path(out_dir))
    if not plan_path:
        raise SpecError(f"{path}: no plan: set 'plan.file' (a plan JSON) or 'plan.cluster' with "
                                "'plan.global_batch' and 'plan.seq_len'. Fix: add a [plan] section.")
    return {"plan": str(plan_path), "steps": data.get("train", {}).get("steps"),
            "metrics": data.get("logging", {}).get("metrics")}


def _make_plan(sec: dict[str, Any], *, init: str | None, where: str, out_dir: Path) -> str:
    from hethub.search.config import PlannerConfig
    from hethub.search.planner import make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model
    from hethub.tables import prediction_basis

    model_ref = sec.get("model") or (str(Path(init) / "config.json") if init else None)
    if model_ref is None:
        raise SpecError(f"{where}: planning from 'plan.cluster' needs the model: set 'model.init_from'. "
                                "Fix: add it, or give a plan file in 'plan.file'.")
    for key in ("global_batch", "seq_len"):
        if isinstance(sec.get(key), bool) or not isinstance(sec.get(key), int) or sec[key] < 1:
            raise SpecError(f"{where}: field 'plan.{key}' must be a positive integer, got "
                                    f"{sec.get(key)!r}. Fix: set it.")
    config = PlannerConfig(global_batch=sec["global_batch"], seq_len=sec["seq_len"],
                           strategy=sec.get("strategy", "hethub"), schedule=sec.get("schedule", "1f1b"),
                           precision=sec.get("precision", "fp32"))
    result = make_plan(cluster=load_cluster(sec["cluster"]), model=get_model(model_ref), config=config)
    out = Path(sec.get("out") or out_dir / "plan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result.plan.save(out)
    pred = result.prediction
    print(f"planned {result.plan.world_size} ranks, {len(result.plan.pipelines)} pipelines, predicted "
          f"{pred.tokens_per_s:,.0f} tokens/s ({prediction_basis(result.plan.cluster, pred)}): {out}", flush=True)
    return str(out)
