"""Each rank's start-up check of its PyTorch against its kind's needs, before any process group.

What it reads: torch's version and build (``torch.version.cuda`` / ``.hip``), the installed version of
the kind's extension (its package metadata: no import, so a mismatched extension cannot crash the
import first), and whether torch has the APIs the runtime calls for this plan (per-device autocast,
device events, SDPA's grouped-query option, the SDPA backends of the kind's attention implementation).
APIs newer than the range's floor are not demanded: the runtime has a fallback for each (gradient
clipping in runtime/grad_clip.py, the fused RMSNorm kernel in runtime/norms.py, the one-tensor
reduce-scatter in comm/reduce_scatter.py). The rules live in
``spec/torch_stacks.toml`` (hethub.spec.stacks); the distributed backend and the device itself are
checked next, by the device map (runtime/devices.py), after the extension's import has registered them.

A mismatch stops the rank with one RuntimeSetupError (exit 6, docs/cli.md) naming the rank, the kind,
the versions found and what to install.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hethub.errors import RuntimeSetupError
from hethub.plan import Plan
from hethub.spec.kind import DeviceKind
from hethub.spec.stacks import Found, stack_of, stack_problems

# The SDPA backends each attention implementation asks for (runtime/model.py's SDPA_BACKENDS).
_SDPA_NAMES = {"flash": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"), "math": ("MATH",)}


@dataclass(frozen=True)
class Feature:
    """An API the runtime calls, the torch releases that have it (words), and how to tell it is there."""

    name: str
    since: str
    present: Callable[[], bool]


def _has(path: str) -> Callable[[], bool]:
    def probe() -> bool:
        obj: object = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return False
        return True

    return probe


def _sdpa(names: tuple[str, ...]) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError:
            return False
        return all(hasattr(SDPBackend, n) for n in names)

    return probe


def _sdpa_gqa() -> bool:
    """Whether SDPA takes ``enable_gqa`` (a tiny CPU call: the kernel is a builtin without a signature)."""
    import torch.nn.functional as F

    q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


BASE_FEATURES = (
    Feature("torch.get_autocast_dtype", "torch 2.4 on", _has("torch.get_autocast_dtype")),
    Feature("torch.Event (device timing marks, checkpoint fences)", "torch 2.4 on", _has("torch.Event")),
    Feature("torch.nn.functional.scaled_dot_product_attention(enable_gqa=...)", "torch 2.5 on", _sdpa_gqa),
)


def features_for(plan: Plan, kind: str) -> tuple[Feature, ...]:
    """What ranks of ``kind`` call in ``plan``: the base APIs and the SDPA backends of its attention."""
    attention = plan.attention_of(kind)
    names = _SDPA_NAMES.get(attention, ())
    sdpa = Feature(f"torch.nn.attention.sdpa_kernel with SDPBackend.{', '.join(names)} ({attention} attention)",
                   "torch 2.3 on", _sdpa(names))
    return (*BASE_FEATURES, sdpa)


def installed_version(distribution: str) -> str | None:
    """The installed version of a package (its metadata), None if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def found_here(kind: DeviceKind) -> Found:
    stack = stack_of(kind)
    ext = stack.extension if stack is not None else ""
    return Found(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                 extension=installed_version(ext) if ext else None)


def check_rank_stack(plan: Plan, rank: int, *, found: Found | None = None,
                     features: tuple[Feature, ...] | None = None) -> None:
    """Raise RuntimeSetupError if this rank's PyTorch does not fit its kind (``found`` and
    ``features``: what this process has unless a test passes stand-ins)."""
    kind = plan.cluster.kinds[plan.cluster.devices[plan.devices[rank]].kind]
    found = found or found_here(kind)
    problems = stack_problems(kind, found, on_device=kind.device_type != "cpu")
    missing = [f for f in (features if features is not None else features_for(plan, kind.name)) if not f.present()]
    if missing:
        problems.append(f"torch {found.torch} lacks {', '.join(f'{f.name} ({f.since})' for f in missing)}, "
                        "which the runtime calls for this plan; install a torch that has them")
    if not problems:
        return
    stack = stack_of(kind)
    have = f"torch {found.torch}" + (f" (CUDA {found.cuda})" if found.cuda else "") + \
        (f" (ROCm/HIP {found.hip})" if found.hip else "")
    if stack is not None and stack.extension:
        have += f", {stack.extension} {found.extension or 'not installed'}"
    rule = f" (rule: {stack.source})" if stack is not None and stack.source else ""
    raise RuntimeSetupError(f"rank {rank} (kind {kind.name!r}) cannot run on this node's PyTorch: found {have}. "
                            f"{'; '.join(problems)}{rule}. Fix: install the kind's stack as docs/install.md "
                            "describes for its vendor, on this node.")
