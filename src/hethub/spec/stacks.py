"""What each device kind's ranks need of their PyTorch (``torch_stacks.toml`` beside the catalog), and
the pure check of what a rank found against it.

A rank reads its torch version, build and the kind's extension version (hethub.runtime.stack_check)
and hands them here as :class:`Found`; :func:`stack_problems` says, in words, what does not match.
Versions are compared by their release numbers (the digits before any pre-release or local part), so
vendor builds with local labels (``2.6.0+rocm6.2.4``, ``2.6.0a0+gitabc``) compare as their release.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from importlib import resources

from hethub.spec.kind import DeviceKind

_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")
_MATCH_PARTS = {"major.minor": 2, "major.minor.patch": 3}


@dataclass(frozen=True)
class TorchRange:
    """Torch versions the runtime supports: release >= ``min`` and < ``below``."""

    min: str
    below: str

    def admits(self, version: str) -> bool:
        r = release(version)
        return r is not None and _cmp(r, release(self.min)) >= 0 and _cmp(r, release(self.below)) < 0


@dataclass(frozen=True)
class Stack:
    """One torch_package's needs (the fields of torch_stacks.toml)."""

    package: str
    build: str = ""
    local: tuple[str, ...] = ()
    extension: str = ""
    match: str = ""
    install: str = ""
    source: str = ""


@dataclass(frozen=True)
class Found:
    """What one rank's Python has: torch's version and build, and the kind's extension's version."""

    torch: str
    cuda: str | None = None  # torch.version.cuda
    hip: str | None = None  # torch.version.hip
    extension: str | None = None  # installed version of the kind's extension; None: not installed


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string ("2.6.0a0+git1" -> (2, 6, 0)); None if it has none."""
    m = _RELEASE.match(version or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def local_label(version: str) -> str:
    """The part after "+" ("2.6.0+rocm6.2" -> "rocm6.2"), "" if none."""
    return version.split("+", 1)[1] if "+" in version else ""


def _cmp(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> int:
    a, b = a or (), b or ()
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


@functools.cache
def _table() -> dict:
    text = resources.files("hethub.spec").joinpath("torch_stacks.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def torch_range() -> TorchRange:
    t = _table()["torch"]
    return TorchRange(min=t["min"], below=t["below"])


def stacks() -> dict[str, Stack]:
    """Every entry of torch_stacks.toml, keyed by the catalog's torch_package."""
    return {name: Stack(package=name, build=t.get("build", ""), local=tuple(t.get("local", ())),
                        extension=t.get("extension", ""), match=t.get("match", ""), install=t.get("install", ""),
                        source=t.get("source", ""))
            for name, t in _table()["stacks"].items()}


def stack_of(kind: DeviceKind) -> Stack | None:
    """The kind's stack; None for a kind that needs only stock torch (CPU) or whose package the table
    does not know (a hand-made kind: the runtime's import and device checks still apply)."""
    return stacks().get(kind.torch_package) if kind.torch_package else None


def stack_problems(kind: DeviceKind, found: Found, *, on_device: bool = True) -> list[str]:
    """What in ``found`` does not fit ``kind``: the torch range for every kind, and where its ranks run
    on the kind's device (``on_device``; not when emulated on CPU) its build or its extension's version."""
    out = []
    rng = torch_range()
    if not rng.admits(found.torch):
        out.append(f"torch {found.torch} is outside the versions hethub's runtime supports (>= {rng.min}, "
                   f"< {rng.below}); install torch >= {'.'.join(map(str, release(rng.min) or ()))}, < {rng.below}")
    stack = stack_of(kind) if on_device else None
    if stack is None:
        return out
    if stack.build and not getattr(found, stack.build):
        other = "a ROCm" if found.hip else "a CUDA" if found.cuda else "a CPU-only"
        out.append(f"torch {found.torch} is {other} build, but the kind needs {stack.package}; install "
                   f"{stack.install}")
    label = local_label(found.torch)
    if stack.local and not any(label.startswith(p) for p in stack.local):
        out.append(f"torch {found.torch} is not {stack.package} (its version label {label or '(none)'!r} does not "
                   f"start with {' or '.join(repr(p) for p in stack.local)}); install {stack.install}")
    if stack.extension:
        if found.extension is None:
            out.append(f"the package {stack.extension!r} is not installed beside torch {found.torch}; install "
                       f"{stack.install}")
        elif stack.match in _MATCH_PARTS:
            n = _MATCH_PARTS[stack.match]
            have, want = (release(found.extension) or ())[:n], (release(found.torch) or ())[:n]
            if have != want:
                out.append(f"{stack.extension} {found.extension} does not match torch {found.torch} ({stack.match} "
                           f"must be equal: {'.'.join(map(str, want))}); install {stack.install}")
    return out
