"""One rule book: a layout the job's layers refuse is refused alike by plan, render, validate and
train, and the FP8 recipe and GPU catalog follow the hardware."""
import pytest

from megatron_skill.contract import call
from megatron_skill.core.layout import RULES

# A dense Qwen3-style model: QK layernorm, GQA, tied embeddings.
QK_NORM = {"name": "qk-norm-2b", "num_layers": 8, "hidden_size": 2048, "ffn_hidden_size": 6144,
           "num_attention_heads": 16, "num_query_groups": 8, "vocab_size": 32000, "qk_layernorm": True,
           "normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope"}
LOCAL_ARGS = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
              "32", "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope", "--seq-length", "8192", "--max-position-embeddings", "8192",
              "--micro-batch-size", "1", "--global-batch-size", "64", "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--context-parallel-size", "2", "--bf16", "--transformer-impl", "local",
              "--use-distributed-optimizer"]


def test_context_parallel_without_te_is_refused_everywhere(tmp_path):
    plan = call("plan", {"model": "llama3-8b", "num_gpus": 16, "transformer_engine": False, "seq_length": 32768,
                         "global_batch_size": 16})
    assert plan["ok"] and all(p["layout"]["cp"] == 1 for p in plan["result"]["plans"])
    assert plan["result"]["rejected"]["cp_needs_te"]["count"] > 0
    render = call("render", {"model": "llama3-8b", "num_gpus": 8, "transformer_engine": False,
                             "layout": {"tp": 2, "cp": 2}, "dry_run": True, "output_dir": str(tmp_path)})
    assert render["error"]["code"] == "infeasible" and "cp_needs_te" in render["error"]["message"]
    train = call("train", {"model": "llama3-8b", "num_gpus": 8, "backend": "gpu", "gpu": "h200",
                           "transformer_engine": False, "layout": {"tp": 2, "cp": 2}, "dry_run": True,
                           "runs_root": str(tmp_path / "runs"), "training": {"mock_data": True}})
    assert not train["ok"] and "cp_needs_te" in train["error"]["message"], train
    valid = call("validate", {"args": LOCAL_ARGS, "num_gpus": 8, "gpu": "h100-sxm"})
    assert "cp_needs_te" in [f["code"] for f in valid["result"]["errors"]]
    # The same arguments on Transformer Engine's layers break no such rule.
    te_args = [a if a != "local" else "transformer_engine" for a in LOCAL_ARGS]
    valid = call("validate", {"args": te_args, "num_gpus": 8, "gpu": "h100-sxm"})
    assert "cp_needs_te" not in [f["code"] for f in valid["result"]["errors"]]


def test_a_qk_norm_model_is_never_planned_onto_sequence_parallel_local_layers(tmp_path):
    plan = call("plan", {"model": QK_NORM, "num_gpus": 8, "transformer_engine": False, "seq_length": 4096,
                         "top": 20, "constraints": {"tp": [2, 4]}})
    assert plan["ok"], plan
    tp_plans = [p for p in plan["result"]["plans"] if p["layout"]["tp"] > 1]
    assert tp_plans and not any(p["layout"]["sequence_parallel"] for p in tp_plans)
    with_te = call("plan", {"model": QK_NORM, "num_gpus": 8, "seq_length": 4096, "top": 20,
                            "constraints": {"tp": [2, 4]}})
    assert any(p["layout"]["tp"] > 1 and p["layout"]["sequence_parallel"] for p in with_te["result"]["plans"])
    render = call("render", {"model": QK_NORM, "num_gpus": 8, "transformer_engine": False, "layout": {"tp": 2},
                             "dry_run": True, "output_dir": str(tmp_path)})
    assert render["error"]["code"] == "infeasible" and "qk_norm_sp_needs_te" in render["error"]["message"]
    render = call("render", {"model": QK_NORM, "num_gpus": 8, "transformer_engine": False, "dry_run": True,
                             "layout": {"tp": 2, "sequence_parallel": False}, "output_dir": str(tmp_path)})
    assert render["ok"], render


@pytest.mark.parametrize("gpu,recipe", [("h100-sxm", "tensorwise"), ("h200", "tensorwise"), ("b200", "mxfp8"),
                                        ("gb200", "mxfp8")])
def test_the_fp8_recipe_follows_the_gpu(gpu, recipe, tmp_path):
    env = call("render", {"model": "llama3-8b", "gpu": gpu, "num_gpus": 8, "precision": "fp8", "dry_run": True,
                          "launcher": "slurm", "output_dir": str(tmp_path)})
    assert env["ok"], env
    args = env["result"]["megatron_args"]
    assert args[args.index("--fp8-recipe") + 1] == recipe


def test_frontier_gpus_plan():
    for gpu in ("h800", "h20"):
        env = call("plan", {"model": "llama3-8b", "gpu": gpu, "num_gpus": 16, "top": 1})
        assert env["ok"] and env["result"]["cluster"]["gpu"] == gpu, env
    h100 = call("plan", {"model": "llama3-70b", "gpu": "h100-sxm", "num_gpus": 64, "top": 1,
                         "constraints": {"tp": 8, "pp": 2, "mbs": 1}})["result"]["plans"][0]
    h800 = call("plan", {"model": "llama3-70b", "gpu": "h800", "num_gpus": 64, "top": 1,
                         "constraints": {"tp": 8, "pp": 2, "mbs": 1}})["result"]["plans"][0]
    assert h800["time"]["tp_comm_ms"] > 2 * h100["time"]["tp_comm_ms"]  # NVLink 200 GB/s against 450


def test_a_config_file_names_its_model_by_its_contents_not_its_folder(tmp_path):
    import json

    from conftest import ROOT

    cfg = json.loads((ROOT / "tests" / "fixtures" / "hf" / "llama3-8b" / "config.json").read_text())
    cache = tmp_path / "snapshots" / "3f2a9c"  # a hub cache folder: its name says nothing
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps({**cfg, "_name_or_path": ""}))
    env = call("plan", {"hf_config": str(cache), "num_gpus": 8, "top": 1})
    assert env["result"]["model"]["name"] == cfg["architectures"][0]
    (cache / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}))
    assert call("plan", {"hf_config": str(cache), "num_gpus": 8, "top": 1})["result"]["model"]["name"] == \
        "Meta-Llama-3-8B"


def test_an_infeasible_plan_still_says_what_the_model_is():
    env = call("plan", {"model": "llama3.1-405b", "gpu": "a100-40gb", "num_gpus": 8})
    assert env["error"]["code"] == "infeasible"
    assert env["error"]["details"]["model"]["params_b"] > 400


def test_a_script_whose_layout_needs_te_stops_where_te_is_missing(tmp_path):
    """Asked is what runs: a CP layout planned for TE does not fall back to local layers, which
    cannot run it; the script stops before launching anything, saying why."""
    import os
    import subprocess
    import sys

    env = call("render", {"model": "llama3-8b", "gpu": "h100-sxm", "num_gpus": 8, "layout": {"tp": 2, "cp": 2},
                          "python": sys.executable, "output_dir": str(tmp_path), "run_dir": str(tmp_path / "run"),
                          "training": {"mock_data": True}})
    assert env["ok"], env
    script = env["result"]["files"][0]["path"]
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRON_SKILL_ENTRY": "/bin/false"})
    assert proc.returncode == 5 and "needs Transformer Engine" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists() or not list((tmp_path / "run" / "logs").iterdir())


def test_a_refused_request_layout_is_told_its_fix_in_the_requests_words():
    """render speaks of a request's fields (dp, precision), validate of a script's flags: the rule
    record holds both where they differ."""
    base = {"model": "llama3-8b", "num_gpus": 16, "seq_length": 4096, "dry_run": True}
    env = call("render", {**base, "layout": {"tp": 2, "pp": 1, "dp": 4, "mbs": 1}})
    assert not env["ok"] and "'world_size'" in env["error"]["message"], env
    assert env["error"]["fix"].startswith(RULES["world_size"].request_fix) and "--" not in env["error"]["fix"]
    assert "script" in RULES["world_size"].fix
    env = call("render", {**base, "gpu": "a100-sxm-80gb", "precision": "fp8", "layout": {"tp": 2, "mbs": 1}})
    assert not env["ok"] and "precision bf16" in env["error"]["fix"], env
