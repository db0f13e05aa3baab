"""Wall time, CPU time and trace size of `hethub report` for the paper's 768-device plan (issue 16: < 10 s, < 20 MB).

Plans llama-140b on examples/clusters/hethub-768.toml (batch 1536 x 4096), then times the report of
that plan in this process and prints the seconds per part beside the trace's size.
Run: PYTHONPATH=src python bench/report_scale.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hethub.predict.predictor import predict
from hethub.report import write_report
from hethub.report.groups import timeline_devices
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    cluster = load_cluster(ROOT / "examples" / "clusters" / "hethub-768.toml")
    plan = make_plan(cluster=cluster, model=get_model("llama-140b"),
                     config=PlannerConfig(global_batch=1536, seq_len=4096)).plan
    t0, c0 = time.perf_counter(), time.process_time()
    devices = timeline_devices(plan)
    pred = predict(plan, timeline=True if devices is None else devices)
    t1, c1 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        paths = write_report(plan=plan, prediction=pred, out_dir=out)
        t2, c2 = time.perf_counter(), time.process_time()
        size = paths.trace_json.stat().st_size
    print(f"768 devices, {len(plan.pipelines)} pipelines, {sum(p.num_micro_batches for p in plan.pipelines)} "
          f"micro-batches; traced devices {len(devices or ())}")
    print(f"prediction with timeline {t1 - t0:6.2f} s   pictures+trace+summary {t2 - t1:6.2f} s   "
          f"total {t2 - t0:6.2f} s   trace {size / 2**20:.1f} MiB")
    # CPU seconds of this process: on a shared box the wall time above includes other processes' turns.
    print(f"cpu seconds: prediction {c1 - c0:6.2f}   pictures+trace+summary {c2 - c1:6.2f}   total {c2 - c0:6.2f}")


if __name__ == "__main__":
    main()
