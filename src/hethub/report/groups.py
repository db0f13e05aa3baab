"""Aggregation shared by every report output: which rows to draw when a plan has hundreds of devices.

A *row* is one stage of one distinct pipeline shape. Data-parallel replicas with the same shape
(micro-batching, and per stage: kind, TP, layers, embedding/head, recompute) behave alike, so the
pictures draw one representative of each and say how many replicas it stands for. Small plans keep
one row per pipeline so nothing is hidden when it would still be legible.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.result import Event, Prediction, StagePrediction
from hethub.units import fmt_chunks

# Beyond this many (pipeline, stage) rows, identical replicas are merged into one row.
MAX_UNMERGED_ROWS = 24


@dataclass(frozen=True)
class StageRow:
    """One drawn row: stage ``stage`` of pipeline ``pipeline`` standing for ``replicas`` (incl. itself)."""

    index: int  # colour / row index
    pipeline: int  # the representative pipeline
    stage: int
    replicas: tuple[int, ...]  # every pipeline with this shape (merged) or just (pipeline,)
    kind: str
    tp: int
    layers: tuple[int, int]
    embedding: bool
    head: bool
    num_devices: int  # devices of this stage over all its replicas
    chunks: tuple[tuple[int, int], ...] = ()  # virtual stages: every chunk's layers (layers: the first)

    @property
    def layers_text(self) -> str:
        """The stage's layers as tables write them: '0-3', or each chunk's, '0-3|20-23'."""
        return fmt_chunks(self.chunks or (self.layers,))

    @property
    def label(self) -> str:
        return f"{_pipes_label(self.replicas)} · s{self.stage} · {self.kind}"

    @property
    def detail(self) -> str:
        extra = "".join([" +emb" if self.embedding else "", " +head" if self.head else ""])
        return f"layers {self.layers_text}{extra} · TP {self.tp} · {self.num_devices} dev"


def pipeline_shape(p: Pipeline) -> tuple[object, ...]:
    return (p.micro_batch_size, p.num_micro_batches,
            tuple((s.kind, s.tp, s.layer_ranges, s.embedding, s.head, s.recompute) for s in p.stages))


def stage_rows(plan: Plan, *, merge: bool | None = None) -> list[StageRow]:
    """Rows in plan order; ``merge=None`` merges identical replicas only when there are many rows."""
    if merge is None:
        merge = sum(len(p.stages) for p in plan.pipelines) > MAX_UNMERGED_ROWS
    groups: dict[object, list[int]] = defaultdict(list)
    for pi, p in enumerate(plan.pipelines):
        groups[pipeline_shape(p) if merge else pi].append(pi)
    rows: list[StageRow] = []
    for members in groups.values():
        rep = plan.pipelines[members[0]]
        for si, s in enumerate(rep.stages):
            rows.append(_row(len(rows), members, si, s))
    return rows


def _row(index: int, members: list[int], si: int, s: Stage) -> StageRow:
    return StageRow(index=index, pipeline=members[0], stage=si, replicas=tuple(members), kind=s.kind, tp=s.tp,
                    layers=s.layers, embedding=s.embedding, head=s.head, num_devices=s.tp * len(members),
                    chunks=s.chunks)


# Plans up to this many devices are traced device by device; larger ones one device per stage row.
TRACE_ALL_DEVICES_MAX = 64


def timeline_devices(plan: Plan) -> set[int] | None:
    """The devices whose timeline a report needs: None (all) for small plans; for large ones the first
    device of each stage row (identical replicas and TP peers do the same work), for
    ``predict(plan, timeline=...)`` to build only those."""
    if plan.world_size <= TRACE_ALL_DEVICES_MAX:
        return None
    return {plan.pipelines[r.pipeline].stages[r.stage].devices[0] for r in stage_rows(plan)}


def row_of_stage(rows: Iterable[StageRow]) -> dict[tuple[int, int], StageRow]:
    """(pipeline, stage) -> its row, for every pipeline including merged replicas."""
    return {(p, r.stage): r for r in rows for p in r.replicas}


def stage_predictions(prediction: Prediction | None) -> dict[tuple[int, int], StagePrediction]:
    if prediction is None:
        return {}
    return {(s.pipeline, s.stage): s for s in prediction.stages}


def representative_events(events: Iterable[Event], rows: list[StageRow]) -> dict[int, list[Event]]:
    """Row index -> the events of one device of the row's representative stage.

    The predictor may emit events for every device of a TP group or for only one; taking the
    lowest device id that has events covers both without double-drawing.
    """
    by_stage_dev: dict[tuple[int, int], dict[int, list[Event]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        by_stage_dev[(e.pipeline, e.stage)][e.device].append(e)
    out: dict[int, list[Event]] = {}
    for r in rows:
        devs = by_stage_dev.get((r.pipeline, r.stage))
        if not devs:
            # The representative replica has no events (e.g. a measured run that logged a subset):
            # fall back to any replica that has some.
            devs = next((by_stage_dev[(p, r.stage)] for p in r.replicas if (p, r.stage) in by_stage_dev), None)
        if devs:
            out[r.index] = sorted(devs[min(devs)], key=lambda e: e.start_s)
    return out


def _pipes_label(replicas: tuple[int, ...]) -> str:
    if len(replicas) == 1:
        return f"p{replicas[0]}"
    return f"{len(replicas)}× p{_ranges(replicas)}"


def _ranges(ids: tuple[int, ...]) -> str:
    """Compact id list: (0,1,2,5,7,8) -> '0–2,5,7–8'; long lists are cut after a few runs."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    parts = [f"{a}" if a == b else f"{a}–{b}" for a, b in runs]
    return ",".join(parts) if len(parts) <= 3 else ",".join(parts[:3]) + ",…"
