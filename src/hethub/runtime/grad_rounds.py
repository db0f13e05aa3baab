"""ZeRO-2/3's gradients: no whole gradient buffer, each micro-batch's buckets handed off as they complete.

The buckets are :class:`~hethub.runtime.grad_buffer.GradBuffer`'s (same parameters, same order, same
groups), but no buffer persists: autograd accumulates each parameter's gradient into its ``.grad`` as
usual, and a bucket's *round* (one micro-batch's gradients, the step's ``rounds`` = micro-batches)
is complete once every parameter of the bucket has had its backward passes of that round. Then the
round's gradients are copied into a fresh fp32 tensor of the bucket's size, the ``.grad`` s are
dropped, and the tensor goes to ``launch(bucket, data, round)``, which reduces its pieces onto their
owners (``runtime/zero.py``) and frees it once they are done. What lives at once is the parameters
of unfinished rounds' ``.grad`` (about one bucket in a plain backward) and the launched rounds the
reducer keeps in flight.

Order: rounds are launched round by round, each round's buckets in bucket order, a bucket's round
never before every earlier (round, bucket), so all members of a group issue its collectives in the
same order even where a stage's backward completes buckets in another order (ZB-H1's split weight
pass hands norms' gradients over in B and matrices' in W: a round's sums may then carry a norm's
next micro-batch, which only moves a term between rounds of the same step). :meth:`flush` launches
what is left after the last backward, a bucket without gradients as zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hethub.layout import GradGroup
from hethub.runtime.grad_buffer import Bucket, build_buckets


class RoundBuffer:
    """Per-micro-batch bucket rounds (module doc). ``passes``: per parameter, backward passes of one
    micro-batch; ``rounds``: micro-batches per step; ``overlap`` off: nothing launched before
    :meth:`flush`."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], *, groups: Sequence[GradGroup],
                 layout_numels: Sequence[int], passes: Sequence[int], rounds: int, num_layers: int,
                 cap_elems: int, overlap: bool, launch: Callable[[Bucket, torch.Tensor, int], None]) -> None:
        self.names, self.params, self.passes, self.buckets, self.bucket_of = build_buckets(
            named, groups=groups, layout_numels=layout_numels, finals=passes, num_layers=num_layers,
            cap_elems=cap_elems)
        self.rounds, self.overlap, self.launch = rounds, overlap, launch
        self.device = self.params[0].device if self.params else torch.device("cpu")
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.reset()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            self.counts[i] += 1
            if self.counts[i] > self.rounds * self.passes[i]:
                raise RuntimeError(f"gradient of '{self.names[i]}' arrived {self.counts[i]} times this step, "
                                   f"{self.rounds * self.passes[i]} expected: the gradient sync's count of "
                                   "backward passes is wrong for this stage")
            if self.overlap:
                self._advance()
        return on_grad

    def _done(self, b: Bucket) -> int:
        """Rounds of bucket ``b`` whose gradients have all arrived."""
        return min(self.counts[k] // self.passes[k] for k in b.params)

    def _advance(self) -> None:
        """Launch ready (round, bucket)s in order."""
        n = len(self.buckets)
        while self._next < self.rounds * n:
            r, k = divmod(self._next, n)
            if self._done(self.buckets[k]) <= r:
                return
            self._start(self.buckets[k], r)

    def _start(self, b: Bucket, r: int) -> None:
        data = torch.empty(b.numel, dtype=torch.float32, device=self.device)
        at = 0
        for k in b.params:
            p = self.params[k]
            n = p.numel()
            if p.grad is None:
                data[at:at + n].zero_()
            else:
                data[at:at + n].copy_(p.grad.reshape(-1))
                p.grad = None
            at += n
        self._next += 1
        self.launch(b, data, r)

    def flush(self) -> None:
        """Launch every round not launched yet, in order (after the step's last backward)."""
        n = len(self.buckets)
        while self._next < self.rounds * n:
            self._start(self.buckets[self._next % n], self._next // n)

    def reset(self) -> None:
        self.counts = [0] * len(self.params)
        self._next = 0
        for p in self.params:
            p.grad = None

    def bucket_params(self, b: Bucket) -> list[tuple[str, nn.Parameter]]:
        return [(self.names[i], self.params[i]) for i in b.params]

    def bucket_views(self, b: Bucket, data: torch.Tensor) -> list[torch.Tensor]:
        """A launched round's tensor cut into its parameters' gradients."""
        out, at = [], 0
        for k in b.params:
            p = self.params[k]
            out.append(data[at:at + p.numel()].view(p.shape))
            at += p.numel()
        return out
