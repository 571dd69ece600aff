"""import-hf, export-hf and training from pretrained weights, end to end through the command line:
tiny Hugging Face models saved here, converted by the tools' own torchrun workers, trained on
CPU, exported again, and read back by transformers."""
import glob
import json
import shutil

from conftest import require_modules

require_modules("torch", "megatron.core", "transformers", "safetensors")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import tiny  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _same_weights(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert set(a) == set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [("qwen3", {"tp": 2}), ("qwen3_moe", {"ep": 2}),
                                           ("llama3.1", {"pp": 2})])
def test_import_then_export_gives_back_the_same_folder(tmp_path, cli, family, layout):
    """HF -> Megatron (written by TP, EP or PP workers) -> HF, fp32: every tensor equal to the bit,
    config.json the original, and transformers loads the result."""
    import transformers

    tiny(family, tmp_path / "hf")
    code, out, err = cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"),
                         "--layout", json.dumps(layout))
    assert code == 0, (out, err[-2000:])
    res = out["result"]
    assert res["notes"] == [] and res["family"] == ("llama" if family == "llama3.1" else family)
    assert res["workers"] == 2 and res["dtype"] == "fp32"
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text() == "release"
    code, out, err = cli("export-hf", "--checkpoint", str(tmp_path / "mcore"), "--output", str(tmp_path / "back"))
    assert code == 0, (out, err[-2000:])
    assert out["result"]["checkpoint_format"] == "torch_dist" and out["result"]["dtype"] == "fp32"
    assert _same_weights(tmp_path / "hf", tmp_path / "back") == []
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in exported.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")}
    cls = getattr(transformers, original["architectures"][0])
    assert cls.from_pretrained(tmp_path / "back") is not None


def test_a_folder_that_cannot_convert_is_refused_before_any_work(tmp_path, cli):
    tiny("llama", tmp_path / "hf")
    out_dir = tmp_path / "out"

    def refused(folder, *extra):
        code, out, _ = cli("import-hf", "--hf-model", str(folder), "--output", str(out_dir), *extra)
        assert code != 0 and not out["ok"], out
        assert not out_dir.exists() and not list(tmp_path.glob(".out.*"))  # nothing written, not even staging
        return out["error"]

    # the layout: TP 3 divides neither the 8 heads nor the 2 groups
    err = refused(tmp_path / "hf", "--layout", '{"tp": 3}')
    assert err["where"] == "/layout/tp" and "any layout" in err["fix"]
    # config.json and the weights disagree (a wider MLP than the weights hold)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "hf", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))
    err = refused(bad)
    assert "mlp" in err["message"] and "(192, 64)" in err["message"]
    # a sharded folder missing a shard the index names
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", sharded)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    from safetensors.torch import save_file
    names = sorted(weights)
    save_file({k: weights[k] for k in names[:10]}, str(sharded / "model-00001-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: "model-0000%d-of-00002.safetensors" % (1 if i < 10 else 2) for i, k in enumerate(names)}}))
    err = refused(sharded)
    assert err["code"] == "not_found" and "model-00002-of-00002.safetensors" in err["message"]
    # an architecture with no conversion, named with the supported ones
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "hf", other)
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["GemmaForCausalLM"]}))
    err = refused(other)
    assert "LlamaForCausalLM" in err["fix"] and "Qwen3MoeForCausalLM" in err["fix"]


@pytest.mark.slow
def test_the_output_folder_is_never_someone_elses(tmp_path, cli):
    tiny("llama", tmp_path / "hf")
    args = ["import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore")]
    (tmp_path / "mcore").mkdir()
    (tmp_path / "mcore" / "notes.txt").write_text("mine")
    code, out, _ = cli(*args)
    assert code != 0 and out["error"]["code"] == "conflict"
    assert (tmp_path / "mcore" / "notes.txt").read_text() == "mine"
    (tmp_path / "mcore" / "notes.txt").unlink()  # an empty folder is fine
    assert cli(*args)[0] == 0
    code, out, _ = cli(*args)  # the same request: the recorded answer, nothing redone
    assert code == 0 and out["result"]["already_done"]
    code, out, _ = cli(*args, "--dtype", "bf16")  # another request: only with overwrite
    assert code != 0 and out["error"]["code"] == "conflict"
    code, out, _ = cli(*args, "--dtype", "bf16", "--overwrite")
    assert code == 0 and out["result"]["dtype"] == "bf16"
    # while another conversion writes the folder, a second one is a conflict, not a race
    from megatron_skill.locks import FileLock
    with FileLock(tmp_path / ".mcore.conversion.lock"):
        code, out, _ = cli(*args, "--dtype", "fp32", "--overwrite")
    assert code != 0 and out["error"]["code"] == "conflict" and "another conversion" in out["error"]["message"]
    assert json.loads((tmp_path / "mcore" / "conversion.json").read_text())["result"]["dtype"] == "bf16"


def test_the_tools_own_output_stays_its_own_from_any_working_folder(tmp_path, monkeypatch):
    """A conversion asked with relative paths, then another asked from another folder: the record's
    request keeps its paths absolute, so its id is its own wherever it is checked from; a record an
    earlier version wrote (its request as given, its id of that) is still the skill's own."""
    from megatron_skill.contract import call, legacy_request_id

    tiny("llama", tmp_path / "hf")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    env = call("import-hf", {"hf_model": "hf", "output": "./mcore"})
    assert env["ok"], env
    record = json.loads((tmp_path / "mcore" / "conversion.json").read_text())
    assert record["request"]["output"] == str(tmp_path / "mcore")
    monkeypatch.chdir(tmp_path / "sub")
    env = call("import-hf", {"hf_model": "../hf", "output": "../mcore", "dtype": "bf16", "overwrite": True})
    assert env["ok"], env
    record = json.loads((tmp_path / "mcore" / "conversion.json").read_text())
    record["request"] = {**record["request"], "output": "../mcore"}
    record["request_id"] = legacy_request_id(record["tool"], record["request"])
    (tmp_path / "mcore" / "conversion.json").write_text(json.dumps(record))
    env = call("import-hf", {"hf_model": "../hf", "output": "../mcore", "dtype": "fp32", "overwrite": True})
    assert env["ok"], env


@pytest.mark.slow
def test_cpu_training_starts_from_the_imported_weights(tmp_path, cli):
    """The first loss of a CPU run from an import is the Hugging Face model's loss on the same
    tokens (the vocabulary, 256, needs no padding: padded rows would add zero logits to Megatron's
    softmax). With a learning rate far below fp32's resolution, the run's own TP 2 checkpoint
    exports back to the original weights: the legacy per-rank files join in place."""
    model = tiny("llama", tmp_path / "hf", vocab=256)
    assert cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"))[0] == 0
    request = {"hf_config": str(tmp_path / "mcore" / "hf"), "backend": "cpu", "num_gpus": 2, "layout": {"tp": 2},
               "seq_length": 32, "global_batch_size": 2, "runs_root": str(tmp_path / "runs"),
               "training": {"pretrained": str(tmp_path / "mcore"), "mock_data": True, "train_iters": 1,
                            "log_interval": 1, "lr": 1e-12, "min_lr": 0.0, "lr_warmup_iters": 0}}
    code, out, _ = cli("train", "--request", "-", "--dry-run", stdin=json.dumps(request))
    assert code == 0 and out["result"]["pretrained"]["path"] == str(tmp_path / "mcore")
    code, out, err = cli("train", "--request", "-", stdin=json.dumps(request))
    assert code == 0, (out, err[-3000:])
    first_loss = out["result"]["loss_curve"][0][1]
    assert out["result"]["pretrained"]["first_loss"] == first_loss and out["result"]["pretrained"]["first_batch"]
    batches = torch.load(glob.glob(str(tmp_path / "runs" / "*" / "first_batch-dp0.pt"))[0])
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(b["tokens"]).logits
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
            mask = b["loss_mask"].flatten().float()
            total, count = total + (losses * mask).sum().item(), count + mask.sum().item()
    assert first_loss == pytest.approx(total / count, rel=2e-6)  # the log prints 7 digits
    run_dir = glob.glob(str(tmp_path / "runs" / "*"))[0]
    code, out, err = cli("export-hf", "--checkpoint", f"{run_dir}/checkpoints", "--output", str(tmp_path / "back"))
    assert code == 0, (out, err[-2000:])
    assert out["result"]["checkpoint_format"] == "legacy" and out["result"]["dtype"] == "fp32"
    # A few weights near zero move by the update itself (about lr = 1e-12); a misplaced piece
    # would move by the weights' own size (0.2).
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-11


def test_render_passes_the_checkpoint_and_its_vocabulary_to_megatron(tmp_path, cli):
    """At TP 2 the import's 384 rows (300 padded at TP 1) need --make-vocab-size-divisible-by 192:
    Megatron's own padding at TP 2 would make 512 rows, which the checkpoint does not hold. The
    flags pass Megatron's parser (render checks every script with it)."""
    tiny("llama", tmp_path / "hf")
    assert cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"))[0] == 0
    code, out, err = cli("render", "--hf-config", str(tmp_path / "mcore" / "hf"), "--gpu", "h100-sxm",
                         "--num-gpus", "2", "--layout", '{"tp": 2}', "--output-dir", str(tmp_path / "r"),
                         "--training", json.dumps({"pretrained": str(tmp_path / "mcore"), "mock_data": True}))
    assert code == 0, (out, err[-2000:])
    args = out["result"]["megatron_args"]
    assert args[args.index("--pretrained-checkpoint") + 1] == str(tmp_path / "mcore")
    assert args[args.index("--make-vocab-size-divisible-by") + 1] == "192"
    assert out["result"]["pretrained"]["padded_vocab"] == 384
    # a model other than the imported one is refused, saying which to give
    code, out, _ = cli("render", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8",
                       "--output-dir", str(tmp_path / "r2"),
                       "--training", json.dumps({"pretrained": str(tmp_path / "mcore"), "mock_data": True}))
    assert code != 0 and out["error"]["where"] == "/training/pretrained" and "hf_config" in out["error"]["fix"]


def test_validate_finds_a_vocabulary_padded_for_another_tp(tmp_path, cli):
    """A checkpoint converted at TP 1 (300 tokens: 384 rows) loaded by a TP 2 script pads to 512
    rows and fails at load; validate says so and gives the divisor, which it then accepts."""
    tiny("llama", tmp_path / "hf")
    assert cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"))[0] == 0
    args = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160", "--num-attention-heads", "8",
            "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--swiglu",
            "--normalization", "RMSNorm", "--disable-bias-linear", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
            "--mock-data", "--train-iters", "10", "--lr", "1e-5", "--bf16",
            "--pretrained-checkpoint", str(tmp_path / "mcore")]
    code, out, _ = cli("validate", "--request", "-", stdin=json.dumps({"args": args, "num_gpus": 2}))
    found = {f["code"]: f for f in out["result"]["errors"]}
    assert "pretrained_vocab_rows" in found, out["result"]["errors"]
    assert "--make-vocab-size-divisible-by 192" in found["pretrained_vocab_rows"]["fix"]
    code, out, _ = cli("validate", "--request", "-", stdin=json.dumps(
        {"args": args + ["--make-vocab-size-divisible-by", "192"], "num_gpus": 2}))
    assert "pretrained_vocab_rows" not in {f["code"] for f in out["result"]["errors"]}
    assert out["result"]["pretrained"]["embedding_rows"] == 384


def test_a_sliding_window_is_said_not_silently_dropped(tmp_path, cli):
    tiny("mistral", tmp_path / "hf")  # transformers' Mistral config has a 4,096-token window
    code, out, _ = cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "m"), "--dry-run")
    assert code == 0 and out["result"]["dry_run"] and not (tmp_path / "m").exists()
    assert any(n.startswith("sliding-window attention (4096 tokens)") and "sequences up to 4096" in n
               for n in out["result"]["notes"])
