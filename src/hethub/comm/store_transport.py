"""A second bridge transport, through torch.distributed's key-value store: the smallest thing that
satisfies :class:`hethub.comm.transport.Transport` without gloo's data path.

It exists to prove the seam (the parity tests run the bridged plans over it, ``tests/dist``) and as
the template a real transport follows; it is slow (every byte goes through the store's server
process) and never the default. Messages are keyed by group, pair, tag and a per-key sequence
number, so one pair's messages with one tag are received in order and different tags are
independent, as the seam requires. A send is posted at once (the store keeps it); a receive or a
reduction reads at ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.transport import TransportCaps

PREFIX = "hethub/bridge"


def _default_store() -> Any:
    store = dist.distributed_c10d._get_default_store()
    if store is None:
        raise RuntimeError("the store transport needs torch.distributed initialised with a store")
    return store


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).view(like.shape)


@dataclass(frozen=True)
class StoreGroup:
    name: str
    members: tuple[int, ...]


@dataclass
class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class _Read:
    """A receive or a reduction: reads its keys at ``wait()``."""

    store: Any
    keys: list[str]
    finish: Any  # callable(list[bytes]) -> None
    cleanup: Any  # callable() -> None
    done: bool = field(default=False)

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.store.wait(self.keys, timeout if isinstance(timeout, timedelta) else timedelta(seconds=300))
            self.finish([self.store.get(k) for k in self.keys])
            self.cleanup()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.store.check(self.keys)


class StoreTransport:
    caps = TransportCaps(name="store")

    def __init__(self, store: Any = None) -> None:
        self.store = store if store is not None else _default_store()
        self.rank = dist.get_rank()
        self._seq: dict[str, int] = {}
        self.moved_bytes = 0  # posted by this rank (sends and reduction inputs): what tests check

    def _next(self, key: str) -> int:
        n = self._seq.get(key, 0)
        self._seq[key] = n + 1
        return n

    def group(self, ranks: Sequence[int], *, channel: str = "") -> StoreGroup:
        members = tuple(sorted(ranks))
        return StoreGroup(name=f"{'-'.join(map(str, members))}:{channel}", members=members)

    def _name(self, group: StoreGroup | None) -> str:
        return "world" if group is None else group.name

    def isend(self, buf: torch.Tensor, *, dst: int, tag: int, group: Any) -> _Done:
        key = f"{PREFIX}/{self._name(group)}/{self.rank}>{dst}/{tag}"
        self.store.set(f"{key}/{self._next(key)}", _to_bytes(buf))
        self.moved_bytes += buf.numel() * buf.element_size()
        return _Done()

    def irecv(self, buf: torch.Tensor, *, src: int, tag: int, group: Any) -> _Read:
        key = f"{PREFIX}/{self._name(group)}/{src}>{self.rank}/{tag}"
        full = f"{key}/{self._next(key)}"

        def finish(data: list[bytes]) -> None:
            buf.copy_(_from_bytes(data[0], buf))

        return _Read(self.store, [full], finish, lambda: self.store.delete_key(full))

    def all_reduce(self, buf: torch.Tensor, *, op: Any, group: StoreGroup) -> _Read:
        """Every member publishes its buffer; at ``wait()`` each sums all of them in member order (the
        same values on every member); the last member to read removes the keys."""
        base = f"{PREFIX}/{group.name}/all_reduce"
        call = f"{base}/{self._next(base)}"
        self.store.set(f"{call}/{self.rank}", _to_bytes(buf))
        self.moved_bytes += buf.numel() * buf.element_size()
        keys = [f"{call}/{m}" for m in group.members]

        def finish(data: list[bytes]) -> None:
            parts = [_from_bytes(d, buf) for d in data]
            out = parts[0].clone()
            for p in parts[1:]:
                if op == dist.ReduceOp.MAX:
                    torch.maximum(out, p, out=out)
                else:
                    out.add_(p)
            buf.copy_(out)

        def cleanup() -> None:
            if self.store.add(f"{call}/read", 1) == len(group.members):
                for k in [*keys, f"{call}/read"]:
                    self.store.delete_key(k)

        return _Read(self.store, keys, finish, cleanup)
