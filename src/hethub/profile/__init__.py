"""Profile files (hethub's own format and Sailor's) and peers' plan formats; no torch here.

The profilers that measure layers with torch live beside these modules and import torch themselves;
this package's ``__init__`` must stay importable by the predictor and planner without it.
"""

from hethub.profile.format import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    ProfileFile,
    ScanResult,
    load_profiles,
    merge_profiles,
    profile_from_dict,
    profile_to_dict,
    read_profile,
    read_profile_file,
    scan_profiles,
    write_profile,
)
from hethub.profile.sailor import (
    SAILOR_KINDS,
    SAILOR_MODELS,
    export_sailor_plan,
    import_sailor_plan,
    read_sailor_profile,
    sailor_plan_model,
)

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "SAILOR_KINDS",
    "SAILOR_MODELS",
    "ProfileFile",
    "ScanResult",
    "export_sailor_plan",
    "import_sailor_plan",
    "load_profiles",
    "merge_profiles",
    "profile_from_dict",
    "profile_to_dict",
    "read_profile",
    "read_profile_file",
    "read_sailor_profile",
    "sailor_plan_model",
    "scan_profiles",
    "write_profile",
]
