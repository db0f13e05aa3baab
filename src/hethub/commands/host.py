"""The local emulation host a command's cluster describes, for ``predict(..., host=...)`` and the planner."""

from __future__ import annotations

from hethub.emulation.host import EmulationModel, host_model
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


def host_for(cluster: Cluster, profiles_arg: str | None, *, model: ModelSpec | None = None,
             seq_len: int | None = None) -> EmulationModel | None:
    """None for a real cluster; for a local emulation cluster (``host_cores`` set) the emulation
    model, with the host effects (wake penalty, speed spread) the profile files measured."""
    if cluster.host is None:
        return None
    effects = None
    if profiles_arg:
        from hethub.profile.format import load_host_effects

        effects = load_host_effects(profiles_arg, model=model, seq_len=seq_len)
    return host_model(cluster, effects=effects)
