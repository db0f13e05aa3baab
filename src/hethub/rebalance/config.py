"""What online re-balancing may do and how cautious it is (``hethub train --rebalance ...``)."""

from __future__ import annotations

from dataclasses import dataclass

# off: measure and name stragglers only; shares: re-split the micro-batch counts among replicas;
# layers: also move one layer between adjacent stages of a pipeline where that pays more.
MODES = ("off", "shares", "layers")
DEFAULT_MODE = "shares"


@dataclass(frozen=True)
class RebalanceConfig:
    mode: str = DEFAULT_MODE
    # A change is made only when it is predicted to cut the step time by more than this fraction...
    min_gain: float = 0.05
    # ... on this many consecutive steps (with the window's median, a noisy step never moves anything).
    patience: int = 3
    # Steps not measured at the start and after a layer move (allocation, first-touch, imports).
    warmup_steps: int = 2
    # Steps after a change before the next one may be decided (its effect is measured first).
    cooldown_steps: int = 3
    # Each rank's times are the median of its last this many measured steps.
    window: int = 3
    # A rank whose time per micro-batch is this many times its prediction is named a straggler.
    straggler_factor: float = 1.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rebalance mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.window < 1:
            raise ValueError(f"window {self.window} must be >= 1")
        if self.min_gain < 0 or self.patience < 1 or self.warmup_steps < 0 or self.cooldown_steps < 0:
            raise ValueError("min_gain >= 0, patience >= 1, warmup_steps >= 0 and cooldown_steps >= 0")
        if self.straggler_factor <= 1:
            raise ValueError(f"straggler_factor {self.straggler_factor} must be > 1")

    @property
    def changes(self) -> bool:
        return self.mode != "off"

    @property
    def moves_layers(self) -> bool:
        return self.mode == "layers"
