"""Generated hostile requests against every tool: each gets one envelope with a user error
code (or an answer), never an internal error, within a time bound, writing nothing (the
acting tools are asked for dry-runs, which must write nothing anywhere)."""
import json
import os
import signal

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_skill.contract import call, load_schema, tools

# asked for dry-runs: nothing may be written
ACTING = {"train", "bench", "prepare-data", "render", "on-event", "import-hf", "export-hf"}
SECONDS = 60

TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "/", ".", "..", "-", "=", "*", "~", "$HOME", "a\nb", "\ud800", "x\x00y", "../../etc/passwd",
                     "/dev/zero", "/proc/self/mem", "runs/../../x", "llama3-8b", "tiny-gpt", "h100-sxm", "NaN"]),
)
NUMBER = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, 1, 2, 8, 2**20, 2**20 + 1]),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([8.0, 1.5, -0.0]))
LEAF = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
VALUE = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


# A valid request of each tool: the generated ones change a few of its fields (or add one), so
# that most reach past the schema into the tool's own code.
BASE = {
    "plan": {"model": "llama3-8b", "num_gpus": 8},
    "render": {"model": "llama3.2-1b", "num_gpus": 8, "output_dir": "out"},
    "train": {"model": "tiny-gpt", "backend": "cpu"},
    "bench": {"model": "llama3.2-1b"},
    "validate": {"args": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]},
    "logs": {"log": str(ROOT / "tests" / "fixtures" / "logs" / "h200-kill-resume.log")},
    "prepare-data": {"input": [str(ROOT / "data" / "sample" / "corpus.jsonl")], "output_prefix": "x"},
    "doctor": {},
    "import-hf": {"hf_model": "hf-model", "output": "converted"},
    "export-hf": {"checkpoint": "converted", "output": "exported"},
    "on-event": {"event": {"version": 1, "event_id": "e0123456789", "type": "job.failed", "time": "2026-12-05T10:00:00Z",
                           "run_id": "r0123456789", "emitter": "job", "job": {"job_id": "7"}}, "runs_root": "runs"},
}


def _requests(tool: str):
    fields = sorted(load_schema(tool, "request")["properties"])
    changes = st.dictionaries(st.sampled_from(fields), VALUE, min_size=1, max_size=3) if fields else st.just({})
    extra = st.dictionaries(TEXT, VALUE, max_size=1)
    return st.tuples(changes, extra, st.booleans()).map(
        lambda t: {**BASE[tool], **t[0], **(t[1] if t[2] else {})})


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(tools()))
def test_generated_hostile_requests_get_one_user_error_or_an_answer(tool, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"fuzz-{tool}")

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=_requests(tool))
    def check(request):
        if tool in ACTING:
            request["dry_run"] = True
        if tool in ("train", "bench"):
            request["runs_root"] = str(work / "runs")
        before = sorted(p.name for p in work.iterdir())
        cwd = os.getcwd()
        os.chdir(work)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(SECONDS)
        try:
            env = call(tool, request)
        except _Timeout:
            pytest.fail(f"{tool} took more than {SECONDS} s on {request!r}")
        finally:
            signal.alarm(0)
            os.chdir(cwd)
        json.dumps(env, allow_nan=False)  # strict JSON, whatever came in
        assert env["tool"] == tool and isinstance(env["ok"], bool)
        if not env["ok"]:
            assert env["error"]["code"] != "internal", (request, env)
            assert env["error"]["message"] and env["error"].get("fix"), env
        if tool in ACTING:
            assert sorted(p.name for p in work.iterdir()) == before, f"a dry-run wrote files: {request!r}"

    check()


@pytest.mark.parametrize("tool", sorted(BASE))
def test_each_base_request_is_valid(tool, tmp_path, monkeypatch):
    """A guard on the fuzz itself: what it mutates is a request the tool accepts."""
    monkeypatch.chdir(tmp_path)
    request = {**BASE[tool], **({"dry_run": True} if tool in ACTING else {})}
    env = call(tool, request)
    # bench needs a GPU; on-event, a run and the shared secret; the conversions, a model folder: a
    # well-formed request is what is checked.
    assert env["ok"] or (tool == "bench" and env["error"]["code"] == "environment") or (
        tool == "on-event" and env["error"]["code"] in ("environment", "not_found")) or (
        tool in ("import-hf", "export-hf") and env["error"]["code"] == "not_found"), env
