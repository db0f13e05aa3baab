"""The test folders have no ``__init__.py`` (pytest imports each module by its basename), so two test
modules of one name in different folders make the whole run fail to collect one of them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_folders():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]
