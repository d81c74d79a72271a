"""The lists that split the suite (``tests/conftest.py``) name tests that exist.

An entry of ``LONG_TESTS`` that matches nothing (a test renamed or a parameter changed)
would silently move a long test back into ``make test``; a ``HALF_GRIDS`` entry that
matches nothing would leave its whole grid there. The named files are collected (not
run) by pytest itself, and every entry must match collected tests.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import HALF_GRIDS, LONG_TESTS, LONGEST_FILES_FIRST, REPO


def _collected(files: set[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-m", "slow or not slow", *sorted(files)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_every_entry_of_the_suite_lists_names_collected_tests() -> None:
    for path in LONGEST_FILES_FIRST:
        assert (REPO / path).is_file(), f"LONGEST_FILES_FIRST names no file: {path}"
    files = {entry.split("::")[0] for entry in (*LONG_TESTS, *HALF_GRIDS)}
    ids = _collected(files)
    unmatched = [entry for entry in LONG_TESTS if not any(i.startswith(entry) for i in ids)]
    assert unmatched == [], f"LONG_TESTS entries that match no test: {unmatched}"
    for grid in HALF_GRIDS:
        cases = [i for i in ids if i.split("[")[0] == grid]
        assert len(cases) >= 2, f"HALF_GRIDS entry {grid} matches {len(cases)} cases"
