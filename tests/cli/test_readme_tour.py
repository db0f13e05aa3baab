"""The README's five-minute tour, every command in order, exactly as written, in a fresh folder.

The commands are read from README.md itself (the first bash block under "A five-minute tour"), so
README and test cannot drift. The folder holds a copy of the repository's ``examples/`` (the tour's
inputs) and a ``.venv/bin/activate`` that puts a ``hethub`` onto PATH running this checkout with the
interpreter running the tests: ``. .venv/bin/activate`` then means what it means after ``make``.
Each command must exit 0 and print no Python traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO


def tour_commands(readme: str) -> list[str]:
    """The commands of the README tour's bash block: comments dropped, continued lines joined."""
    section = readme.split("## A five-minute tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: no bash block in the tour"
    commands, current = [], ""
    for line in block.group(1).splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        commands.append(" ".join(current.split()))
        current = ""
    assert not current, f"README tour ends inside a continued line: {current!r}"
    return commands


def _fresh_folder(tmp: Path) -> dict[str, str]:
    shutil.copytree(REPO / "examples", tmp / "examples")
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shim = bin_dir / "hethub"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hethub.cli "$@"\n')
    shim.chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("HETHUB_FAULT_INJECT", None)
    return env


def test_tour_commands_parse():
    cmds = tour_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert cmds[0] == ". .venv/bin/activate"
    assert all(c.startswith("hethub ") for c in cmds[1:]), cmds
    assert {c.split()[1] for c in cmds[1:]} >= {"plan", "predict", "profile", "train", "report", "import-plan",
                                                "export-plan", "bench"}


@pytest.mark.slow
def test_readme_tour_runs_in_order(tmp_path):
    cmds = tour_commands((REPO / "README.md").read_text(encoding="utf-8"))
    env = _fresh_folder(tmp_path)
    activate, rest = cmds[0], cmds[1:]
    times = []
    for cmd in rest:
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", "-c", f"{activate} && {cmd}"], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=300, check=False)
        times.append((time.perf_counter() - t0, cmd.split()[1]))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}\n{out[-4000:]}"
        assert "Traceback" not in out, f"{cmd}\n{out[-4000:]}"
    print("tour step times: " + ", ".join(f"{name} {s:.1f} s" for s, name in times))
    # What the tour promises it leaves behind.
    for name in ("plan.json", "local.json", "run.jsonl", "links.json", "imported.json", "profiles/cpu-fast.json",
                 "profiles/cpu-slow.json", "report/plan.png", "report/trace.json", "report/summary.md"):
        assert (tmp_path / name).is_file(), name
