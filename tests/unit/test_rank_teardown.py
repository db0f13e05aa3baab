"""How `hethub train` judges a failing exit: a rank that aborted in its teardown after every rank
passed the final barrier (each left its done marker, none an error) finished the run; anything
else is a failure."""

import json

from hethub.commands.run import _finished_anyway
from hethub.runtime.train_args import done_marker


def _marks(folder, ranks):
    for r in ranks:
        done_marker(folder, r).touch()


def test_every_rank_done_and_no_error_is_a_finished_run(tmp_path, capsys):
    _marks(tmp_path, range(3))
    assert _finished_anyway(tmp_path, world=3, returncode=1)
    assert "every rank finished training" in capsys.readouterr().err


def test_a_missing_marker_is_a_failure(tmp_path, capsys):
    _marks(tmp_path, [0, 2])  # rank 1 never passed the final barrier
    assert not _finished_anyway(tmp_path, world=3, returncode=1)
    assert capsys.readouterr().err == ""


def test_a_rank_error_is_a_failure_even_with_every_marker(tmp_path):
    _marks(tmp_path, range(2))
    (tmp_path / "rank-1.json").write_text(json.dumps({"rank": "1", "exit_code": 3, "message": "boom"}))
    assert not _finished_anyway(tmp_path, world=2, returncode=3)


def test_the_rank_leaves_its_marker_only_under_the_launcher(tmp_path, monkeypatch):
    from hethub.runtime.train import _mark_done

    monkeypatch.delenv("HETHUB_ERROR_DIR", raising=False)
    _mark_done(0)
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("HETHUB_ERROR_DIR", str(tmp_path))
    _mark_done(4)
    assert done_marker(tmp_path, 4).is_file()
