"""Measure this host's effects for the emulation model: wake penalty, core speed spread, split backward,
co-run factor."""

from __future__ import annotations

from hethub.emulation.effects import HostEffects
from hethub.spec.model import ModelSpec


def measure_host_effects(model: ModelSpec, *, mbs: tuple[int, ...] | int, seq_len: int, wake_penalty: bool = True,
                         speed_spread: bool = True, split_backward: bool = False, corun: bool = False) -> HostEffects:
    """The requested effects, measured with a stack of `model`'s decoder layers at the middle of the
    micro-batch sizes `mbs` (those a profile measures; the co-run factor at each of them); each takes a
    few seconds."""
    from hethub.emulation.measure.corun import measure_corun
    from hethub.emulation.measure.split import measure_split_backward
    from hethub.emulation.measure.spread import measure_speed_spread
    from hethub.emulation.measure.wake import measure_wake_penalty

    sizes = sorted((mbs,) if isinstance(mbs, int) else mbs)
    middle = sizes[len(sizes) // 2]
    return HostEffects(
        wake_penalty=measure_wake_penalty(model, mbs=middle, seq_len=seq_len) if wake_penalty else (),
        speed_spread=measure_speed_spread(model, mbs=middle, seq_len=seq_len) if speed_spread else (),
        split_backward=measure_split_backward(model, mbs=middle, seq_len=seq_len) if split_backward else None,
        corun=measure_corun(model, mbs=sizes, seq_len=seq_len) if corun else (),
    )
