"""The check every test's answers go through (conftest.check_answer): a tool's answer, success or
error, in this process or printed by launch.py, must match the tool's response schema."""
import pytest
from conftest import check_answer, run_inproc


def test_a_command_lines_error_is_checked_against_its_tools_schema():
    code, answer, _ = run_inproc("plan", "--model", "llama3-8b", "--num-gpus", "eight")  # refused by argparse
    assert code != 0 and answer["ok"] is False and answer["error"]["where"] == "argv"
    check_answer(answer)
    with pytest.raises(AssertionError, match=r"schemas/plan.response.json at /error: 'message' is a required"):
        check_answer({**answer, "error": {"code": answer["error"]["code"]}})
    with pytest.raises(AssertionError, match="at /tool"):
        check_answer(answer, "render")   # the answer of another tool than the one asked


def test_an_unknown_tools_answer_is_checked_as_an_error_envelope():
    code, answer, _ = run_inproc("no-such-tool")
    assert code == 2 and answer["tool"] == "no-such-tool"
    check_answer(answer)
    with pytest.raises(AssertionError, match=r"the error envelope .* at /error/code"):
        check_answer({**answer, "error": {**answer["error"], "code": "oops"}})


def test_text_is_no_answer():
    code, text, _ = run_inproc()   # launch.py alone: the list of tools
    assert code == 0 and isinstance(text, str) and "tools:" in text
    check_answer(text)
