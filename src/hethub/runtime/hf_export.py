"""Where a Hugging Face export may be written, and what a re-export replaces.

An export into a folder that already holds files would mix them with the new model (and an earlier
export's shards, when the shard count changes, would stay beside the new ones as stale weights). So
a non-empty folder is refused unless ``--overwrite``; every export leaves ``hethub-export.json``
listing the files it wrote, and an overwrite removes exactly those (without that record: the
safetensors shards and index it is about to replace), never the user's other files. A training run's
``--export-hf`` may replace its own earlier export (a resumed run exports again) without the flag.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hethub.errors import SpecError
from hethub.outfiles import normal_file_mode, prepare_output

RECORD = "hethub-export.json"
_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def exported_files(out: str | Path) -> list[str]:
    """The files the last export into ``out`` wrote (its record), in writing order; [] if none."""
    try:
        data = json.loads((Path(out) / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = data.get("files") if isinstance(data, dict) else None
    return [f for f in files if isinstance(f, str) and "/" not in f] if isinstance(files, list) else []


def check_export_target(out: str | Path, *, overwrite: bool, flag: str = "--out") -> list[Path]:
    """Check (and create) the export folder ``out``; return the earlier files the export must remove
    first. SpecError (exit 2) for a non-empty folder without ``overwrite``, HethubError (exit 1) for a
    path that cannot be written."""
    out = prepare_output(out, flag=flag, is_dir=True)
    present = sorted(p for p in out.iterdir())
    if not present:
        return []
    earlier = [out / f for f in exported_files(out)]
    ours = {*earlier, out / RECORD} if earlier else set()
    if not overwrite and not (flag == "--export-hf" and earlier and set(present) <= ours):
        names = ", ".join(p.name for p in present[:4]) + (", ..." if len(present) > 4 else "")
        fix = ("pass --overwrite to replace the model files in it (other files are kept)" if flag == "--out"
               else "name an empty or new folder")
        raise SpecError(f"{flag} {out} is not empty ({names}); an export there would mix with those files. Fix: "
                        f"{fix}, or choose an empty folder.")
    if earlier:
        return [p for p in ours if p.exists()]
    return [p for p in present if _WEIGHTS.match(p.name)]


def finish_export(out: Path, written: list[Path]) -> None:
    """Give every written file the normal mode (safetensors writes 0600) and record them."""
    for p in written:
        p.chmod(normal_file_mode())
    record = out / RECORD
    record.write_text(json.dumps({"files": [p.name for p in written]}, indent=1) + "\n", encoding="utf-8")
    record.chmod(normal_file_mode())
