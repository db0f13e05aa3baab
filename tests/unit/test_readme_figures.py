"""README's "Measured here" table is the one bench/readme_figures.py writes: every row of the script is
in it, with a result, and re-rendering its cells gives the same block (nothing edited by hand)."""

import importlib.util
import sys

from conftest import REPO

spec = importlib.util.spec_from_file_location("readme_figures", REPO / "bench" / "readme_figures.py")
rf = importlib.util.module_from_spec(spec)
sys.modules.setdefault("readme_figures", rf)  # its dataclasses look their module up there
spec.loader.exec_module(rf)


def test_readme_table_is_the_scripts():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    cells = rf.current_cells(text)
    assert set(cells) == {r.what for r in rf.ROWS}
    assert all(cells[r.what] for r in rf.ROWS)
    assert len({r.key for r in rf.ROWS}) == len(rf.ROWS)
    block = text.split(rf.BEGIN, 1)[1].split(rf.END, 1)[0]
    commit = block.split("(last at ", 1)[1].split(")", 1)[0]
    assert rf.render(cells, commit) == rf.BEGIN + block + rf.END
