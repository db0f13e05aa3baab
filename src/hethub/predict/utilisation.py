"""Model FLOP utilisation (MFU): model FLOPs per step per device kind over its dense peak.

Model FLOPs are forward + backward matmul FLOPs (no recomputation), Megatron's count. The peak is
the precision's: dense bf16/fp16 tensor-core for bf16-mixed, the non-tensor fp32 peak for fp32 where
the catalog has it. One home for the predictor's JSON and the report's table.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hethub.plan import Plan
from hethub.spec.cluster import Cluster
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class KindUse:
    kind: str
    devices: int  # devices of this kind the plan uses
    model_flops_per_step: float  # forward + backward model FLOPs these devices do (no recomputation)
    peak_flops_per_device: float

    def achieved_flops_per_s(self, step_s: float) -> float:
        return self.model_flops_per_step / step_s if step_s > 0 else 0.0

    def utilisation(self, step_s: float) -> float:
        """Model-FLOPs utilisation of this kind: achieved per device over its dense peak."""
        peak = self.devices * self.peak_flops_per_device
        return self.achieved_flops_per_s(step_s) / peak if peak > 0 else 0.0


def peak_flops_for(kind: DeviceKind, precision: str) -> float:
    """The dense peak a plan of `precision` can reach on `kind` (the MFU denominator)."""
    if precision == "fp32" and kind.fp32_flops:
        return kind.fp32_flops
    return kind.peak_flops


def cluster_mfu(*, cluster: Cluster, model: ModelSpec, seq_len: int, precision: str, tokens_per_s: float) -> float:
    """MFU of a whole cluster: model FLOP/s at ``tokens_per_s`` over every device's dense peak summed
    (devices a plan leaves out count too: it is the cluster's utilisation)."""
    peak = sum(n * peak_flops_for(cluster.kinds[k], precision) for k, n in cluster.count_by_kind().items())
    return tokens_per_s * model.train_flops_per_token(seq_len=seq_len) / peak if peak > 0 else 0.0


def stage_model_flops(plan: Plan, pipeline: int, stage: int) -> float:
    """Forward + backward model FLOPs of one stage (all its TP ranks) for one step."""
    p = plan.pipelines[pipeline]
    s = p.stages[stage]
    tokens = p.num_samples * plan.seq_len
    fwd = s.num_layers * plan.model.layer_fwd_flops(tokens=tokens, seq_len=plan.seq_len)
    if s.head:
        fwd += plan.model.head_fwd_flops(tokens=tokens)
    return 3.0 * fwd  # backward is twice the forward


def kind_use(plan: Plan) -> list[KindUse]:
    flops: dict[str, float] = defaultdict(float)
    devices: dict[str, int] = defaultdict(int)
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            flops[s.kind] += stage_model_flops(plan, pi, si)
            devices[s.kind] += s.tp
    return [KindUse(kind=k, devices=devices[k], model_flops_per_step=flops[k],
                    peak_flops_per_device=peak_flops_for(plan.cluster.kinds[k], plan.precision))
            for k in plan.cluster.kind_names if k in devices]


def mfu_by_kind(plan: Plan, step_s: float) -> dict[str, float]:
    """Per kind and over all devices ("all"): model FLOPs per second over the devices' dense peak."""
    uses = kind_use(plan)
    out = {u.kind: u.utilisation(step_s) for u in uses}
    peak = sum(u.devices * u.peak_flops_per_device for u in uses)
    flops = sum(u.model_flops_per_step for u in uses)
    out["all"] = flops / step_s / peak if step_s > 0 and peak > 0 else 0.0
    return out
