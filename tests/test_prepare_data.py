"""prepare-data: JSONL in, a Megatron indexed dataset out, every line accounted for."""
from conftest import require_modules  # noqa: E402

require_modules('numpy', 'torch', 'megatron.core')

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, run_cli

CORPUS = ROOT / "data" / "sample" / "corpus.jsonl"


def _dataset_files(prefix):
    return sorted(p.name for p in prefix.parent.glob(prefix.name + ".*"))


def test_sample_corpus_becomes_a_dataset_that_gpt_dataset_reads(tmp_path, cli):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron_skill.runtime import patches

    prefix = tmp_path / "corpus"
    rc, out, err = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix), "--workers", "2")
    assert rc == 0, err
    res = out["result"]
    lines = [json.loads(ln) for ln in CORPUS.read_text().splitlines() if ln.strip()]
    assert res["documents_in"] == res["documents_out"] == len(lines) and res["bad_line_count"] == 0
    assert res["training"] == {"data_path": [str(prefix)]} and res["tokenizer"]["eod_id"] == 256
    # Documents in order, byte for byte, each ended by the end-of-document token.
    ds = IndexedDataset(str(prefix))
    assert len(ds) == len(lines)
    for i in (0, len(lines) // 2, len(lines) - 1):
        ids = ds[i]
        assert ids[-1] == 256 and bytes(ids[:-1].astype(np.uint8)).decode() == lines[i]["text"]
    assert sum(len(ds[i]) for i in range(len(ds))) == res["tokens"]
    # Megatron's GPTDataset over it, as train builds it (NullTokenizer, vocabulary 257).
    patches.by_name("dataset helpers").apply()
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=128, blend=([str(prefix)], None), split="100,0,0",
                           tokenizer=NullTokenizer(vocab_size=257), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
                           mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [64, None, None], lambda: True, cfg).build()
    sample = train[0]
    assert sample["tokens"].shape == (128,) and int(sample["tokens"].max()) <= 256
    assert (sample["labels"][:-1] == sample["tokens"][1:]).all()


def _bad_file(tmp_path):
    rows = ['{"text": "good one"}', "not json at all", '{"body": "no text field"}', "",
            '{"text": 42}', '["a", "list"]', '{"text": ""}', '{"text": "good two"}']
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_bad_lines_are_reported_by_line_then_skipped(tmp_path, cli):
    prefix = tmp_path / "out"
    rc, out, err = cli("prepare-data", "--input", str(_bad_file(tmp_path)), "--output-prefix", str(prefix),
                       "--bad-lines", "skip")
    assert rc == 0, err
    res = out["result"]
    assert [b["line"] for b in res["bad_lines"]] == [2, 3, 5, 6, 7]
    assert "not JSON" in res["bad_lines"][0]["reason"] and "'text'" in res["bad_lines"][1]["reason"]
    assert res["documents_in"] == 7 and res["documents_out"] == 2 and res["blank_lines"] == 1


def test_bad_lines_refused_leave_no_dataset(tmp_path, cli):
    prefix = tmp_path / "out"
    rc, out, _ = cli("prepare-data", "--input", str(_bad_file(tmp_path)), "--output-prefix", str(prefix))
    assert rc == 2 and out["error"]["details"]["line"] == 2 and "bad_lines" in out["error"]["fix"]
    assert _dataset_files(prefix) == []


def test_same_request_twice_does_the_work_once_and_other_requests_do_not_overwrite(tmp_path, cli):
    prefix = tmp_path / "corpus"
    args = ["prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix)]
    rc, first, _ = cli(*args)
    stamp = (prefix.with_suffix(".bin")).stat().st_mtime_ns
    rc2, second, err = cli(*args, "--workers", "1")  # workers change speed, not the request
    assert rc == rc2 == 0 and second["result"]["already_done"] and "nothing to do" in err
    assert second["request_id"] == first["request_id"] and prefix.with_suffix(".bin").stat().st_mtime_ns == stamp
    rc3, third, _ = cli(*args, "--text-key", "source")
    assert rc3 == 6 and third["error"]["code"] == "conflict" and "overwrite" in third["error"]["fix"]


def _big_input(path, n=300_000):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n")
    return path


def _start(*args):
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "launch.py"), "prepare-data", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(predicate, proc, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not predicate():
        time.sleep(0.1)
    assert predicate(), "the run finished (or hung) before the moment the test needs"


@pytest.mark.slow
def test_a_killed_run_leaves_no_half_written_dataset(tmp_path):
    prefix = tmp_path / "big"
    proc = _start("--input", _big_input(tmp_path / "input.jsonl"), "--output-prefix", prefix, "--workers", "2")
    _wait_for(lambda: list(tmp_path.glob(".big.bin.*.tmp")), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "big.bin").exists() and not (tmp_path / "big.idx").exists()
    # The next run removes the temporaries the journal names, and finishes.
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "after the crash"}\n')
    rc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "prepare-data", "--input", str(small),
                         "--output-prefix", str(prefix)], capture_output=True, text=True).returncode
    assert rc == 0 and _dataset_files(prefix) == ["big.bin", "big.idx", "big.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".big.prepare-data.lock"]


def test_files_beside_the_prefix_are_never_touched(tmp_path, cli):
    """Names that a pattern over PREFIX.*.tmp* would have matched (and deleted) stay as they were."""
    mine = {"corpus.header.tmpl": "a", "corpus.final.tmp": "b", "corpus.db.tmpbackup": "c", "corpus": "d",
            ".corpus.bin.1.tmp": "e", "corpusx.bin": "f"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    rc, out, err = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(tmp_path / "corpus"))
    assert rc == 0, err
    assert {n: (tmp_path / n).read_text() for n in mine} == mine
    assert {"corpus.bin", "corpus.idx", "corpus.json"} <= set(_dataset_files(tmp_path / "corpus"))


def test_a_record_that_is_not_ours_is_never_overwritten(tmp_path, cli):
    (tmp_path / "corpus.json").write_text('{"my": "settings"}')
    rc, out, _ = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(tmp_path / "corpus"),
                     "--overwrite")
    assert rc == 6 and "not written by prepare-data" in out["error"]["message"]
    assert (tmp_path / "corpus.json").read_text() == '{"my": "settings"}' and _dataset_files(tmp_path / "corpus") == \
        ["corpus.json"]


@pytest.mark.parametrize("prefix,why", [("probe/", "folder"), ("x/*", "glob"), ("/", "folder"), (".", "folder")])
def test_prefixes_that_name_no_file_are_refused(tmp_path, cli, prefix, why):
    rc, out, _ = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", prefix)
    assert rc == 2 and why in out["error"]["message"] and out["error"]["where"] == "/output_prefix"


def test_a_prefix_being_written_is_refused_not_shared(tmp_path):
    """While another process holds the prefix (as a running prepare-data does), a second run
    is refused at once with conflict, writes nothing and removes nothing."""
    prefix = tmp_path / "m"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from megatron_skill.locks import FileLock; from pathlib import Path;"
                               "FileLock(Path(sys.argv[2])).acquire(); print('held', flush=True); time.sleep(60)",
                               str(ROOT / "tools"), str(tmp_path / ".m.prepare-data.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "m.bin").write_bytes(b"theirs")
        rc, out, _ = run_cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix), "--overwrite")
        assert rc == 6 and "another prepare-data run" in out["error"]["message"]
        assert (tmp_path / "m.bin").read_bytes() == b"theirs" and not (tmp_path / "m.idx").exists()
    finally:
        holder.kill()


@pytest.mark.slow
def test_identical_requests_at_once_write_one_dataset(tmp_path):
    """Three identical requests started together: one writes, the others are refused or find
    it done; nobody crashes, and the dataset is whole."""
    same = [_start("--input", CORPUS, "--output-prefix", tmp_path / "s", "--workers", "1") for _ in range(3)]
    answers = [json.loads(p.communicate(timeout=300)[0]) for p in same]
    writers = [a for a in answers if a["ok"] and not a["result"].get("already_done")]
    assert len(writers) == 1, answers
    assert all(a["ok"] or a["error"]["code"] == "conflict" for a in answers), answers
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    assert len(IndexedDataset(str(tmp_path / "s"))) == writers[0]["result"]["documents_out"]


@pytest.mark.parametrize("done", [0, 1, 2, 3])
def test_a_run_killed_while_committing_is_finished_by_the_next(tmp_path, cli, done):
    """The commit puts .bin, .idx and the record in place one by one; a kill after any number
    of those steps leaves a journal, and the next run of the same request rolls it forward:
    the record then describes the files beside it, never older data."""
    from megatron_skill.tools import prepare_data as pd

    prefix = tmp_path / "c"
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "the old dataset"}\n')
    assert cli("prepare-data", "--input", str(other), "--output-prefix", str(prefix))[0] == 0  # old data in place
    args = ["prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix), "--overwrite"]
    staging = tmp_path / "staging"
    assert cli(*args[:4], str(staging))[0] == 0  # the new dataset, as the killed run had written it
    files = pd._paths(prefix)
    temps = {k: files[k].with_name(f".{files[k].name}.1-ab.tmp") for k in ("bin", "idx", "json")}
    for kind in ("bin", "idx"):
        os.replace(pd._paths(staging)[kind], temps[kind])
    rec = json.loads(pd._paths(staging)["json"].read_text())
    rid = cli(*args, "--dry-run")[1]["request_id"]
    rec["request_id"], rec["result"]["output_prefix"] = rid, str(prefix)
    temps["json"].write_text(json.dumps(rec))
    pd._write_journal(files, temps, "committing")
    files["json"].unlink()  # the commit's first step
    for kind in ("bin", "idx", "json")[:done]:
        os.replace(temps[kind], files[kind])
    rc, out, err = cli(*args)
    assert rc == 0 and out["result"]["already_done"], (out, err)
    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    assert len(IndexedDataset(str(prefix))) == len(lines) == out["result"]["documents_out"]
    assert not files["journal"].exists() and not any(t.exists() for t in temps.values())


def test_train_refuses_a_record_that_no_longer_matches_its_files(tmp_path, cli):
    prefix = tmp_path / "corpus"
    assert cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix))[0] == 0
    with open(tmp_path / "corpus.bin", "ab") as f:
        f.write(b"\0\0")
    rc, out, _ = cli("train", "--model", "tiny-gpt", "--backend", "cpu", "--dry-run",
                     "--training", json.dumps({"data_path": [str(prefix)]}), "--runs-root", str(tmp_path / "runs"))
    assert rc == 2 and "no longer describes" in out["error"]["message"]


def test_train_refuses_a_data_path_without_its_files(tmp_path, cli):
    rc, out, _ = cli("train", "--model", "tiny-gpt", "--backend", "cpu", "--dry-run", "--runs-root", str(tmp_path),
                     "--training", json.dumps({"data_path": ["0.5", str(tmp_path / "nothing")]}))
    assert rc == 3 and out["error"]["where"] == "/training/data_path/1" and "prepare-data" in out["error"]["fix"]


def test_lines_that_are_not_unicode_are_bad_lines_not_a_crash(tmp_path, cli):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "lone \\ud800 surrogate"}\n\xff\xfe{"text": "latin"}\n')
    for mode in ("skip", "refuse"):
        rc, out, err = cli("prepare-data", "--input", str(path), "--output-prefix", str(tmp_path / mode),
                           "--bad-lines", mode)
        if mode == "skip":
            assert rc == 0, err
            reasons = [b["reason"] for b in out["result"]["bad_lines"]]
            assert out["result"]["documents_out"] == 1 and "surrogate" in reasons[0] and "UTF-8" in reasons[1]
        else:
            assert rc == 2 and out["error"]["details"]["line"] == 2


TRAIN_BPE = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel()
tok.decoder = decoders.ByteLevel()
tok.train([sys.argv[1]], trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "</s>"]))
tok.save(sys.argv[2])
"""


@pytest.mark.slow
def test_local_hugging_face_tokenizer(tmp_path, cli):
    folder = tmp_path / "tok"
    folder.mkdir()
    # trained in its own process: the tokenizers trainer's thread pool and torch's do not share one well
    subprocess.run([sys.executable, "-c", TRAIN_BPE, str(CORPUS), str(folder / "tokenizer.json")], check=True,
                   timeout=300)
    encode = ("import json, sys; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); "
              "print(json.dumps([t.token_to_id('</s>'), t.encode(sys.argv[2], add_special_tokens=False).ids]))")
    prefix = tmp_path / "bpe"
    rc, out, err = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix),
                       "--tokenizer", str(folder))
    assert rc == 0, err
    res = out["result"]
    assert res["training"]["tokenizer_model"] == str(folder)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    first = json.loads(CORPUS.read_text().splitlines()[0])["text"]
    eos, want = json.loads(subprocess.run([sys.executable, "-c", encode, str(folder / "tokenizer.json"), first],
                                          capture_output=True, text=True, check=True).stdout)
    assert res["tokenizer"]["type"] == "huggingface" and res["tokenizer"]["eod_id"] == eos
    ds = IndexedDataset(str(prefix))  # kept alive: its items are views of its memory map
    assert ds[0].tolist() == want + [eos]


def test_errors_before_any_work(tmp_path, cli):
    rc, out, _ = cli("prepare-data", "--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "x"))
    assert rc == 3 and out["error"]["where"] == "/input/0"
    rc, out, _ = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(tmp_path / "x"),
                     "--tokenizer", str(tmp_path))
    assert rc == 3 and "tokenizer.json" in out["error"]["message"]
    rc, out, _ = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(tmp_path / "x"), "--dry-run")
    assert rc == 0 and out["result"]["dry_run"] and _dataset_files(tmp_path / "x") == []


@pytest.mark.slow
def test_train_uses_the_dataset_with_matching_tokenizer_flags(tmp_path, cli):
    prefix = tmp_path / "corpus"
    assert cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(prefix))[0] == 0
    training = json.dumps({"data_path": [str(prefix)], "train_iters": 8, "log_interval": 1, "save_interval": 8})
    rc, out, err = cli("render", "--model", "tiny-gpt", "--num-gpus", "1", "--gpu", "h100-sxm",
                       "--training", training, "--output-dir", str(tmp_path / "r"))
    assert rc == 0, err
    args = out["result"]["megatron_args"]
    assert args[args.index("--data-path") + 1] == str(prefix) and args[args.index("--vocab-size") + 1] == "257"
    # The prefix as a user types it, relative to where they stand (the run itself starts elsewhere).
    relative = os.path.relpath(prefix, ROOT)
    training = json.dumps({"data_path": [relative], "train_iters": 8, "log_interval": 1, "save_interval": 8})
    rc, out, err = cli("train", "--model", "tiny-gpt", "--backend", "cpu", "--runs-root", str(tmp_path / "runs"),
                       "--seq-length", "128", "--global-batch-size", "4", "--training", training, timeout=900)
    assert rc == 0, err
    curve = [loss for _, loss in out["result"]["loss_curve"]]
    assert len(curve) == 8 and curve[-1] < curve[0]  # real text, real steps: the loss goes down


def test_data_paths_without_a_file_name_are_left_as_they_are():
    """'/' or '.' as a data path (hypothesis found '/') is no prepare-data dataset: no record
    is looked up for it, and render passes it to Megatron unchanged instead of failing."""
    from megatron_skill.data.datasets import dataset_record, match_tokenizer

    assert dataset_record("/") is None and dataset_record(".") is None
    assert match_tokenizer({"data_path": ["/", "."]}, 256) == {"data_path": ["/", "."]}


def test_a_sentencepiece_model_tokenizes_as_megatrons_training_reads_it(tmp_path, cli):
    """A SentencePiece .model (or a folder holding only tokenizer.model, as Llama 2's): every
    document's ids are those Megatron's own tokenizer, built from the answer's training fields
    (tokenizer_type, tokenizer_model) by build_tokenizer as training builds it, gives the text,
    then its EOS; render takes those fields as they are."""
    import argparse
    import shutil

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import add_megatron_arguments

    model = ROOT / "tests" / "fixtures" / "tokenizers" / "sentencepiece-300.model"
    (tmp_path / "llama2").mkdir()
    shutil.copy(model, tmp_path / "llama2" / "tokenizer.model")
    lines = [json.loads(ln) for ln in CORPUS.read_text().splitlines() if ln.strip()][:40]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for name, tok in (("file", model), ("folder", tmp_path / "llama2")):
        prefix = tmp_path / name
        rc, out, err = cli("prepare-data", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(prefix),
                           "--tokenizer", str(tok), "--workers", "1")
        assert rc == 0, (out, err[-2000:])
        res = out["result"]
        assert res["tokenizer"]["type"] == "sentencepiece" and res["tokenizer"]["vocab_size"] == 300
        training = res["training"]
        assert training["tokenizer_type"] == "SentencePieceTokenizer"
        args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(
            ["--tokenizer-type", training["tokenizer_type"], "--tokenizer-model", training["tokenizer_model"]])
        args.rank, args.tensor_model_parallel_size = 0, 1
        megatron_tok = build_tokenizer(args)
        ds = IndexedDataset(str(prefix))
        assert len(ds) == len(lines)
        for i in (0, len(lines) // 2, len(lines) - 1):
            assert ds[i].tolist() == megatron_tok.tokenize(lines[i]["text"]) + [megatron_tok.eod]
    for given in (training, {"data_path": training["data_path"]}):   # the fields, or the dataset's record alone
        rc, out, _ = cli("render", "--model", "tiny-gpt", "--gpu", "h100-sxm", "--num-gpus", "1", "--dry-run",
                         "--output-dir", str(tmp_path / "r"), "--training", json.dumps(given))
        script = out["result"]["files"][0]["content"]
        assert rc == 0 and "--tokenizer-type SentencePieceTokenizer" in script
        assert f"--tokenizer-model {training['tokenizer_model']}" in script
    # a file named .model that is not one, and chat data (no template in a .model): clear refusals
    (tmp_path / "fake.model").write_text("not a model")
    rc, out, _ = cli("prepare-data", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "x"),
                     "--tokenizer", str(tmp_path / "fake.model"))
    assert rc != 0 and out["error"]["code"] == "bad_request" and out["error"]["where"] == "/tokenizer"
    rc, out, _ = cli("prepare-data", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "y"),
                     "--tokenizer", str(model), "--format", "chat")
    assert rc != 0 and out["error"]["where"] == "/tokenizer" and "chat" in out["error"]["fix"]


def test_files_prepare_data_did_not_write_are_never_replaced(tmp_path, cli):
    """A .bin with no record of prepare-data beside it is someone's own file: overwrite does not
    reach it; nor does a chat run reach a loss mask it did not write. Both are refused, untouched,
    and the dry run names every file a chat run writes."""
    mine = tmp_path / "corpus.bin"
    mine.write_bytes(b"the user's own")
    rc, out, _ = cli("prepare-data", "--input", str(CORPUS), "--output-prefix", str(tmp_path / "corpus"),
                     "--overwrite")
    assert rc == 6 and out["error"]["code"] == "conflict" and "did not write" in out["error"]["message"]
    assert mine.read_bytes() == b"the user's own" and not (tmp_path / "corpus.idx").exists()
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    mask = tmp_path / "c_lossmask.idx"
    mask.write_bytes(b"the user's mask index")
    args = ["prepare-data", "--input", str(chat), "--output-prefix", str(tmp_path / "c"), "--format", "chat"]
    rc, out, _ = cli(*args, "--dry-run")
    assert rc == 6 and str(mask) in out["error"]["message"]
    mask.unlink()
    rc, out, _ = cli(*args, "--dry-run")
    assert rc == 0 and "c_lossmask.bin" in " ".join(out["result"]["actions"])
    # the tool's own dataset, made by another request, is replaced where overwrite says so
    rc, _, _ = cli(*args)
    rc2, again, _ = cli(*args, "--text-key", "body", "--overwrite")
    assert rc == 0 and rc2 == 0 and not again["result"].get("already_done")
