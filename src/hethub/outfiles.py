"""Output files of the commands: folders made and checked up front, contents replaced atomically.

Why: a command that measures for a minute must not lose the measurement because ``--out`` names a
folder that does not exist or cannot be written, so :func:`prepare_output` runs *before* the work.
And a file a user already has (a plan, a profile) must never be left half-written by an interrupted
command, so :func:`write_text_atomic` writes a temporary file beside it and renames it into place.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hethub.errors import HethubError


def prepare_output(path: str | Path, *, flag: str = "--out", is_dir: bool = False) -> Path:
    """Create ``path``'s folder (or ``path`` itself when ``is_dir``) and check it can be written.

    Raises HethubError (exit 1) naming ``flag`` and the path when the folder cannot be made or written.
    """
    p = Path(path)
    folder = p if is_dir else (p.parent if str(p.parent) else Path("."))
    if not is_dir and p.is_dir():
        raise HethubError(f"{flag} {p} is a directory, but a file name is expected here. Fix: name a file, "
                          f"e.g. {flag} {p / 'out.json'}.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hethub-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise HethubError(f"{flag} {p}: cannot write into folder '{folder}' ({err.strerror or err}). Fix: choose "
                          "a writable location.") from None
    return p


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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a normal file's mode is wanted
        os.replace(tmp, p)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise HethubError(f"cannot write {p} ({err.strerror or err}). Fix: free space or choose another "
                          "location.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
