"""Local CPU emulation of a heterogeneous cluster, as an optional layer (docs/architecture.md).

Every device of such a cluster is a process of one host, and slower kinds are emulated by sleeping
(:mod:`hethub.emulation.slowdown`). This package holds everything that models that host: the
runtime's slowdown sleep and, in :mod:`hethub.emulation.measure` (torch), the measurements of the
host's effects (wake penalty, core speed spread, all-reduce among local ranks). Pure modules here
never import torch.
"""

from hethub.emulation.effects import HostEffects
from hethub.emulation.host import EmulationModel, host_model, usable_cores

__all__ = ["EmulationModel", "HostEffects", "host_model", "usable_cores"]
