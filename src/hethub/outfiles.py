"""Output files of the commands: folders made and checked up front, contents replaced atomically.

Why: a command that measures for a minute must not lose the measurement because ``--out`` names a
folder that does not exist or cannot be written, so :func:`prepare_output` runs *before* the work.
And a file a user already has (a plan, a profile) must never be left half-written by an interrupted
command, so :func:`write_text_atomic` writes a temporary file beside it and renames it into place.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from hethub.errors import HethubError


def prepare_output(path: str | Path, *, flag: str = "--out", is_dir: bool = False) -> Path:
    """Create ``path``'s folder (or ``path`` itself when ``is_dir``) and check it can be written.

    Raises HethubError (exit 1) naming ``flag`` and the path when the folder cannot be made or written.
    """
    p = Path(path)
    _check_names(p, flag=flag)
    folder = p if is_dir else (p.parent if str(p.parent) else Path("."))
    if not is_dir and p.is_dir():
        raise HethubError(f"{flag} {p} is a directory, but a file name is expected here. Fix: name a file, "
                          f"e.g. {flag} {p / 'out.json'}.")
    if is_dir and p.exists() and not p.is_dir():
        raise HethubError(f"{flag} {p} is a file, but a folder is expected here. Fix: name a folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hethub-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise HethubError(f"{flag} {p}: cannot write into folder '{folder}' ({err.strerror or err}). Fix: choose "
                          "a writable location.") from None
    return p


def _check_names(p: Path, *, flag: str) -> None:
    """Each part of ``p`` within the filesystem's name length, and no part of it an existing file
    (both fail only when the file is finally written otherwise: after the work)."""
    limit = 255
    with contextlib.suppress(OSError, ValueError, AttributeError):
        limit = os.pathconf(_existing_parent(p), "PC_NAME_MAX")
    for part in p.parts:
        if len(os.fsencode(part)) > limit:
            raise HethubError(f"{flag}: the name '{part[:40]}...' is {len(os.fsencode(part))} bytes long; this "
                              f"filesystem allows {limit}. Fix: a shorter name.")
    for parent in [*reversed(p.parents)][1:]:
        if parent.is_file():
            raise HethubError(f"{flag} {p}: '{parent}' is a file, so nothing can be written under it. Fix: choose "
                              "a path under a folder.")


def _existing_parent(p: Path) -> Path:
    for parent in p.parents:
        if parent.is_dir():
            return parent
    return Path(".")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one rename, creating its folder; never leaves it half-written."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as err:
        raise HethubError(f"cannot write {p} ({err.strerror or err}). Fix: choose a writable location.") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, normal_file_mode())  # mkstemp makes 0600; a normal file's mode is wanted
        os.replace(tmp, p)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise HethubError(f"cannot write {p} ({err.strerror or err}). Fix: free space or choose another "
                          "location.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def normal_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
