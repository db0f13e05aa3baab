"""Refuse a plan that cannot fit device memory, before anything is launched."""

from __future__ import annotations

from hethub.errors import MemoryFitError
from hethub.plan import Plan, Recompute
from hethub.predict.memory import describe_peak
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
        if st.recompute is not Recompute.FULL:
            hints.append("set \"recompute\": " + ('"selective" or "full"' if not st.recompute else '"full"') + " on it")
        hints.append("lower micro_batch_size")
        if st.tp < plan.cluster.groups[plan.cluster.devices[st.devices[0]].group].devices_per_node:
            hints.append("raise its TP degree")
        hints.append("or let 'hethub plan' choose")
        if s.memory is not None:
            parts = describe_peak(s.memory)
            usable = (f"{s.capacity_bytes / GIB:.2f} GiB ({s.device_mem_bytes / GIB:.2f} GiB - "
                      f"{1 - s.capacity_bytes / s.device_mem_bytes:.0%} headroom)" if s.device_mem_bytes
                      else f"{s.capacity_bytes / GIB:.2f} GiB")
        else:
            parts = (f"weights {s.weights_bytes / GIB:.2f} GiB + grads {s.grads_bytes / GIB:.2f} GiB + optimizer "
                     f"{s.optimizer_bytes / GIB:.2f} GiB + activations {s.activations_bytes / GIB:.2f} GiB")
            usable = f"{s.capacity_bytes / GIB:.2f} GiB"
        raise MemoryFitError(
            f"plan does not fit memory: pipelines[{s.pipeline}].stages[{s.stage}] on {s.kind} (devices "
            f"{list(s.devices)}): {parts} = {s.peak_mem_bytes / GIB:.2f} GiB per device exceeds {usable}, "
            f"{over / GIB:.2f} GiB over. Fix: {', '.join(hints)}."
        )
