"""Every flag and positional argument of every command says what it is for in --help, and `hethub
launch` passes no training length the user did not ask for."""

import argparse

from conftest import EXAMPLES
from hethub import cli
from hethub.runtime.train_args import rank_parser


def _actions(parser: argparse.ArgumentParser, path: str):
    """(command path, action) for every argument of `parser` and, recursively, of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _actions(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            yield path, action


def test_every_argument_of_every_command_has_help():
    found = [*_actions(cli.build_parser(), "hethub"), *_actions(rank_parser(), "python -m hethub.train")]
    commands = {path for path, _ in found}
    # The walk reaches every command (a subcommand left out would pass vacuously).
    assert {"hethub plan", "hethub predict", "hethub train", "hethub demo", "hethub launch", "hethub report",
            "hethub profile", "hethub bench comm", "hethub export", "hethub import-plan", "hethub export-plan",
            "hethub models", "python -m hethub.train"} <= commands
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in found
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert not missing, f"arguments without help text: {missing}"


def test_help_renders_for_every_command(capsys):
    """Each command's --help formats (a bad %-placeholder in a help string only fails here)."""
    parser = cli.build_parser()
    for path in sorted({p for p, _ in _actions(parser, "hethub")}):
        argv = [*path.split()[1:], "--help"]
        try:
            cli.main(argv)
        except SystemExit as stop:
            assert stop.code == 0, path
        assert "usage:" in capsys.readouterr().out, path


def _launch(tmp_path, capsys, *args: str) -> tuple[int, str, str]:
    plan = tmp_path / "plan.json"
    if not plan.exists():
        assert cli.main(["plan", "--cluster", str(EXAMPLES / "local-cpu.toml"), "--model", "tiny", "--global-batch",
                         "4", "--seq-len", "32", "--precision", "fp32", "--out", str(plan)]) == 0
    capsys.readouterr()
    code = cli.main(["launch", "--plan", str(plan), "--hosts", "h0", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_launch_adds_no_steps_of_its_own(tmp_path, capsys):
    code, out, _ = _launch(tmp_path, capsys)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("OMP_NUM_THREADS"))
    assert "--steps" not in line
    assert f"no --steps given: the ranks train {rank_parser().get_default('steps')} steps" in out
    code, out, _ = _launch(tmp_path, capsys, "--", "--steps", "7")
    line = next(x for x in out.splitlines() if x.startswith("OMP_NUM_THREADS"))
    assert code == 0 and line.endswith("--steps 7") and "no --steps given" not in out
    code, out, _ = _launch(tmp_path, capsys, "--steps", "5")
    assert code == 0 and next(x for x in out.splitlines() if x.startswith("OMP")).endswith("--steps 5")
    code, _, err = _launch(tmp_path, capsys, "--steps", "5", "--", "--steps=7")
    assert code == 2 and "--steps is given twice" in err
