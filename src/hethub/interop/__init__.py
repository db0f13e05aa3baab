"""Peers' formats: Sailor's (SOSP'25) per-layer profiles and plans, read and written (pure, no torch)."""

from hethub.interop.sailor import (
    SAILOR_KINDS,
    SAILOR_MODELS,
    SailorProfile,
    export_sailor_plan,
    import_sailor_plan,
    read_sailor_profile,
    sailor_plan_model,
)

__all__ = [
    "SAILOR_KINDS",
    "SAILOR_MODELS",
    "SailorProfile",
    "export_sailor_plan",
    "import_sailor_plan",
    "read_sailor_profile",
    "sailor_plan_model",
]
