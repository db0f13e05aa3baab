"""Local CPU emulation of a heterogeneous cluster, as an optional layer (docs/architecture.md).

Every device of such a cluster is a process of one host, and slower kinds are emulated by sleeping
(:mod:`hethub.emulation.slowdown`). This package holds everything that models that host: the
runtime's slowdown sleep and, in :mod:`hethub.emulation.measure` (torch), the measurements of the
host's effects (wake penalty, core speed spread, all-reduce among local ranks). Pure modules here
never import torch.
"""
