"""Every plan shape runs to the end under NCCL's ordering rules: the real pipeline executor runs each
rank of a plan in this process, over a communicator that never blocks, and records what it posts
(``hethub.comm.recording``); the tests' model of NCCL (``_nccl_model``) replays all ranks' posts with
every send larger than NCCL's buffering (eager limit 0), which gloo would have buffered.

When a send completes is the model's too: each rank is recorded twice. The first run's sends are
never observed complete; the model replays its posts and says, for each send, after which of the
rank's observations (waits on receives and collectives) it can know the send complete. The second
run, whose posts are the same, answers the executor's completion queries from that, and keeps each
send's tensor alive until then whatever the executor does (as ProcessGroupNCCL's work keeps it), so
a buffer the executor could only drop early, or holds too long, shows in its trace.

The matrix: every schedule (1F1B, GPipe, ZB-H1, interleaved with 2 and 3 chunks) x thirteen plan
shapes (TP hops of unequal and of equal degree, uneven replicas, cross-kind hops inside one NCCL
island and through the host bridge between vendors, between unequal TP degrees too, one
micro-batch, fewer micro-batches than stages, two stages, sequence-parallel stages, a
context-parallel pipeline whose ring runs its own point-to-point). The same recordings show that
the executor's sends never hold a rank up before its last op (the predictor's ``async`` p2p mode)
and that its live point-to-point buffers are the memory model's term, on the executor's own trace.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from _nccl_model import Deadlock, known_complete, replay

from hethub.comm.communicator import Communicator, group_name, lane_name
from hethub.comm.recording import Channel, Event, Note, Post, RecordingCommunicator, Wait
from hethub.islands import island_of_kind
from hethub.layout import build_topology
from hethub.plan import Pipeline, Plan, Stage, interleave, split_evenly
from hethub.predict.compute import p2p_post_s
from hethub.predict.predictor import predict
from hethub.runtime.context_parallel import CPContext
from hethub.runtime.model import StageModel
from hethub.runtime.pipeline import PipelineExecutor, StepTrace
from hethub.runtime.tensor_parallel import TPContext
from hethub.schedules import DEFAULT_P2P, get_schedule
from hethub.schedules.messages import max_live_messages, op_posts
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind, catalog
from hethub.spec.model import ModelSpec

SEQ = 4
CP_RING_TAG = 1 << 24  # runtime/context_parallel.py's ring tags start here


def _kind(name: str, vendor: str) -> DeviceKind:
    return DeviceKind(name=name, vendor=vendor, mem_bytes=2**35, peak_flops=1e14, intra_node_bw_bytes_per_s=1e11,
                      intra_node_latency_s=1e-6, backend="nccl")


# A100 and V100 share one NCCL island; MI250X's RCCL does not talk to NCCL: its hops take the bridge.
CLUSTER = Cluster(name="nccl-model", kinds={"a100": _kind("a100", "nvidia"), "v100": _kind("v100", "nvidia"),
                                            "mi250": _kind("mi250", "amd")},
                  groups=(NodeGroup("a100", 1, 8), NodeGroup("v100", 1, 8), NodeGroup("mi250", 1, 8)),
                  inter_node=Link(1e10, 1e-5), cross_kind=Link(1e10, 1e-5))

# (name, [(micro-batch size, micro-batches, [(kind, tp[, cp, sequence parallel]), ...]), ...]) per pipeline
SHAPES: list[tuple[str, list[tuple[int, int, list[tuple]]]]] = [
    ("4-stages", [(1, 6, [("a100", 1)] * 4)]),
    ("tp-1-2-2-1", [(2, 5, [("a100", 1), ("a100", 2), ("a100", 2), ("a100", 1)])]),
    ("uneven-replicas", [(1, 5, [("a100", 1), ("v100", 1), ("a100", 1)]), (2, 2, [("v100", 1), ("v100", 2)])]),
    ("bridged", [(1, 4, [("a100", 1), ("v100", 1), ("mi250", 2), ("mi250", 2)])]),
    ("bridged-tp", [(2, 4, [("mi250", 2), ("a100", 1), ("mi250", 2)]), (1, 3, [("a100", 1), ("mi250", 1)])]),
    ("one-micro-batch", [(1, 1, [("v100", 1), ("a100", 2), ("v100", 1)])]),
    ("two-stages", [(1, 3, [("a100", 1), ("v100", 1)])]),
    ("fewer-micro-batches-than-stages", [(1, 2, [("a100", 1)] * 4)]),
    ("tp-2-2-2", [(1, 4, [("a100", 2)] * 3)]),
    ("bridged-both-ways", [(1, 5, [("mi250", 1), ("a100", 1), ("mi250", 1), ("v100", 1)])]),
    # Unequal TP degrees across the bridge: 2 -> 4 and 4 -> 1 (and back), one copy on each hop's link.
    ("bridged-unequal-tp", [(2, 3, [("mi250", 2), ("a100", 4), ("mi250", 1)])]),
    # SP TP 2 -> TP 1 (the sender gathers), TP 1 -> SP TP 2 (one sequence slice per receiver), SP -> SP.
    ("sequence-parallel", [(1, 4, [("a100", 2, 1, True), ("a100", 1), ("v100", 2, 1, True), ("v100", 2, 1, True)])]),
    # CP 2 on every stage (the ring's own sends and receives), SP inside, a bridged hop.
    ("context-parallel", [(1, 3, [("a100", 1, 2, False), ("v100", 2, 2, True), ("mi250", 1, 2, False)])]),
]
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)]
# Three chunks repeat two chunks' interleaving with one more virtual stage per rank: the slow tier's.
MATRIX = [(s, v, name) for s, v in SCHEDULES for name, _ in SHAPES]
CASES = [pytest.param(*c, marks=pytest.mark.slow) if c[1] == 3 else c for c in MATRIX]
# One worker records every case (record_all is kept per process) for the tests that read it, here and
# in test_hop_bytes.py.
pytestmark = pytest.mark.xdist_group("nccl_replay")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only costs here (5x on a loaded 2-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here() -> Iterator[None]:
    with _one_thread():
        yield


def make_plan(schedule: str, chunks: int, shape: str) -> Plan:
    pipes = dict(SHAPES)[shape]
    num_layers = max(len(stages) for _, _, stages in pipes) * chunks
    spec = ModelSpec(name="m", num_layers=num_layers, hidden_size=16, num_heads=4, num_kv_heads=4,
                     ffn_hidden_size=32, vocab_size=32, max_seq_len=SEQ)
    free = {k: [d.id for d in CLUSTER.devices_of_kind(k)] for k in CLUSTER.kind_names}
    out = []
    for mbs, m, stages in pipes:
        n = len(stages)
        split = [num_layers // n + (i < num_layers % n) for i in range(n)]
        built, start = [], 0
        for i, ((kind, tp, *more), layers) in enumerate(zip(stages, split, strict=True)):
            cp, sp = more or (1, False)
            built.append(Stage(kind=kind, devices=tuple(free[kind][:tp * cp]), layers=(start, start + layers),
                               embedding=i == 0, head=i == n - 1, cp=cp, sequence_parallel=sp))
            free[kind], start = free[kind][tp * cp:], start + layers
        pipe = Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(built))
        if chunks > 1 and n > 1:  # virtual stage c * n + s is stage s's chunk c
            counts = split_evenly(num_layers, n * chunks)
            pipe = interleave(pipe, [[counts[c * n + s] for c in range(chunks)] for s in range(n)])
        out.append(pipe)
    return Plan(model=spec, cluster=CLUSTER, global_batch=sum(p.num_samples for p in out), seq_len=SEQ,
                pipelines=tuple(out), schedule=schedule, precision="fp32").validate()


class _Pending:
    """A posted operation: waiting returns at once; a send is not observed complete before it."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return False


class NeverBlocks:
    """A communicator of one rank of ``plan`` whose operations return at once (values do not matter:
    the posting order does not depend on them). Channels as the bridge chooses them on GPUs: NCCL
    inside a vendor's island, the host bridge (gloo) between islands."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.rank, self.world_size = rank, plan.world_size
        kinds = [plan.cluster.devices[d].kind for d in plan.devices]
        self.island = [island_of_kind(k, backend="nccl", vendor=plan.cluster.kinds[k].vendor, force_bridge=False)
                       for k in kinds]

    def p2p_channel(self, src: int, dst: int, *, device: torch.device, lane: str | None = None) -> Channel:
        if self.island[src] != self.island[dst]:
            return Channel("bridge", ordered=False)
        if lane is not None:
            return Channel(lane_name(src, dst, lane), ordered=True)
        mates = tuple(r for r, i in enumerate(self.island) if i == self.island[self.rank])
        return Channel(group_name(mates, world_size=self.world_size), ordered=True)

    group_channel = Communicator.group_channel
    send_completes_alone = Communicator.send_completes_alone

    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> _Pending:
        return _Pending()

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int, lane: str | None = None) -> _Pending:
        tensor.fill_(0.5)
        return _Pending()

    def all_reduce(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, group: Any, dim: int = 0, **_: Any) -> torch.Tensor:
        return torch.cat([tensor] * len(group), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, *, group: Any, **_: Any) -> torch.Tensor:
        return tensor.chunk(len(group))[sorted(group).index(self.rank)].clone()


class Informed(RecordingCommunicator):
    """The second run's communicator: a send on a native lane (NCCL) is observed complete once the
    rank has made as many observations (waits on anything but sends) as the model says it needs to
    know so (``known``: send handle -> observations; absent: only when waited on), and until then
    its tensor stays referenced here, as a GPU backend keeps it until the transfer is over. A send
    through gloo (the bridge's host path) reports completion only once waited on, as gloo's do,
    and is let go then (the replay checks that such a wait would not have blocked)."""

    def __init__(self, inner: NeverBlocks, known: dict[int, int]) -> None:
        super().__init__(inner)
        self.known, self.sends = known, set()
        self.stash: dict[int, torch.Tensor] = {}
        self.queries = self.answered = 0

    def observations(self) -> int:
        return sum(1 for e in self.events if isinstance(e, Wait) and e.handle not in self.sends)

    def complete(self, handle: int) -> bool:
        return self.observations() >= self.known.get(handle, 1 << 60)

    def _prune(self) -> None:
        n = self.observations()
        self.stash = {h: t for h, t in self.stash.items() if n < self.known.get(h, 1 << 60)}

    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> Any:
        self._prune()
        work = super().isend(tensor, dst=dst, tag=tag, lane=lane)
        self.sends.add(work.handle)
        self.stash[work.handle] = tensor
        return _InformedWork(work, self, reports=self.inner.send_completes_alone(dst, device=tensor.device,
                                                                                  lane=lane))


class _InformedWork:
    def __init__(self, work: Any, comm: Informed, *, reports: bool) -> None:
        self.work, self.comm, self.reports = work, comm, reports

    def wait(self, *args: Any) -> Any:
        if not self.reports:
            self.comm.stash.pop(self.work.handle, None)
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        self.comm._prune()
        done = self.reports and self.comm.complete(self.work.handle)
        self.comm.queries += 1
        self.comm.answered += done
        return done


@dataclass
class Recorded:
    """One rank's step: what it posted (with a Note before each op it computed) and its trace;
    ``queries``/``answered``: the executor's completion queries on sends, and those answered yes."""

    events: list[Event]
    trace: StepTrace
    queries: int = 0
    answered: int = 0


def record(plan: Plan, rank: int, *, forward_only: bool = False, known: dict[int, int] | None = None,
           ) -> Recorded:
    """What the executor of ``rank`` posts in one step (``forward_only``: as evaluation runs it), its
    sends observed complete as ``known`` says (None: never before the step's end)."""
    place = build_topology(plan).place(rank)
    st = place.stage
    comm = RecordingCommunicator(NeverBlocks(plan, rank)) if known is None else Informed(NeverBlocks(plan, rank), known)
    tp = TPContext(size=st.tp, rank=place.tp_rank, group=tuple(sorted(place.tp_group)),
                   comm=comm if st.tp > 1 else None, sequence_parallel=st.sequence_parallel,
                   order=place.tp_group)  # type: ignore[arg-type]
    cp = CPContext(size=st.cp, rank=place.cp_rank, ring=place.cp_group,
                   comm=comm if st.cp > 1 else None)  # type: ignore[arg-type]
    model = StageModel(plan.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=tp,
                       rope_len=plan.seq_len, chunks=st.chunks, cp=cp)
    ex = PipelineExecutor(model, place=place, comm=comm, schedule=plan.schedule,  # type: ignore[arg-type]
                          seq_len=plan.seq_len, hidden_size=plan.model.hidden_size)
    run_op = ex._run_op

    def noted(op: Any, got: Any, step: Any) -> Any:
        comm.events.append(Note(f"{op.kind}{op.micro_batch}.{op.chunk}"))
        return run_op(op, got, step)

    ex._run_op = noted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    mbs = [(torch.randint(0, plan.model.vocab_size, (place.micro_batch_size, plan.seq_len), generator=g),) * 2
           for _ in range(place.num_micro_batches)]
    if forward_only:
        ex.ops = type(ex.ops)(op for op in ex.ops if op[0] == "F")
        with torch.no_grad():
            _, trace = ex.run(mbs)
    else:
        _, trace = ex.run(mbs)
    return Recorded(comm.events, trace, getattr(comm, "queries", 0), getattr(comm, "answered", 0))


@functools.cache
def record_all(schedule: str, chunks: int, shape: str, *, forward_only: bool = False,
               informed: bool = True) -> dict[int, Recorded]:
    """Every rank of the case's plan, recorded once per test process (the tests below share them):
    a first run, then (``informed``) a second one whose sends are observed complete where the model
    of NCCL says the rank can know it (module doc)."""
    plan = make_plan(schedule, chunks, shape)
    if not informed:
        with _one_thread():  # whichever module records first (test_hop_bytes reads these too)
            return {r: record(plan, r, forward_only=forward_only) for r in range(plan.world_size)}
    first = record_all(schedule, chunks, shape, forward_only=forward_only, informed=False)
    known = known_complete({r: rec.events for r, rec in first.items()}, eager_bytes=0)
    with _one_thread():
        second = {r: record(plan, r, forward_only=forward_only, known=known.get(r, {}))
                  for r in range(plan.world_size)}
    for r in second:  # the same posts (handles included), only the waits on sends move
        assert _posts(second[r].events) == _posts(first[r].events), f"rank {r} posted differently"
    return second


def _posts(events: list[Event]) -> list[Event]:
    return [e for e in events if not isinstance(e, Wait)]


def events_of(case: tuple[str, int, str], **kw: Any) -> dict[int, list[Event]]:
    return {r: rec.events for r, rec in record_all(*case, **kw).items()}


@functools.cache
def replayed(case: tuple[str, int, str]) -> frozenset[tuple[int, int]]:
    """:func:`replay` of the case's recording at eager limit 0, once per test process (two tests read it)."""
    return frozenset(replay(events_of(case), eager_bytes=0))


def test_the_matrix_covers_every_schedule_and_shape():
    assert len(MATRIX) >= 30
    plans = [make_plan(*c) for c in MATRIX]
    assert {p.schedule for p in plans} == {"1f1b", "gpipe", "zb-h1", "interleaved"}
    assert {p.pipelines[0].virtual_stages for p in plans} == {1, 2, 3}
    topo = build_topology(make_plan("1f1b", 1, "tp-1-2-2-1"))
    assert any(p.split_in for p in topo.places)  # a TP-split hop (slice sent, all-gathered on arrival)
    bridged = NeverBlocks(make_plan("1f1b", 1, "bridged"), 0)
    assert len(set(bridged.island)) == 2
    sp = build_topology(make_plan("1f1b", 1, "sequence-parallel"))
    assert {pl.hop_out.piece for pl in sp.places if pl.stage.stage < 3} == {"whole", "seq"}
    assert any(pl.hop_out.source_gathers for pl in sp.places)
    cp = make_plan("1f1b", 1, "context-parallel")
    assert {s.cp for s in cp.pipelines[0].stages} == {2}


@pytest.mark.parametrize(("schedule", "chunks", "shape"), CASES)
def test_every_rank_finishes_under_nccl_rules(schedule, chunks, shape):
    replayed((schedule, chunks, shape))


@pytest.mark.parametrize(("schedule", "chunks", "shape"), CASES)
def test_sends_never_hold_a_rank_up_before_its_last_op(schedule, chunks, shape):
    """What the predictor's default p2p mode (``async``: a sender posts and goes on) assumes of
    hethub's runtime: every pipeline send the executor waits on before its last op has completed
    by then (it waits only on sends its completion queries found complete). A send waited on right after
    it is posted (a blocking send) would be caught: its receive has not run yet."""
    assert DEFAULT_P2P == "async" and make_plan(schedule, chunks, shape).p2p == DEFAULT_P2P
    events = events_of((schedule, chunks, shape))
    blocked = replayed((schedule, chunks, shape))
    for r, evs in events.items():
        last_op = max(i for i, e in enumerate(evs) if isinstance(e, Note))
        sends = {e.handle for e in evs if isinstance(e, Post) and _pipeline_send(e)}
        for i, e in enumerate(evs):
            if isinstance(e, Wait) and e.handle in sends and i < last_op:
                assert (r, i) not in blocked, f"rank {r} waits on an incomplete send at event {i}"


def test_a_blocking_send_would_be_seen():
    """The check above can fail: the same posts with each send waited on as soon as it is posted."""
    events = events_of(("1f1b", 1, "4-stages"))
    blocking = {}
    for r, evs in events.items():
        sends = {e.handle for e in evs if isinstance(e, Post) and _pipeline_send(e)}
        out: list[Event] = []
        for e in evs:
            if not (isinstance(e, Wait) and e.handle in sends):
                out.append(e)
            if isinstance(e, Post) and e.handle in sends:
                out.append(Wait(e.handle))
        blocking[r] = out
    assert replay(blocking, eager_bytes=0)


def _pipeline_send(post: Post) -> bool:
    """A send of pipeline messages (the CP ring's tags are far above the pipeline's)."""
    return all(o.op == "send" and o.tag < CP_RING_TAG for o in post.ops)


@pytest.mark.parametrize("shape", ["4-stages", "bridged-tp", "context-parallel"])
def test_forward_only_steps_finish_too(shape):
    replay(events_of(("1f1b", 1, shape), forward_only=True), eager_bytes=0)


def _one_communicator(events: list[Event], channel: Channel) -> list[Event]:
    """The same posts with every lane folded into one ``channel`` (per rank pair when ordered)."""
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, Post):
            ev = Post(handle=ev.handle, batched=ev.batched, ops=tuple(
                replace(o, channel=channel) if o.channel.name.startswith("lane") else o for o in ev.ops))
        out.append(ev)
    return out


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_the_model_finds_the_hang_without_lanes(schedule, chunks):
    """The executor's posts on one NCCL communicator per rank pair (torch's default for lone sends
    and receives on one group) hang: a receive posted ahead heads the pair's stream while the peer's
    send it waits for is queued behind one of ours. On gloo (matched by tag) they complete."""
    events = events_of((schedule, chunks, "4-stages"))
    with pytest.raises(Deadlock):
        replay({r: _one_communicator(evs, Channel("world", ordered=True)) for r, evs in events.items()})
    replay({r: _one_communicator(evs, Channel("gloo", ordered=False)) for r, evs in events.items()})


@pytest.mark.parametrize(("schedule", "chunks", "shape"), CASES)
def test_live_p2p_buffers_are_bounded_and_predicted(schedule, chunks, shape):
    """On every rank the executor's traced point-to-point buffers (distinct live storages, counted
    after each op's sends: ``StepTrace.max_p2p_*``) hold the memory model's term
    (``predict/memory/p2p.py``) at most, exactly on each stage's TP rank 0 (which sends and receives
    on both boundaries), and never more messages than the schedule's in-flight count plus one (the
    receive posted for the next op, or the op's own send): every older send has been observed
    complete and handed back. A send held until the peer consumed it, a stage output kept after its
    send, or a release the model of NCCL does not allow yet would fail."""
    plan = make_plan(schedule, chunks, shape)
    topo = build_topology(plan)
    predicted = {(s.pipeline, s.stage): s.memory.p2p_buffers_bytes for s in predict(plan).stages}
    for r, rec in record_all(schedule, chunks, shape).items():
        pl = topo.place(r)
        key, t = (pl.stage.pipeline, pl.stage.stage), rec.trace
        assert t.max_p2p_bytes <= predicted[key], (r, t.max_p2p_bytes, predicted[key])
        if pl.tp_rank == 0:
            assert t.max_p2p_bytes == predicted[key], (r, t.max_p2p_bytes, predicted[key])
        # Each op sends one buffer, or one per receiver of a sequence slice.
        fan = max([1] + [len(peers[1]) for c in range(pl.stage.num_chunks)
                         for peers in (pl.fwd_peers(c), pl.bwd_peers(c))])
        assert t.max_p2p_buffers <= max_live_messages(t.max_in_flight) * fan, (r, t.max_p2p_buffers, t.max_in_flight)


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("shape", ["4-stages", "two-stages", "tp-2-2-2", "bridged-both-ways"])
def test_the_predictor_prices_each_op_and_post_the_executor_runs(schedule, chunks, shape):
    """Interleaving's per-chunk cost is its extra ops' work besides their layers: each op posts its
    receive and its send (runtime/p2p.py). On every rank the executor's traced ops are the schedule's
    and its pipeline posts (sends and receives; the CP ring's are its own) are
    ``schedules.messages.op_posts`` summed over them, and the predictor charges each stage exactly
    that many posts (``comm_s["p2p"]["posts_s"]``: ``PlanCosts.posts_s``) at the kind's post time;
    v chunks post about v times as often."""
    plan = make_plan(schedule, chunks, shape)
    # the same cluster with a calibrated kind's numbers, so that a post costs something
    a100 = catalog()["a100-40gb"]
    kinds = {k: replace(a100, name=k, vendor=v.vendor, backend=v.backend) for k, v in CLUSTER.kinds.items()}
    priced = {(s.pipeline, s.stage): s.comm_s["p2p"]["posts_s"]
              for s in predict(replace(plan, cluster=replace(CLUSTER, kinds=kinds))).stages}
    topo = build_topology(plan)
    for r, rec in record_all(schedule, chunks, shape).items():
        pl = topo.place(r)
        st = pl.stage
        ops = get_schedule(schedule, chunks=st.num_chunks).ops(stage=st.stage, num_stages=st.num_stages,
                                                               num_micro_batches=pl.num_micro_batches)
        assert [e.label for e in rec.events if isinstance(e, Note)] == [f"{o.kind}{o.micro_batch}.{o.chunk}"
                                                                         for o in ops]
        posts = sum(1 for e in rec.events if isinstance(e, Post) for o in e.ops if o.tag < CP_RING_TAG)
        assert posts == sum(op_posts(o, stage=st.stage, num_stages=st.num_stages, chunks=st.num_chunks) for o in ops)
        post_s = p2p_post_s(kinds[plan.cluster.devices[r].kind], plan.precision)
        assert post_s > 0 and priced[(st.pipeline, st.stage)] == pytest.approx(posts * post_s)
        if chunks > 1 and st.num_stages > 1:  # every op but the pipeline's two ends posts both ways
            assert posts >= 2 * len([o for o in ops if o.kind != "W"]) - 2 * pl.num_micro_batches


def test_sends_held_longer_would_break_the_bound():
    """The buffer bound above can fail: the same executor whose completion queries never answer yes
    before the step's end (every send held until then) holds more than the in-flight count plus one
    on some rank of 1F1B, while the informed run, whose queries are asked, stays within it."""
    case = ("1f1b", 1, "4-stages")
    informed, held = record_all(*case), record_all(*case, informed=False)
    assert all(rec.queries > 0 for rec in informed.values() if any(
        isinstance(e, Post) and _pipeline_send(e) for e in rec.events))
    over = [r for r, rec in held.items() if rec.trace.max_p2p_buffers > max_live_messages(rec.trace.max_in_flight)]
    assert over, {r: (rec.trace.max_p2p_buffers, rec.trace.max_in_flight) for r, rec in held.items()}
    assert all(rec.trace.max_p2p_buffers <= max_live_messages(rec.trace.max_in_flight) for rec in informed.values())
