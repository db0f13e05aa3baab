"""User-facing error types.

Every error a person can cause with their input (a file, a flag, a plan that cannot run) is one of
these. The CLI prints ``str(err)`` as one paragraph and exits with ``err.exit_code``; nothing here
ever reaches the user as a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HethubError(Exception):
    """Base class for errors caused by user input or the environment, not by a bug."""

    exit_code = 1


class SpecError(HethubError, ValueError):
    """A cluster or model specification is malformed or inconsistent."""

    exit_code = 2


class PlanError(HethubError, ValueError):
    """A plan is malformed, inconsistent with its cluster/model, or cannot run."""

    exit_code = 3


class MemoryFitError(PlanError):
    """A plan is valid but some stage does not fit in its devices' memory."""

    exit_code = 4


class InfeasibleError(HethubError):
    """The planner found no plan that fits the cluster's memory."""

    exit_code = 5


class RuntimeSetupError(HethubError):
    """The launched job does not match its plan (world size, backend, devices)."""

    exit_code = 6


class CheckpointError(HethubError):
    """A checkpoint is missing, incomplete or corrupt."""

    exit_code = 7


class MissingExtraError(HethubError):
    """A command needs an optional part of hethub that is not installed (torch: ``hethub[train]``)."""

    exit_code = 8


# Third-party packages behind optional extras, and the extra that brings each (pyproject.toml).
EXTRA_OF = {"torch": "train", "matplotlib": "plots", "transformers": "hf", "safetensors": "hf",
            "tokenizers": "hf", "pyarrow": "hf"}


def missing_extra(err: ModuleNotFoundError, *, what: str) -> MissingExtraError | None:
    """The user-facing error for `err` when it is a package of an optional extra, else None (a bug)."""
    top = (err.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return MissingExtraError(f"{what} needs {top}, which is not installed. Fix: pip install 'hethub[{extra}]' "
                             "(or 'hethub[dev]' for everything); beside a vendor's PyTorch, keep it: docs/install.md.")


def require_extra(package: str, *, what: str) -> None:
    """Raise MissingExtraError unless `package` (one of EXTRA_OF) can be imported here; for commands
    that hand the work to another process, which would otherwise fail with its own traceback."""
    import importlib.util

    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing_extra(ModuleNotFoundError(f"No module named {package!r}", name=package), what=what)


def field_error(where: str, field: str, problem: str, fix: str, *, cls: type[HethubError] = SpecError):
    """Build an error that names the offending field and how to fix it."""
    return cls(f"{where}: field '{field}' {problem}. Fix: {fix}.")


def positive_int(value: object, *, where: str, field: str, cls: type[HethubError] = SpecError) -> int:
    """`value` if it is an integer >= 1 (booleans excluded), else an error naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise field_error(where, field, f"must be a positive integer, got {value!r}", "write a positive integer",
                          cls=cls)
    return value


def load_json(path: Path, *, missing: str, invalid_fix: str, cls: type[HethubError] = SpecError) -> Any:
    """The parsed content of the JSON file `path`: a missing file raises ``cls(missing)``, text that
    is not JSON raises ``cls("<path>: not valid JSON (<why>). Fix: <invalid_fix>.")``."""
    if not path.is_file():
        raise cls(missing)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise cls(f"{path}: not valid JSON ({err}). Fix: {invalid_fix}.") from None
