"""The golden set (tests/golden): plan, render and validate give the answers stored when the set
was last made on purpose. A difference is either a regression or a change to explain and
regenerate (tests/golden/make_golden.py)."""
import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
import make_golden  # noqa: E402


def test_answers_are_the_stored_ones(tmp_path):
    stored = json.loads((ROOT / "tests" / "golden" / "answers.json").read_text())
    cwd = os.getcwd()
    os.chdir(ROOT)   # the requests name fixtures by paths relative to the repository
    try:
        now = make_golden.answers(str(tmp_path))
    finally:
        os.chdir(cwd)
    for kind in stored:
        for i, (old, new) in enumerate(zip(stored[kind], now[kind])):
            assert new == old, f"{kind} #{i}: {getattr(make_golden, kind.upper() + 'S')[i]}"
