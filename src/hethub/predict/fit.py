"""Refuse a plan that cannot fit device memory, before anything is launched."""

from __future__ import annotations

from hethub.errors import MemoryFitError
from hethub.plan import Plan
from hethub.predict.result import Prediction

GIB = 1024**3


def check_memory_fit(plan: Plan, prediction: Prediction) -> None:
    """Raise MemoryFitError naming the first stage over capacity, its bytes, and what to change."""
    for s in prediction.stages:
        if s.fits:
            continue
        st = plan.pipelines[s.pipeline].stages[s.stage]
        over = s.peak_mem_bytes - s.capacity_bytes
        hints = []
        if st.num_layers > 1:
            hints.append("move layers to another stage")
        if not st.recompute:
            hints.append("set \"recompute\": true on it")
        hints.append("lower micro_batch_size")
        if st.tp < plan.cluster.groups[plan.cluster.devices[st.devices[0]].group].devices_per_node:
            hints.append("raise its TP degree")
        hints.append("or let 'hethub plan' choose")
        raise MemoryFitError(
            f"plan does not fit memory: pipelines[{s.pipeline}].stages[{s.stage}] on {s.kind} (devices "
            f"{list(s.devices)}) needs {s.peak_mem_bytes / GIB:.2f} GiB per device (weights "
            f"{s.weights_bytes / GIB:.2f}, grads {s.grads_bytes / GIB:.2f}, optimizer {s.optimizer_bytes / GIB:.2f}, "
            f"activations {s.activations_bytes / GIB:.2f}) but {s.capacity_bytes / GIB:.2f} GiB is usable, "
            f"{over / GIB:.2f} GiB over. Fix: {', '.join(hints)}."
        )
