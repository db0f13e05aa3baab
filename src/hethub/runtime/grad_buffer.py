"""A rank's gradients in one contiguous fp32 buffer ("main grads"), cut into buckets that are reduced
while the backward still runs (Megatron-LM's ``ParamAndGradBuffer`` with ``overlap_grad_reduce``).

Layout: parameters in the reduction order (:func:`hethub.layout.reduction_key`: the order the backward
makes them final), each sync group's parameters cut into buckets of about ``cap_elems`` elements
(:func:`hethub.layout.bucket_ranges`, counted in the group's reduction layout: full size where the
holders' TP degrees differ), buckets in the order of their first parameter. Every parameter's
``main_grad`` is a view of the buffer. An fp32 parameter's ``.grad`` is that same view, so autograd
accumulates every micro-batch into it in place (no copy, no per-step allocation, no ``torch.cat``);
a 16-bit parameter's gradient is added into it by a hook and dropped, so the sum over micro-batches
stays fp32.

Readiness: a parameter's gradient is final once autograd has accumulated into it as many times as
backward passes reach it in a step (the micro-batches times the passes per micro-batch: two for a
tied embedding whose uses sit in different virtual-stage chunks). A post-accumulate hook counts
them; once every parameter of a bucket is final the bucket is ready, and ready buckets are handed to
``launch`` in bucket order, a bucket never before an earlier one, so all ranks of a group issue its
collectives in the same order. Buckets whose parameters got fewer gradients than expected are
launched by :meth:`flush`, which the step calls before any other collective; a gradient arriving
for a launched bucket is an error (its reduction may already be running). With ``overlap`` off,
nothing is launched before :meth:`flush`: the reductions start after the whole backward.

On a GPU the hook runs on autograd's device thread in stream order: the main-grad add is queued on
the current stream and the collective library's stream waits for it before the bucket's
reduction starts, so the reduction runs beside the rest of the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hethub.layout import GradGroup, bucket_ranges, reduction_key


@dataclass
class Bucket:
    """Consecutive parameters of one sync group, reduced as one collective (or, under ZeRO-1, one per
    owner of a piece of it)."""

    index: int  # launch order on this rank
    group: GradGroup
    params: list[int]  # indices into GradBuffer.params, consecutive
    lo: int  # element range [lo, hi) in the buffer
    hi: int
    layout_numel: int  # elements reduced (full size for a mixed group)
    pending: int = 0
    launched: bool = False
    extra: dict = field(default_factory=dict)  # what the reducer keeps per bucket

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def build_buckets(named: Sequence[tuple[str, nn.Parameter]], *, groups: Sequence[GradGroup],
                  layout_numels: Sequence[int], finals: Sequence[int], num_layers: int, cap_elems: int,
                  ) -> tuple[list[str], list[nn.Parameter], list[int], list[Bucket], list[int]]:
    """The buckets of the module doc over the rank's parameters: (names, parameters and their finals in
    buffer order, buckets, each parameter's bucket). ``runtime/grad_rounds.py`` cuts the same ones."""
    order = sorted(range(len(named)), key=lambda i: reduction_key(named[i][0], num_layers=num_layers))
    by_group: dict[GradGroup, list[int]] = {}
    for i in order:
        by_group.setdefault(groups[i], []).append(i)
    spans: list[tuple[GradGroup, list[int]]] = []
    for g, idx in by_group.items():
        for a, b in bucket_ranges([layout_numels[i] for i in idx], cap_elems=cap_elems):
            spans.append((g, idx[a:b]))
    spans.sort(key=lambda span: reduction_key(named[span[1][0]][0], num_layers=num_layers))
    params: list[nn.Parameter] = []
    kept: list[int] = []
    buckets: list[Bucket] = []
    bucket_of: list[int] = []
    offset = 0
    for k, (g, idx) in enumerate(spans):
        lo = offset
        members = []
        for i in idx:
            members.append(len(params))
            params.append(named[i][1])
            kept.append(finals[i])
            bucket_of.append(k)
            offset += named[i][1].numel()
        buckets.append(Bucket(index=k, group=g, params=members, lo=lo, hi=offset,
                              layout_numel=sum(layout_numels[i] for i in idx)))
    names = [named[i][0] for _, idx in spans for i in idx]
    return names, params, kept, buckets, bucket_of


class GradBuffer:
    """The main-grad buffer and its buckets (module doc). ``named``: the rank's parameters; ``groups``,
    ``layout_numels`` and ``finals``: per parameter (same order), its sync group, its element count in
    the group's reduction layout and its accumulations per step; ``launch(bucket)`` starts a ready
    bucket's reduction."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], *, groups: Sequence[GradGroup],
                 layout_numels: Sequence[int], finals: Sequence[int], num_layers: int, cap_elems: int,
                 overlap: bool, launch: Callable[[Bucket], None]) -> None:
        self.names, self.params, self.finals, self.buckets, self.bucket_of = build_buckets(
            named, groups=groups, layout_numels=layout_numels, finals=finals, num_layers=num_layers,
            cap_elems=cap_elems)
        offset = self.buckets[-1].hi if self.buckets else 0
        device = self.params[0].device if self.params else torch.device("cpu")
        self.data = torch.zeros(offset, dtype=torch.float32, device=device)
        self.views: list[torch.Tensor] = []
        start = 0
        for p in self.params:
            view = self.data[start:start + p.numel()].view(p.shape)
            start += p.numel()
            self.views.append(view)
            p.main_grad = view  # type: ignore[attr-defined]
        self.overlap, self.launch = overlap, launch
        self.counts = [0] * len(self.params)
        self._next = 0  # the first bucket not launched yet
        for i, p in enumerate(self.params):
            hook = self._hook(i)
            p.register_post_accumulate_grad_hook(hook)
            # ZB-H1's weight pass fuses an fp32 weight's GEMM into its main grad and calls this itself
            # (runtime/weight_grad.py: Megatron's gradient-accumulation fusion).
            p.grad_ready = hook  # type: ignore[attr-defined]
        self.reset()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            view = self.views[i]
            if p.grad is not view:  # a 16-bit parameter (or a .grad someone replaced): into the fp32 sum
                view.add_(p.grad)
                p.grad = view if p.dtype == torch.float32 else None
            self.counts[i] += 1
            b = self.buckets[self.bucket_of[i]]
            if b.launched:
                raise RuntimeError(f"gradient of '{self.names[i]}' arrived after its bucket's reduction started "
                                   f"({self.counts[i]} accumulations this step, {self.finals[i]} expected): the "
                                   "gradient sync's count of backward passes is wrong for this stage")
            if self.counts[i] == self.finals[i]:
                b.pending -= 1
                if b.pending == 0 and self.overlap:
                    self._advance()
        return on_grad

    def _advance(self) -> None:
        """Launch ready buckets in order."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])

    def _start(self, b: Bucket) -> None:
        b.launched = True
        self._next = b.index + 1
        self.launch(b)

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order (call after the step's last backward, before
        any other collective)."""
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])

    def reset(self) -> None:
        """Zero the gradients for the next step: the buffer, the counts; fp32 ``.grad`` = its view."""
        self.data.zero_()
        self.counts = [0] * len(self.params)
        for b in self.buckets:
            b.pending, b.launched = len(b.params), False
            b.extra.clear()
        self._next = 0
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view if p.dtype == torch.float32 else None

    def bucket_grads(self, b: Bucket) -> list[torch.Tensor]:
        """The main grads of a bucket's parameters."""
        return [self.views[i] for i in b.params]

    def bucket_params(self, b: Bucket) -> list[tuple[str, nn.Parameter]]:
        return [(self.names[i], self.params[i]) for i in b.params]
