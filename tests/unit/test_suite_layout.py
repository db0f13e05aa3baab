"""The suite's own structure: module names pytest can import, and a slow-tier list that names real tests.

The test folders have no ``__init__.py`` (pytest imports each module by its basename), so two test
modules of one name in different folders make the whole run fail to collect one of them. The slow
tier (tests/slow_tests.txt) is a list of node ids: a renamed test would silently move back into the
fast tier, so every line must name a test function that exists.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from conftest import REPO, slow_test_ids

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_folders():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]


def test_every_slow_tier_line_names_an_existing_test():
    missing = []
    for node in sorted(slow_test_ids()):
        path, _, name = node.partition("::")
        file = REPO / path
        defined = set()
        if file.is_file():
            defined = {f.name for f in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
                       if isinstance(f, ast.FunctionDef)}
        if name not in defined:
            missing.append(node)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"


def test_a_group_reaches_the_node_id_the_loadgroup_scheduler_reads(request):
    """`make test`'s workers share a cached search only if ``@group`` ends the node id each reports
    (pytest 9.2 ignores the attribute pytest-xdist writes it to; tests/conftest.py writes it)."""
    import pytest

    from conftest import _tag_group

    node_id = type(request.node._id)  # pytest's structured node id

    class Item:
        def __init__(self, nodeid: str, group: str | None) -> None:
            self._id = node_id.parse(nodeid)
            self.mark = pytest.mark.xdist_group(group).mark if group else None

        @property
        def nodeid(self) -> str:
            return str(self._id)

        def get_closest_marker(self, name: str):
            return self.mark if name == "xdist_group" else None

    grouped, plain, param = Item("a.py::t", "g"), Item("a.py::u", None), Item("a.py::v[x-1]", "g")
    for item in (grouped, plain, param):
        _tag_group(item)
    assert (grouped.nodeid, plain.nodeid, param.nodeid) == ("a.py::t@g", "a.py::u", "a.py::v[x-1]@g")
    _tag_group(grouped)  # once only
    assert grouped.nodeid == "a.py::t@g"
