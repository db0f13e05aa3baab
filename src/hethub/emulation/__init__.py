"""Local CPU emulation of a heterogeneous cluster, as an optional layer (docs/architecture.md).

Every device of such a cluster is a process of one host; the runtime emulates slower kinds and
links as the cluster file asks (:mod:`hethub.runtime.slowdown`, :mod:`hethub.runtime.emulated_links`)
and knows nothing of this package. This package models that host for the predictor (its one hook,
:func:`host_model`) and, in :mod:`hethub.emulation.measure` (torch), measures the host's effects
(wake penalty, core speed spread, split backward, all-reduce among local ranks) with the runtime's
own modules. Imports go one way: emulation uses the runtime, never the reverse. Pure modules here
(all but ``measure``) never import torch.
"""

from hethub.emulation.effects import HostEffects
from hethub.emulation.host import EmulationModel, host_model, usable_cores

__all__ = ["EmulationModel", "HostEffects", "host_model", "usable_cores"]
