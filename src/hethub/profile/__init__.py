"""Profile files: hethub's own format (and Sailor's profile.json through :mod:`hethub.interop`); no torch.

The profiler that measures layers with torch is :mod:`hethub.profiler`; this package is only the
file formats, importable by the predictor's callers and the planner without torch.
"""

from hethub.profile.format import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    ProfileFile,
    ScanResult,
    load_host_effects,
    load_profiles,
    merge_profiles,
    profile_from_dict,
    profile_to_dict,
    read_profile,
    read_profile_file,
    scan_profiles,
    write_profile,
)

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ProfileFile",
    "ScanResult",
    "load_host_effects",
    "load_profiles",
    "merge_profiles",
    "profile_from_dict",
    "profile_to_dict",
    "read_profile",
    "read_profile_file",
    "scan_profiles",
    "write_profile",
]
