"""Every row of docs/cli.md's exit-code table is exercised by a test: codes 1-7 by the bad-input table
of test_fuzz_inputs (each of its rows asserts its code through the CLI), the others here (128 + SIGTERM
also end to end in tests/dist/test_launcher_signals.py)."""

from __future__ import annotations

import re
import signal

import pytest
from test_fuzz_inputs import CASES

from conftest import REPO
from hethub import cli


def _documented_codes() -> set[int]:
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    table = text.split("## Errors and exit codes", 1)[1]
    codes: set[int] = set()
    for cell in re.findall(r"^\| ([\d, ]+) \|", table, re.M):
        codes |= {int(c) for c in cell.split(",")}
    return codes


def test_every_documented_code_has_a_test() -> None:
    tested = {code for *_, code, _ in CASES} | {0, 8, 130, 128 + signal.SIGHUP, 128 + signal.SIGTERM}
    documented = _documented_codes()
    assert documented >= {0, 1, 2, 3, 4, 5, 6, 7, 8, 130, 129, 143}
    assert documented <= tested, f"documented but never tested: {sorted(documented - tested)}"


def test_0_success(capsys) -> None:
    assert cli.main(["models"]) == 0


def test_8_missing_extra(monkeypatch, tmp_path, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert cli.main(["train", "--plan", str(tmp_path / "p.json")]) == 8
    assert "hethub[train]" in capsys.readouterr().err


def test_130_interrupted(monkeypatch, capsys) -> None:
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("hethub.cli.cmd_models", interrupted)
    assert cli.main(["models"]) == 130
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_128_plus_the_signal_when_hethub_train_is_stopped(sig, tmp_path, capsys) -> None:
    from hethub.commands.run import _stopped_by

    assert _stopped_by(sig, root=str(tmp_path / "ck")) == 128 + sig
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(sig).name}" in err and "lock" in err and "released" in err
