"""The analysis's statistics names that moved to the module they are defined in (intervals,
pvalues, bootstrap, estimates, units) still read from stats.py and bootstrap.py for one
release, each with a DeprecationWarning naming its home."""

from __future__ import annotations

import importlib

import pytest

from kvcouple.analysis import bootstrap, stats
from kvcouple.store import writer

MOVED = [
    (stats, name, home)
    for name, home in stats._MOVED.items()  # noqa: SLF001 (the table under test)
] + [
    (bootstrap, "holm", "kvcouple.analysis.pvalues"),
    (writer, "resume_mismatch", "kvcouple.store.resume"),
]


@pytest.mark.parametrize(("module", "name", "home"), MOVED, ids=lambda x: getattr(x, "__name__", x))
def test_a_moved_name_reads_from_its_home_with_a_warning(module, name, home):
    with pytest.warns(DeprecationWarning, match=f"{home}.{name}"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(home), name)


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stats.nope  # noqa: B018
