"""validate: a suite of broken launch scripts (each error kind at least once) and correct ones."""
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from megatron_skill.contract import call

HEAD = """#!/bin/bash
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 8192 --swiglu --normalization RMSNorm
  --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
  --vocab-size 128256 --tokenizer-type NullTokenizer --mock-data
)
TRAIN="--train-iters 100 --lr 3e-4 --bf16"
"""


def script(parallel: str, extra: str = "", head: str = HEAD, nproc: str = "$GPUS_PER_NODE") -> str:
    return head + f"""PAR=(
  {parallel}
)
torchrun --nproc-per-node {nproc} \\
  pretrain_gpt.py "${{MODEL[@]}}" "${{PAR[@]}}" $TRAIN \\
  {extra}
"""


GOOD = script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 64 "
              "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")

BROKEN = {
    "obsolete_flag": script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                            "--global-batch-size 64 --use-distributed-optimizer", "--fp8-hybrid --use-mcore-models"),
    "unknown_flag": script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                           "--global-batch-size 64 --pipline-model-parallel-size 2"),
    "bad_value": script("--tensor-model-parallel-size two --micro-batch-size 1 --global-batch-size 64"),
    "world_size": script("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
                         "--global-batch-size 64", nproc="8"),
    "tp_heads": script("--tensor-model-parallel-size 3 --micro-batch-size 1 --global-batch-size 64", nproc="6"),
    "tp_query_groups": script("--tensor-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 64",
                              nproc="16"),
    "pp_layers": script("--pipeline-model-parallel-size 3 --micro-batch-size 1 --global-batch-size 64", nproc="6"),
    "cp_sequence": script("--context-parallel-size 8 --micro-batch-size 1 --global-batch-size 64",
                          head=HEAD.replace("--seq-length 4096", "--seq-length 4100")),
    "gbs_divisible": script("--micro-batch-size 3 --global-batch-size 64"),
    "tp_comm_overlap_needs_sp": script("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64",
                                       "--tp-comm-overlap"),
    "fp8_param_gather_needs_distopt": script("--micro-batch-size 1 --global-batch-size 64",
                                             "--fp8-format hybrid --fp8-param-gather"),
    "overlap_param_gather_needs_distopt": script("--micro-batch-size 1 --global-batch-size 64",
                                                 "--overlap-grad-reduce --overlap-param-gather"),
    "cuda_device_max_connections": script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                                          "--global-batch-size 64",
                                          head=HEAD.replace("export CUDA_DEVICE_MAX_CONNECTIONS=1\n", "")),
    "out_of_memory": script("--micro-batch-size 16 --global-batch-size 128"),
    "ep_experts": script("--expert-model-parallel-size 3 --micro-batch-size 1 --global-batch-size 48",
                         head=HEAD.replace("--mock-data", "--mock-data --num-experts 8 --moe-router-topk 2"), nproc="6"),
    "moe_needs_sp": script("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64",
                           head=HEAD.replace("--mock-data", "--mock-data --num-experts 8 --moe-router-topk 2")),
    "overlap_param_gather_needs_grad_reduce": script("--tensor-model-parallel-size 2 --sequence-parallel "
                                                     "--micro-batch-size 1 --global-batch-size 64 "
                                                     "--use-distributed-optimizer --overlap-param-gather"),
    "optimizer_cpu_offload_needs_precision_aware": script("--micro-batch-size 1 --global-batch-size 64 "
                                                          "--use-distributed-optimizer --optimizer-cpu-offload"),
    # sizes beyond what the memory check covers (a typo'd 10,000 layers) are an error, not a pass
    "model_out_of_range": script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                                 "--global-batch-size 64", head=HEAD.replace("--num-layers 32", "--num-layers 10000")),
    # a rule only Megatron's validate_args knows
    "megatron_validate_args": script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                                     "--global-batch-size 64 --use-distributed-optimizer --overlap-grad-reduce "
                                     "--overlap-param-gather-with-optimizer-step"),
}
FP8_ON_AMPERE = script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 64 "
                       "--use-distributed-optimizer",
                       "--fp8-format hybrid --fp8-recipe tensorwise")


def _validate(text: str, gpu: str = "h100-sxm", **extra):
    env = call("validate", {"script_text": text, "gpu": gpu, **extra})
    assert env["ok"], env
    return env["result"]


def test_correct_handwritten_script_passes():
    res = _validate(GOOD)
    assert res["valid"], res["errors"]
    assert res["world_size"] == 8 and res["layout"]["tp"] == 2 and res["layout"]["dp"] == 4


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_each_error_kind_is_found_with_its_fix(kind):
    res = _validate(BROKEN[kind])
    assert not res["valid"]
    codes = [e["code"] for e in res["errors"]]
    assert kind in codes, (kind, res["errors"])
    for e in res["errors"]:
        assert e["fix"] and e["message"]


def test_obsolete_flags_name_their_exact_replacements_checked_again():
    """Each fix is computed from the script's own value, and the vector with every fix applied is
    validated again (fixed_args)."""
    res = _validate(BROKEN["obsolete_flag"])
    fixes = {e["message"].split()[0]: e["fix"] for e in res["errors"] + res["warnings"] if e["code"] == "obsolete_flag"}
    assert fixes["--fp8-hybrid"].startswith("replace --fp8-hybrid with --fp8-format hybrid")
    assert fixes["--use-mcore-models"].startswith("delete --use-mcore-models")
    assert res["fixed_args"]["valid"] and "--fp8-hybrid" not in res["fixed_args"]["args"]
    assert res["fixed_args"]["args"][-2:] == ["--fp8-format", "hybrid"]
    cases = [("--cpu-optimizer-type ADAM", "replace --cpu-optimizer-type ADAM with --optimizer-cpu-offload "
              "--use-precision-aware-optimizer"),
             ("--virtual-pipeline-model-parallel-size 4", "replace --virtual-pipeline-model-parallel-size 4 with "
              "--num-virtual-stages-per-pipeline-rank 4"),
             ("--use-flash-attn", "delete --use-flash-attn")]
    for flag, fix in cases:
        res = _validate(GOOD.replace("pretrain_gpt.py", f"pretrain_gpt.py {flag}"))
        found = [e for e in res["errors"] + res["warnings"] if e["code"] == "obsolete_flag"]
        assert len(found) == 1 and found[0]["fix"].startswith(fix), found
        assert "fixed_args" in res
    # VP 4 at PP 1 is itself wrong: the fixed vector says so rather than passing
    vp = _validate(GOOD.replace("pretrain_gpt.py", "pretrain_gpt.py --virtual-pipeline-model-parallel-size 4"))
    assert not vp["fixed_args"]["valid"] and any("vp_needs_pp" in e for e in vp["fixed_args"]["remaining_errors"])
    res = _validate(BROKEN["unknown_flag"])
    assert any("--pipeline-model-parallel-size" in e["fix"] for e in res["errors"])
    assert any(e.get("where", "").startswith("line ") for e in res["errors"])
    assert "--pipeline-model-parallel-size" in res["fixed_args"]["args"]


def test_windows_line_endings_are_an_error_and_the_rest_is_still_checked():
    """bash keeps each CR of CR LF as part of a line's last word (set -o pipefail<CR> fails): a
    script saved with Windows line endings does not run, whatever its flags say; the reader
    still reads it, so the other findings come in the same answer."""
    res = _validate(GOOD.replace("\n", "\r\n"))
    errors, _ = _codes(res)
    assert errors == ["crlf_line_endings"] and "dos2unix" in res["errors"][0]["fix"], res["errors"]
    assert res["checks"]["megatron"].startswith("Megatron's parser and validate_args ran")
    broken = _validate(BROKEN["out_of_memory"].replace("\n", "\r\n"))
    assert set(_codes(broken)[0]) == {"crlf_line_endings", "out_of_memory"}
    assert _validate(GOOD)["valid"]


def test_sizes_beyond_the_planners_range_are_errors_and_below_it_warnings():
    """Above the range (10,000 layers, TP 10^30) no GPU holds the run: an error. Below it (a
    0, a sequence of 8) Megatron may start the run or its own checks refuse it: a warning that
    the layout and memory are unchecked, and Megatron's verdict beside it."""
    def codes(*extra):
        res = call("validate", {"args": BIG + list(extra), "num_gpus": 8, "gpu": "h100-sxm"})["result"]
        return {f["code"]: f["severity"] for f in res["errors"] + res["warnings"]}
    assert codes("--tensor-model-parallel-size", str(10**30))["layout_out_of_range"] == "error"
    assert codes("--seq-length", "8")["layout_out_of_range"] == "warning"
    zero = codes("--micro-batch-size", "0")
    assert zero["layout_out_of_range"] == "warning" and zero["megatron_validate_args"] == "error"
    # a model this check cannot read is its own shortfall (a warning); Megatron's checks still say
    # whether Megatron refuses it: a hidden size the heads do not split, yes; a repeated layer
    # pattern from Megatron's own docstring, no
    odd = codes("--hidden-size", "4095")
    assert odd["bad_model"] == "warning" and odd["megatron_validate_args"] == "error"
    moe = codes("--num-layers", "24", "--num-experts", "8", "--moe-layer-freq", "([1]*3+[0])*6")
    assert "bad_model" not in moe and "megatron_validate_args" not in moe
    assert "bad_model" not in codes("--num-layers", "24", "--num-experts", "8", "--moe-layer-freq", "2")
    # a pattern of another length passes Megatron's parser and stops its model build: an error
    assert codes("--num-layers", "8", "--num-experts", "8", "--moe-layer-freq", "([1]*3+[0])*6")["bad_model"] == "error"


def test_fp8_before_hopper():
    assert _validate(FP8_ON_AMPERE, gpu="h100-sxm")["valid"]
    res = _validate(FP8_ON_AMPERE, gpu="a100-80gb")
    assert "fp8_arch" in [e["code"] for e in res["errors"]]


def test_slurm_script_world_size_from_sbatch_lines():
    text = GOOD.replace("#!/bin/bash\n", "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n")
    text = text.replace("--nproc-per-node $GPUS_PER_NODE", "--nnodes $SLURM_NNODES --nproc-per-node $GPUS_PER_NODE")
    res = _validate(text)
    assert res["world_size"] == 16 and res["layout"]["dp"] == 8


def test_deepspeeds_runner_gives_the_world_size():
    """Megatron-DeepSpeed scripts start ranks with DeepSpeed's runner: --num_gpus per node x
    --num_nodes is the world the layout must split (TP 3 of 16 GPUs does not)."""
    text = GOOD.replace("torchrun --nproc-per-node $GPUS_PER_NODE", "deepspeed --num_nodes 2 --num_gpus 8")
    res = _validate(text)
    assert res["world_size"] == 16 and res["layout"]["dp"] == 8 and res["valid"], res["errors"]
    bad = _validate(text.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 3"))
    assert "world_size" in [e["code"] for e in bad["errors"]]


@pytest.mark.parametrize("model,n", [("llama3-8b", 8), ("llama3-70b", 64), ("mixtral-8x7b", 64),
                                     ("deepseek-v3", 1024), ("qwen3-30b-a3b", 16)])
@pytest.mark.parametrize("launcher", ["torchrun-multinode", "slurm"])
def test_rendered_scripts_validate_clean(tmp_path, model, n, launcher):
    # mock data: the script then names its vocabulary (a tokenizer given by the job's environment
    # leaves validate to assume one, and a plan near the memory limit would not fit the assumption)
    env = call("render", {"model": model, "num_gpus": n, "seq_length": 4096, "launcher": launcher,
                          "output_dir": str(tmp_path), "training": {"mock_data": True}})
    assert env["ok"], env
    res = _validate(Path(env["result"]["files"][0]["path"]).read_text())
    assert res["valid"], res["errors"]
    assert res["world_size"] == n
    assert res["layout"]["tp"] == env["result"]["layout"]["tp"]
    assert res["layout"]["pp"] == env["result"]["layout"]["pp"]


def test_render_request_and_args_forms():
    bad = call("validate", {"render_request": {"model": "llama3-70b", "num_gpus": 8, "layout": {"tp": 1, "mbs": 4}}})
    assert bad["ok"] and not bad["result"]["valid"] and "GiB" in bad["result"]["errors"][0]["message"]
    good = call("validate", {"render_request": {"model": "llama3-8b", "num_gpus": 8}})
    assert good["result"]["valid"]
    args = call("validate", {"args": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                      "--fp8-hybrid"], "num_gpus": 1})
    assert not args["result"]["valid"]


def test_cli_exit_codes(tmp_path):
    good, bad = tmp_path / "good.sh", tmp_path / "bad.sh"
    good.write_text(GOOD)
    bad.write_text(BROKEN["obsolete_flag"])
    run = lambda p: subprocess.run([sys.executable, str(ROOT / "tools/launch.py"), "validate", "--script", str(p)],  # noqa: E731
                                   capture_output=True, text=True)
    assert run(good).returncode == 0
    assert run(bad).returncode == 7
    missing = run(tmp_path / "nope.sh")
    assert missing.returncode == 3 and '"not_found"' in missing.stdout


def test_flag_fragments_and_argument_strings_are_read_as_flags(tmp_path):
    """Notes and conf snippets hold only flags: each obsolete one is named with its full fix, as
    for --args given as several words or as one shell-quoted string."""
    from conftest import run_cli

    snippet = tmp_path / "fp8.conf"
    snippet.write_text("# from an old recipe\n--fp8-hybrid \\\n  --bf16\n--cpu-optimizer --cpu-optimizer-type ADAM\n")
    res = call("validate", {"script": str(snippet)})["result"]
    fixes = {e["message"].split()[0]: e["fix"] for e in res["errors"] if e["code"] == "obsolete_flag"}
    assert set(fixes) == {"--fp8-hybrid", "--cpu-optimizer", "--cpu-optimizer-type"}
    assert "--use-precision-aware-optimizer" in fixes["--cpu-optimizer"] and res["script"] == {"fragment": True}
    for argv in (["--args", "--fp8-hybrid", "--bf16"], ["--args", "--fp8-hybrid --bf16"]):
        rc, out, _ = run_cli("validate", *argv, "--gpu", "h100-sxm")
        assert rc == 7 and [e["code"] for e in out["result"]["errors"]] == ["obsolete_flag"], out
    # A real script is still a script: a fragment needs every line to be flags.
    assert call("validate", {"script_text": "echo hi\n--bf16\n"})["error"]["code"] == "invalid_script"


def test_obsolete_flags_are_errors_only_where_megatron_refuses_them():
    """Megatron 0.19's own code decides: a flag its parser and validate_args still accept
    (deprecated and ignored, or translated, such as --use-mcore-models) is a warning; one its
    parser does not know, or validate_args stops on (--checkpoint-activations), is an error."""
    from megatron_skill.adapter import parser
    from megatron_skill.adapter.flags import OBSOLETE, arity, load_manifest, megatron_retired
    from megatron_skill.errors import ToolError

    def accepted(argv):
        try:
            parser.parse(SMALL + argv, world_size=1)
            return True
        except ToolError:
            return False

    def value(flag):   # a value the flag's parser takes, where it takes one
        entry = load_manifest()["flags"].get(flag)
        if entry is None:
            return ["2"] if "size" in flag else ["ADAM"] if "type" in flag else []
        return [] if arity(flag) == 0 else [entry.get("choices", ["2"])[0]]

    # (two whose meaning depends on others: --no-position-embedding without RoPE, a hybrid pattern)
    flags = sorted(set(OBSOLETE) | set(megatron_retired()) - {"--no-position-embedding", "--hybrid-override-pattern"})
    with_value = {f: [f, *value(f)] for f in flags}
    ok = {flag for flag in flags if accepted(with_value[flag])}
    assert {"--use-mcore-models", "--use-flash-attn", "--recompute-activations"} <= ok
    assert not {"--checkpoint-activations", "--batch-size", "--model-parallel-size", "--warmup"} & ok
    for flag in flags:
        argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *with_value[flag]]
        res = call("validate", {"args": argv, "num_gpus": 1})["result"]
        found = [f for f in res["errors"] + res["warnings"] if f["code"] == "obsolete_flag"]
        assert [f["severity"] for f in found] == ["warning" if flag in ok else "error"], (flag, found)


def test_sequence_parallel_at_tp1_is_a_warning_as_megatron_makes_it():
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--sequence-parallel"]
    res = call("validate", {"args": argv, "num_gpus": 8, "gpu": "h100-sxm"})["result"]
    assert "sp_needs_tp" not in [e["code"] for e in res["errors"]]
    assert "sp_needs_tp" in [w["code"] for w in res["warnings"]]
    assert res["layout"]["sequence_parallel"] is False   # the layout as Megatron runs it


def test_a_launch_inside_bash_c_with_its_entry_in_a_variable():
    script = "\n".join([
        "#!/bin/bash",
        'ENTRY_SCRIPT=${ENTRY_SCRIPT:-"/opt/megatron/pretrain_gpt.py"}',
        "NPROC=8",
        'srun --nodes=1 bash -c "torchrun --nproc-per-node $NPROC $ENTRY_SCRIPT --num-layers 16 --hidden-size 2048 '
        '--num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 '
        '--global-batch-size 64 --use-mcore-models --bf16"', ""])
    res = call("validate", {"script_text": script, "gpu": "h100-sxm"})["result"]
    assert res["world_size"] == 8 and res["num_megatron_args"] == 16, res  # 7 flags with values, 2 alone
    assert res["valid"] and [w["code"] for w in res["warnings"]].count("obsolete_flag") == 1


def test_a_quoted_value_split_by_word_splitting_is_joined_in_the_fixed_vector():
    """The split words are one value in the fixed vector, and Megatron's own verdict on it shows
    there (here: a batch-size schedule together with a global batch, which 0.19 refuses)."""
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--step-batch-size-schedule", "0:8", "1M:16"]
    res = call("validate", {"args": args, "num_gpus": 1})["result"]
    assert [e["code"] for e in res["errors"]] == ["stray_arguments"]
    assert res["fixed_args"]["args"][-1] == "0:8 1M:16"
    assert any("--step-batch-size-schedule and --global-batch-size" in e for e in res["fixed_args"]["remaining_errors"])


def test_a_flag_of_several_values_beside_an_obsolete_flag_is_kept_whole_in_the_fixed_vector():
    """--rampup-batch-size takes three values: none of them is read as a flag, and no stray word
    after it joins them (NVIDIA's GPT-3 175B examples of 2023-24 give it beside retired flags)."""
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--rampup-batch-size", "16", "16", "1000", "--use-mcore-models", "--bf16"]
    res = call("validate", {"args": args, "num_gpus": 1})["result"]
    assert res["fixed_args"]["args"][-5:] == ["--rampup-batch-size", "16", "16", "1000", "--bf16"], res["fixed_args"]
    assert "obsolete_flag" in [w["code"] for w in res["warnings"]]


def test_uniform_recompute_is_costed_as_every_layer_recomputed():
    """--recompute-method uniform --recompute-num-layers 1 recomputes all layers (one checkpoint per
    layer), block with 1 only the first layer of each stage: the two cost differently."""
    args = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
            "--tensor-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-num-layers", "1"]
    read = {m: call("validate", {"args": args + ["--recompute-method", m], "num_gpus": 8, "gpu": "h100-sxm"})["result"]
            for m in ("uniform", "block")}
    assert read["uniform"]["layout"]["recompute_layers"] == 32 and read["block"]["layout"]["recompute_layers"] == 1
    assert read["uniform"]["predicted_peak_gib"] < read["block"]["predicted_peak_gib"] - 5
    assert "uniform" in read["uniform"]["assumed"]["recompute"]


def test_megatrons_independent_refusals_come_in_one_pass_with_the_flags_to_change():
    """Megatron's validate_args stops at its first failed assert (--min-lr above --lr); the copy
    without the flag it names is checked again, so the next one (--save without --save-interval)
    shows in the same answer, each fix naming the flags its check reads."""
    for min_lr in (["--min-lr", "1e-3"], ["--min-lr=1e-3"]):
        args = SMALL + ["--lr", "1e-4", *min_lr, "--lr-warmup-iters", "1", "--save", "/ckpt"]
        res = call("validate", {"args": args, "num_gpus": 1})["result"]
        refused = [e for e in res["errors"] if e["code"] == "megatron_validate_args"]
        assert len(refused) == 2, (min_lr, refused)
    assert "args.min_lr <= args.lr" in refused[0]["message"] and "--min-lr" in refused[0]["fix"]
    assert "args.save_interval" in refused[1]["message"] and "--save-interval" in refused[1]["fix"]
    assert "--min-lr left out" in refused[1]["message"]
    # a check that reads a size Megatron requires: the copy keeps the size, and nothing of the copy's own
    # making (a size "argument is None") is reported
    heads = [a if a != "4" else "3" for a in SMALL] + ["--lr", "1e-4"]
    refused = [e for e in call("validate", {"args": heads, "num_gpus": 1})["result"]["errors"]
               if e["code"] == "megatron_validate_args"]
    assert len(refused) == 1 and "num_attention_heads" in refused[0]["message"], refused


def test_renamed_flags_are_read_as_what_replaces_them():
    """--activations-checkpoint-method/-num-layers (Megatron-LM 2021-22 scripts) are errors whose
    fixes name the recompute flags, and the layout is read with that recompute, as the fix runs."""
    args = SMALL + ["--activations-checkpoint-method", "uniform", "--activations-checkpoint-num-layers", "1",
                    "--custom-fsdp", "--data-impl", "mmap"]
    res = call("validate", {"args": args, "num_gpus": 1})["result"]
    fixes = {e["message"].split()[0]: e["fix"] for e in res["errors"] if e["code"] == "obsolete_flag"}
    assert "--recompute-granularity full --recompute-method uniform" in fixes["--activations-checkpoint-method"]
    assert "--recompute-num-layers 1" in fixes["--activations-checkpoint-num-layers"]
    assert "--use-megatron-fsdp" in fixes["--custom-fsdp"] and fixes["--data-impl"].startswith("delete --data-impl mmap")
    assert res["layout"]["recompute"] == "full" and res["layout"]["recompute_layers"] == 2


def test_a_layout_broken_past_costing_names_its_errors_not_an_arithmetic_fault():
    """EP 8 over 2 GPUs of TP x CP x DP (expert folding) leaves no expert data-parallel group: the
    memory is not costed, and the answer says which error stops it."""
    args = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
            "--num-experts", "8", "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
            "--moe-router-topk", "2", "--use-distributed-optimizer"]
    res = call("validate", {"args": args, "num_gpus": 8, "gpu": "h100-sxm"})["result"]
    assert "expert_folding" in [e["code"] for e in res["errors"]]
    assert "expert_folding" in res["memory"]["skipped"] and "division" not in res["memory"]["skipped"], res["memory"]


def test_an_entry_that_megatron_moved_or_removed_is_named_with_where_it_is_now():
    """pretrain_bert.py left Megatron-LM's root for examples/bert/ (core_v0.19.0); pretrain_retro.py
    is gone. A warning each (the script may run an older checkout); the moved one in its new place
    is no finding."""
    def entry_warnings(entry):
        text = f"#!/bin/bash\ntorchrun --nproc-per-node 8 {entry} --num-layers 4 --hidden-size 256 " \
               "--num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 " \
               "--global-batch-size 16\n"
        res = call("validate", {"script_text": text})["result"]
        return [w for w in res["warnings"] if w["code"] == "entry_moved"]
    moved = entry_warnings("/workspace/megatron/pretrain_bert.py")
    assert len(moved) == 1 and "examples/bert/pretrain_bert.py" in moved[0]["message"], moved
    assert "removed" in entry_warnings("pretrain_retro.py")[0]["message"]
    assert entry_warnings("/workspace/megatron/examples/bert/pretrain_bert.py") == []


def test_a_templates_placeholders_are_one_error_and_the_rest_of_the_script_is_checked():
    """Megatron-LM's older example scripts say CHECKPOINT_PATH=<Specify path>: bash cannot parse
    them (< and > redirect), so they are an error to fix; the rest is read with them as quoted
    values, so its own errors (TP 8 on 4 GPUs here) come in the same answer. Heredocs and
    redirections are left alone."""
    text = ("#!/bin/bash\nCHECKPOINT_PATH=<Specify path>\nDATA_PATH=<Specify path and prefix>\n"
            "cat <<EOF > /tmp/notes.txt\nnotes\nEOF\nwhile read -r h; do echo $h; done <hosts.txt >nodes.txt\n"
            "torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 "
            "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 16 --bf16 "
            "--tensor-model-parallel-size 8 --save \"$CHECKPOINT_PATH\" --data-path \"$DATA_PATH\" 2>&1 < /dev/null\n")
    res = call("validate", {"script_text": text})["result"]
    codes = [e["code"] for e in res["errors"]]
    assert "unfilled_placeholder" in codes and "world_size" in codes, res["errors"]
    placeholder = next(e for e in res["errors"] if e["code"] == "unfilled_placeholder")
    assert "<Specify path>" in placeholder["message"] and "<Specify path and prefix>" in placeholder["message"]
    assert "EOF" not in placeholder["message"] and "/dev/null" not in placeholder["message"]
    assert "hosts" not in placeholder["message"]
    # where quoting them does not make the script readable, the error is the script's own, where bash meets it
    broken = call("validate", {"script_text": "X=<Specify path>\nif true; then\n"})
    assert broken["error"]["code"] == "invalid_script" and "<Specify path>" in broken["error"]["fix"], broken


def test_an_old_flag_whose_replacement_the_launch_already_gives_is_to_be_deleted():
    """--fp8-hybrid beside --fp8-format hybrid: delete it (not "replace it with what is there");
    beside --fp8-format e4m3 the two disagree, and the fix still says what it stood for."""
    def fix_of(extra):
        res = call("validate", {"args": SMALL + extra, "num_gpus": 1})["result"]
        return next(f["fix"] for f in res["errors"] + res["warnings"] if f["code"] == "obsolete_flag")
    assert fix_of(["--fp8-format", "hybrid", "--fp8-hybrid"]).startswith("delete --fp8-hybrid: the launch's "
                                                                          "--fp8-format hybrid already")
    assert fix_of(["--fp8-format", "e4m3", "--fp8-hybrid"]).startswith("replace --fp8-hybrid with --fp8-format hybrid")


# ---- Megatron's code may exit, print or raise while it reads the arguments ----------------
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]


def test_a_flag_megatron_exits_on_gets_one_json_answer_naming_its_replacement():
    """Megatron 0.19's validate_args prints a line and calls exit() for --checkpoint-activations:
    the command line still answers with one JSON object that names the replacement."""
    from conftest import run_cli

    rc, out, _ = run_cli("validate", "--args", " ".join(SMALL + ["--checkpoint-activations"]), "--num-gpus", "1")
    assert rc == 7 and isinstance(out, dict) and out["ok"], out
    text = " ".join(e["message"] + " " + e["fix"] for e in out["result"]["errors"])
    assert "--checkpoint-activations" in text and "--recompute-granularity" in text, out["result"]["errors"]


def _exits_quietly():
    exit()


def _exits_with_status():
    print("a reason printed on stdout first")
    sys.exit(3)


def _asserts_bare():
    assert False  # noqa: B011 -- a bare assert, as Megatron writes some


def _raises_other():
    raise KeyError("hidden_size")


def _raises_system_exit_with_text():
    raise SystemExit("stopped: a message as the exit code")


@pytest.mark.parametrize("ending", [_exits_quietly, _exits_with_status, _asserts_bare, _raises_other,
                                    _raises_system_exit_with_text])
def test_every_way_megatron_can_end_is_one_tool_error_and_nothing_on_stdout(ending, capsys):
    from megatron_skill.adapter import parser
    from megatron_skill.errors import ToolError

    with pytest.raises(ToolError) as caught:
        parser._run_megatron("validate_args", ending)
    assert caught.value.code == "invalid_script" and caught.value.message and caught.value.fix
    assert capsys.readouterr().out == ""
    if ending is _exits_with_status:
        assert "a reason printed on stdout first" in caught.value.message


def test_help_in_the_arguments_is_refused_not_printed(capsys):
    from megatron_skill.adapter import parser
    from megatron_skill.errors import ToolError

    with pytest.raises(ToolError) as caught:
        parser.parse(SMALL + ["--help"])
    assert "--help" in caught.value.message and capsys.readouterr().out == ""


def test_render_answers_in_json_when_megatrons_checks_exit(monkeypatch, tmp_path):
    """render runs the same parser: an exit inside validate_args is its refusal, not a silent end."""
    import megatron.training.arguments as arguments

    monkeypatch.setenv("MEGATRON_SKILL_CACHE", str(tmp_path / "cache"))   # no remembered verdict
    monkeypatch.setattr(arguments, "validate_args", lambda args, defaults: exit())
    env = call("render", {"model": "llama3-8b", "num_gpus": 8, "output_dir": str(tmp_path / "out"), "dry_run": True})
    assert not env["ok"] and env["error"]["code"] == "invalid_script", env
    assert "exit" in env["error"]["message"]


# ---- one pass: every finding at once --------------------------------------------------------
BIG = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
       "--max-position-embeddings", "4096", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
       "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "10", "--lr", "1e-4"]


def _codes(res):
    return [f["code"] for f in res["errors"]], [f["code"] for f in res["warnings"]]


def test_independent_errors_and_megatrons_warnings_come_in_one_pass():
    """--fp16 with --bf16, virtual stages of 3 layers over 8 layers a rank, and --data-path without
    --split: the two errors and Megatron's warning, at once (Megatron's checks run on a copy with
    the errors repaired), and no virtual-stage count that cannot be."""
    argv = BIG + ["--fp16", "--bf16", "--pipeline-model-parallel-size", "4",
                  "--num-layers-per-virtual-pipeline-stage", "3", "--data-path", "/data/corpus_text_document"]
    res = call("validate", {"args": argv, "num_gpus": 8, "gpu": "h100-sxm"})["result"]
    errors, warnings = _codes(res)
    assert {"fp16_and_bf16", "vp_layers"} <= set(errors), res["errors"]
    assert any("--split" in w["message"] for w in res["warnings"]), res["warnings"]
    assert "fp16_and_bf16" in res["checks"]["megatron"] and "vp_layers" in res["checks"]["megatron"]
    assert res["layout"]["vp"] is None and res["layout"]["pp"] == 4


def test_retired_and_deprecated_flags_are_all_named_with_their_replacements_in_one_pass():
    argv = BIG + ["--bf16", "--checkpoint-activations", "--use-rotary-position-embeddings", "--batch-size", "4",
                  "--distributed-backend", "nccl"]
    res = call("validate", {"args": argv, "num_gpus": 8, "gpu": "h200"})["result"]
    fixes = {f["message"].split()[0]: (f["severity"], f["fix"]) for f in res["errors"] + res["warnings"]
             if f["code"] == "obsolete_flag"}
    assert fixes["--checkpoint-activations"][0] == "error"
    assert "--recompute-granularity full" in fixes["--checkpoint-activations"][1]
    assert fixes["--use-rotary-position-embeddings"] == ("warning", "replace --use-rotary-position-embeddings with "
                                                         "--position-embedding-type rope (0.19 translates it so)")
    assert fixes["--batch-size"][0] == "error" and "--micro-batch-size 4" in fixes["--batch-size"][1]
    assert "--distributed-backend" not in fixes   # still a flag of 0.19 (nccl or gloo)
    assert "on a copy with obsolete_flag repaired" in res["checks"]["megatron"]
    assert res["fixed_args"]["valid"] and "--checkpoint-activations" not in res["fixed_args"]["args"]


def test_the_retired_flags_come_from_megatrons_own_code():
    """The flags Megatron 0.19's validate_args stops on as retired are read from its source; the
    skill's own table agrees where it has words of its own for them."""
    from megatron_skill.adapter.flags import OBSOLETE, megatron_retired

    retired = megatron_retired()
    refused = {flag for flag, r in retired.items() if r.refused}
    assert {"--checkpoint-activations", "--batch-size", "--warmup", "--model-parallel-size"} <= refused
    assert "--recompute-granularity" in retired["--checkpoint-activations"].says
    assert not retired["--use-rotary-position-embeddings"].refused
    assert all(OBSOLETE[f].refused == (f in refused) for f in OBSOLETE if f in retired)


def test_recompute_activations_is_read_as_selective_recompute():
    """Megatron 0.19 turns --recompute-activations into selective recompute: with the local layers'
    unfused attention, the S x S scores are recomputed, not kept."""
    local = BIG + ["--bf16", "--transformer-impl", "local"]
    plain = call("validate", {"args": local, "num_gpus": 8, "gpu": "h100-sxm"})["result"]
    old = call("validate", {"args": local + ["--recompute-activations"], "num_gpus": 8, "gpu": "h100-sxm"})["result"]
    assert plain["layout"]["recompute"] == "none" and old["layout"]["recompute"] == "selective"
    assert old["predicted_peak_gib"] < plain["predicted_peak_gib"]


def test_query_groups_are_not_blamed_where_the_script_sets_none():
    res = call("validate", {"args": BIG + ["--bf16", "--tensor-model-parallel-size", "3"], "num_gpus": 6,
                            "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}})["result"]
    errors, _ = _codes(res)
    assert "tp_heads" in errors and "tp_query_groups" not in errors, res["errors"]


def test_an_unreadable_value_leaves_the_other_checks_running():
    argv = BIG + ["--fp16", "--bf16", "--pipeline-model-parallel-size", "two"]
    res = call("validate", {"args": argv, "num_gpus": 8})["result"]
    errors, _ = _codes(res)
    assert "bad_value" in errors and "fp16_and_bf16" in errors, res["errors"]
    assert res["layout"] is not None and "--pipeline-model-parallel-size" in res["assumed"]


TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"
VOCAB_MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 "
               "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --bf16 ")


@pytest.mark.parametrize("tokenizer, size, read, says", [
    (f"--tokenizer-type Llama2Tokenizer --tokenizer-model {TOKENIZERS / 'sentencepiece-300.model'}", 300, True,
     "300 pieces"),
    (f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {TOKENIZERS / 'sentencepiece-300.model'} "
     "--vocab-size 5000", 300, True, "300 pieces"),
    (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {TOKENIZERS / 'hf-bpe'}", 403, True,
     "len(tokenizer)"),
    (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {Path(__file__).parent / 'fixtures/hf/qwen2-7b'}",
     152064, True, "config.json"),
    ("--tokenizer-type NullTokenizer --vocab-size 32000", 32000, True, "--vocab-size 32000"),
    ("--tokenizer-type Llama2Tokenizer --tokenizer-model /nonexistent/tokenizer.model", 32000, False,
     "Llama 2's tokenizer.model"),
    # no type: pretrain_gpt.py's default, GPT2BPETokenizer, reads the vocab and merge files given
    ("--vocab-file /nonexistent/vocab.json --merge-file /nonexistent/m.txt", 50257, False, "GPT-2"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file /nonexistent/vocab.json --merge-file /nonexistent/m.txt",
     50257, False, "GPT-2"),
])
def test_vocabulary_from_the_tokenizer_the_launch_names(tokenizer, size, read, says):
    r = call("validate", {"args": (VOCAB_MODEL + tokenizer).split(), "gpu": "h100-sxm", "num_gpus": 1})["result"]
    v = r["vocabulary"]
    assert (v["size"], v["read"]) == (size, read) and says in v["source"], v
    assert ("vocab_size" in r["assumed"]) is (not read)


def test_vocabulary_sizes_match_the_tokenizer_libraries(tmp_path):
    """The counts read without the libraries equal what the libraries say (tokenizers here; the
    SentencePiece model's 300 pieces are what it was trained to); a GPT-2 vocab file's entries."""
    from tokenizers import Tokenizer

    from megatron_skill.adapter import described

    hf = Tokenizer.from_file(str(TOKENIZERS / "hf-bpe" / "tokenizer.json"))
    import json
    assert described.hf_tokenizer_size(json.loads((TOKENIZERS / "hf-bpe" / "tokenizer.json").read_text())) == \
        hf.get_vocab_size(with_added_tokens=True) == 403
    assert described.sentencepiece_pieces((TOKENIZERS / "sentencepiece-300.model").read_bytes()) == 300
    with pytest.raises(ValueError):
        described.sentencepiece_pieces(b"\x0a\xff")     # truncated: refused, never a wrong count
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(777)}))
    r = call("validate", {"args": (VOCAB_MODEL + f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} "
                                   f"--merge-file {vocab}").split(), "num_gpus": 1})["result"]
    assert r["vocabulary"]["size"] == 777 and r["vocabulary"]["read"]


STOCK_3B = ("--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 --group-query-attention "
            "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --seq-length 4096 "
            "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --bf16 --lr 3e-4 "
            "--train-iters 5000 --tokenizer-type NullTokenizer --vocab-size 128256 --transformer-impl local "
            "--no-masked-softmax-fusion --no-persist-layer-norm --no-rope-fusion --no-gradient-accumulation-fusion")
RECIPE = "--hidden-dropout 0.0 --attention-dropout 0.0 --adam-beta2 0.95 --weight-decay 0.1 --lr-warmup-iters 50"
TRAPS = {"recipe_dropout", "recipe_adam_beta2", "recipe_weight_decay", "no_lr_warmup"}


def _found(args: str, **req):
    res = call("validate", {"args": args.split(), "num_gpus": 1, **req})["result"]
    return res, {f["code"]: f for f in res["errors"] + res["warnings"]}


def test_recipe_traps_with_megatrons_own_defaults():
    """A Llama-style launch that leaves dropout, beta2, weight decay and warm-up to Megatron gets a
    warning for each, with Megatron's default as its parser reports it and the recipe's value as
    the fix; setting them silences all four; --use-rotary-position-embeddings gets its
    replacement; --distributed-backend is named for what it does."""
    res, found = _found(STOCK_3B + " --use-rotary-position-embeddings --distributed-backend gloo")
    assert TRAPS <= set(found), found
    assert "Megatron's parser" in res["checks"]["recipe"]
    assert "0.1" in found["recipe_dropout"]["message"] and found["recipe_dropout"]["fix"] == \
        "--hidden-dropout 0.0 --attention-dropout 0.0"
    assert "0.999" in found["recipe_adam_beta2"]["message"] and found["recipe_adam_beta2"]["fix"] == "--adam-beta2 0.95"
    assert "0.01" in found["recipe_weight_decay"]["message"]
    assert "about 50 of its 5,000 iterations" in found["no_lr_warmup"]["fix"]
    assert "gloo" in found["distributed_backend"]["message"] and all(
        found[c]["severity"] == "warning" for c in TRAPS | {"distributed_backend"})
    assert "--position-embedding-type rope" in found["obsolete_flag"]["fix"]
    res, found = _found(STOCK_3B + " " + RECIPE)
    assert not TRAPS & set(found) and res["valid"], found
    # a GPT-3-style model (GELU, LayerNorm) trains with dropout: no dropout warning there
    _, found = _found(STOCK_3B.replace("--swiglu --normalization RMSNorm ", ""))
    assert "recipe_dropout" not in found and "recipe_adam_beta2" in found


def test_tokenizer_package_and_memory_near_capacity():
    sp = TOKENIZERS / "sentencepiece-300.model"
    res, found = _found(STOCK_3B.replace("--tokenizer-type NullTokenizer --vocab-size 128256",
                                         f"--tokenizer-type Llama2Tokenizer --tokenizer-model {sp}") + " " + RECIPE)
    assert "sentencepiece" in found["tokenizer_needs_package"]["message"]
    assert found["tokenizer_needs_package"]["fix"] == "pip install sentencepiece in the job's Python (or its container)"
    # 25 layers of the stock 3B shape with unfused attention: predicted above 90 % of an H200, below its 139.8 GiB
    res, found = _found(STOCK_3B.replace("--num-layers 28", "--num-layers 25"), gpu="h200")
    assert 0.9 * 139.8 < res["predicted_peak_gib"] <= 139.8 and res["valid"]
    near = found["memory_near_capacity"]
    assert near["severity"] == "warning" and "unfused" in near["message"] and "S x S" in near["fix"]
    assert "0.8 GiB in bf16" in found["unfused_attention"]["message"]   # 24 heads x 4096^2 x 2 bytes
    assert "--no-create-attention-mask-in-dataloader" in found["unfused_attention"]["fix"]
    res, found = _found(STOCK_3B.replace("--num-layers 28", "--num-layers 20"), gpu="h200")
    assert "memory_near_capacity" not in found
    # the skill's entry runs SDPA on the same local layers: no unfused attention there
    _, found = _found(STOCK_3B + " --skill-linear-cross-entropy --skill-fused-adam", gpu="h200")
    assert "unfused_attention" not in found


def test_conditional_flags_are_a_finding_of_their_condition():
    """The GPT-OSS example's --enable-gpt-oss and --export-force-local-attention (Megatron-LM's
    pretrain_gpt.py adds them where nvidia-modelopt imports): warnings naming that condition
    and their source, not unknown flags; their values are not taken for stray words or handed
    to Megatron's parser (which runs); a value outside the group's choices is an error."""
    from megatron_skill.adapter import flags as megatron_flags

    res, found = _found(STOCK_3B + " " + RECIPE + " --enable-gpt-oss --export-force-local-attention "
                        "--export-kv-cache-quant fp8 --export-model-type=GPTModel")
    assert res["valid"] and "unknown_flag" not in found and "stray_arguments" not in found, found
    cond = [w for w in res["warnings"] if w["code"] == "conditional_flag"]
    assert {w["message"].split()[0] for w in cond} == {"--enable-gpt-oss", "--export-force-local-attention",
                                                         "--export-kv-cache-quant", "--export-model-type"}
    assert all("nvidia-modelopt" in w["fix"] and "core_v0.19.0" in w["source"] for w in cond)
    assert "ran at world size 1" in res["checks"]["megatron"]
    res, found = _found(STOCK_3B + " " + RECIPE + " --export-kv-cache-quant fp16")
    assert not res["valid"] and "fp8_affine" in found["bad_value"]["fix"]
    # none of the group is a flag of Megatron's own parser (else it would not be conditional)
    known = megatron_flags.known_flags()
    assert not any(f in known for g in megatron_flags.CONDITIONAL_GROUPS for f in g.flags)


def test_the_memory_read_back_counts_te_s_tp_overlap_buffers_as_the_planner_does():
    """--tp-comm-overlap on TE's layers (TP 2 with sequence parallelism) adds Transformer Engine's
    userbuffers outside torch's allocator: validate's verdict moves by what the planner's memory
    model counts for them (core/memory.userbuffer_bytes), not by nothing."""
    from types import SimpleNamespace

    from megatron_skill.core.layout import Layout
    from megatron_skill.core.memory import GIB, userbuffer_bytes

    args = ("--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
            "--micro-batch-size 1 --global-batch-size 64 --tensor-model-parallel-size 2 --sequence-parallel --bf16 "
            "--use-distributed-optimizer --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --disable-bias-linear --lr 3e-4 --lr-warmup-iters 1 "
            "--train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256")
    peaks = []
    for extra in ("", " --tp-comm-overlap"):
        res = call("validate", {"args": (args + extra).split(), "gpu": "h100-sxm", "num_gpus": 8})["result"]
        peaks.append(res["memory"]["peak_gib"])
    lay = Layout(tp=2, dp=4, mbs=1, gbs=64, seq_length=8192, sequence_parallel=True)
    expected = userbuffer_bytes(SimpleNamespace(hidden_size=4096), lay) / GIB   # sized by the hidden size alone
    assert expected > 0.5 and abs((peaks[1] - peaks[0]) - expected) < 0.02, (peaks, expected)


@pytest.mark.parametrize("extra, says", [
    ("--use-precision-aware-optimizer", "only supported with distributed optimizer"),
    ("--exp-avg-dtype bf16", "exp_avg_dtype can only be fp32 when not using precision-aware optimizer"),
    ("--use-distributed-optimizer --use-precision-aware-optimizer --optimizer sgd", "only supported with adam"),
])
def test_megatrons_optimizer_config_checks_run_too(extra, says):
    """What Megatron asserts only when it builds the optimizer (its OptimizerConfig, built from the
    arguments as its training loop builds it) is an error in the same pass, not a pass."""
    res = _validate(script("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 "
                           "--global-batch-size 64", extra))
    assert not res["valid"]
    refused = [e for e in res["errors"] if e["code"] == "megatron_validate_args"]
    assert refused and "optimizer config" in refused[0]["message"] and says in refused[0]["message"], res["errors"]


def test_the_precision_aware_optimizer_in_a_script_is_costed_as_planned():
    base = "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 64 " \
           "--use-distributed-optimizer"
    plain = _validate(script(base))
    aware = _validate(script(base, "--use-precision-aware-optimizer"))
    offloaded = _validate(script(base, "--use-precision-aware-optimizer --optimizer-cpu-offload"))
    assert aware["valid"] and offloaded["valid"], (aware["errors"], offloaded["errors"])
    # Transformer Engine's FusedAdam is not installed here: its absence is the job's Python's matter
    assert plain["predicted_peak_gib"] > aware["predicted_peak_gib"] > offloaded["predicted_peak_gib"]


# ---- what real scripts write that is not an error of theirs ----------------------------------
SMALL_TEXT = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --max-position-embeddings 2048 "
         "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-4 --lr-warmup-iters 2 "
         "--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data ")


def test_encoder_seq_length_is_the_sequence_length_as_megatron_reads_it():
    res = call("validate", {"args": (SMALL_TEXT + "--bf16 --encoder-seq-length 512").split(), "num_gpus": 1})["result"]
    assert res["valid"], res["errors"]
    assert res["layout"]["seq_length"] == 512 and "seq_length" not in res["assumed"]
    # a T5 script gives the encoder's layers, no --num-layers: Megatron reads them as the layers
    t5 = SMALL_TEXT.replace("--num-layers 4", "--encoder-num-layers 6 --decoder-num-layers 6")
    res = call("validate", {"args": (t5 + "--bf16 --seq-length 512").split(), "num_gpus": 1})["result"]
    assert res["layout"]["seq_length"] == 512 and "incomplete" not in [w["code"] for w in res["warnings"]], res


def test_a_value_the_script_leaves_to_the_job_is_a_warning_not_a_bad_value():
    text = ("#!/bin/bash\nTP=$(python -c 'print(2)')\n"
            f"torchrun --nproc-per-node 8 pretrain_gpt.py {SMALL_TEXT} --seq-length 2048 --bf16 --seed $SEED "
            "--tensor-model-parallel-size $TP\n")
    res = call("validate", {"script_text": text, "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}})["result"]
    errors, warnings = _codes(res)
    assert "bad_value" not in errors and "stray_arguments" not in errors, res["errors"]
    unresolved = [w["message"] for w in res["warnings"] if w["code"] == "unresolved_value"]
    assert any(m.startswith("--seed $SEED") for m in unresolved) and any("--tensor-model-parallel-size $TP" in m
                                                                          for m in unresolved), unresolved
    # a literal that is not a number stays an error
    bad = call("validate", {"args": (SMALL_TEXT + "--seq-length 2048 --bf16 --seed x").split(), "num_gpus": 1})["result"]
    assert "bad_value" in _codes(bad)[0]


def test_an_old_flag_another_entry_defines_is_a_warning_there_and_an_error_for_pretrain_gpt():
    line = f"{SMALL_TEXT} --seq-length 2048 --bf16 --use-te\n"
    other = call("validate", {"script_text": f"torchrun --nproc-per-node 1 examples/multimodal/train.py {line}"})
    gpt = call("validate", {"script_text": f"torchrun --nproc-per-node 1 pretrain_gpt.py {line}"})
    assert "obsolete_flag" in _codes(other["result"])[1] and "obsolete_flag" not in _codes(other["result"])[0]
    assert "obsolete_flag" in _codes(gpt["result"])[0]


def test_a_templates_placeholder_is_named_as_one():
    text = ('#!/bin/bash\nWORKSPACE="<some dir>"\n'
            f"torchrun --nproc-per-node 1 pretrain_gpt.py {SMALL_TEXT} --seq-length 2048 --bf16 --save ${{WORKSPACE}}/ck\n")
    res = call("validate", {"script_text": text})["result"]
    errors, warnings = _codes(res)
    assert "stray_arguments" not in errors and "placeholder" in warnings, res["errors"]


@pytest.mark.parametrize("directive", ["#SBATCH -N 2", "#SBATCH -N2", "#SBATCH --nodes=2", "#SBATCH --nodes 2"])
def test_sbatch_node_counts_in_every_spelling(directive):
    text = (f"#!/bin/bash\n{directive}\n#SBATCH --ntasks-per-node=8\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n"
            f"srun python pretrain_gpt.py {SMALL_TEXT} --seq-length 2048 --bf16 --tensor-model-parallel-size 2 "
            "--pipeline-model-parallel-size 8\n")
    res = call("validate", {"script_text": text})["result"]
    assert res["world_size"] == 16 and "world_size" not in _codes(res)[0], res["errors"]


def test_fp16_is_costed_as_bf16_and_fp32_is_said_and_not_costed():
    def run(precision):
        return call("validate", {"args": (SMALL_TEXT + "--seq-length 2048 " + precision).split(), "num_gpus": 1,
                                 "gpu": "h100-sxm"})["result"]

    fp16, bf16, fp32 = run("--fp16"), run("--bf16"), run("")
    assert fp16["predicted_peak_gib"] == bf16["predicted_peak_gib"] and "fp16" in fp16["assumed"]["precision"]
    assert fp32["predicted_peak_gib"] is None and "fp32" in fp32["memory"]["skipped"]
    assert "fp32_training" in _codes(fp32)[1] and "fp32_training" not in _codes(bf16)[1]


def test_a_negative_size_is_an_error_and_a_zero_a_warning():
    rest = SMALL_TEXT.replace("--num-layers 4 ", "") + "--seq-length 2048 --bf16 "
    negative = call("validate", {"args": ("--num-layers -4 " + rest).split(), "num_gpus": 1})["result"]
    zero = call("validate", {"args": ("--num-layers 0 " + rest).split(), "num_gpus": 1})["result"]
    assert not negative["valid"] and "model_out_of_range" in _codes(negative)[0]
    assert "model_out_of_range" in _codes(zero)[1] and "model_out_of_range" not in _codes(zero)[0]


def test_the_router_is_read_as_the_script_sets_it():
    """Llama 4's top-1 routing over sigmoid scores (NVIDIA's modelopt config): Megatron's rule for
    top-1 over renormalised softmax scores does not apply; the same script with softmax scores breaks it."""
    moe = (SMALL_TEXT + "--seq-length 2048 --bf16 --num-experts 16 --moe-router-topk 1 --moe-grouped-gemm "
           "--moe-router-score-function {f} --moe-token-dispatcher-type alltoall")
    sigmoid = call("validate", {"args": (moe.format(f="sigmoid")).split(), "num_gpus": 1})["result"]
    softmax = call("validate", {"args": (moe.format(f="softmax")).split(), "num_gpus": 1})["result"]
    assert "bad_model" not in _codes(sigmoid)[0], sigmoid["errors"]
    assert "bad_model" in _codes(softmax)[0]


def test_a_fragment_or_another_tool_is_not_held_to_pretrain_gpts_flags():
    """A file that only defines flags (its entry not known) and a launch of a tool of its own
    (a checkpoint converter with positional arguments): what pretrain_gpt.py would refuse is a
    warning there; the same words on pretrain_gpt.py stay errors."""
    conf = 'OPTS="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --model-temperature 0.7"\n'
    fragment = call("validate", {"script_text": conf})["result"]
    assert "unknown_flag" in _codes(fragment)[1] and "unknown_flag" not in _codes(fragment)[0]
    tool = "python tools/checkpoint/checkpoint_inspector.py convert --swiglu in_dir out_dir\n"
    other = call("validate", {"script_text": tool})["result"]
    gpt = call("validate", {"script_text": tool.replace("tools/checkpoint/checkpoint_inspector.py convert",
                                                        "pretrain_gpt.py")})["result"]
    assert "stray_arguments" in _codes(other)[1] and "stray_arguments" not in _codes(other)[0]
    assert "stray_arguments" in _codes(gpt)[0]


def test_the_review_of_the_mends_each_stays_mended():
    """What an independent review found in the first versions of the mends above: a literal with a
    dollar sign and a literal after an expansion are still checked; Megatron's own Mamba entry
    refuses old flags; a comment's "<...>" hides no stray word; router flags on a dense model keep
    the memory check; precision flags in an unexpanded variable are not fp32; the last #SBATCH line
    of an option counts, and a short option's attached value is read whole."""
    head = "#!/bin/bash\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    run = f"torchrun --nproc-per-node 1 pretrain_gpt.py {SMALL_TEXT} --seq-length 2048 "

    def check(text, **extra):
        return call("validate", {"script_text": head + text, **extra})["result"]

    assert "bad_value" in _codes(check(run + "--bf16 --lr '3e-4$'\n"))[0]
    assert "bad_value" in _codes(check(run + "--bf16 --lr $LR --lr 3e-4x\n"))[0]
    mamba = check(run.replace("pretrain_gpt.py", "pretrain_mamba.py") + "--bf16 --use-te\n")
    assert "obsolete_flag" in _codes(mamba)[0]
    assert "stray_arguments" in _codes(check("# MBS: <1 or 2> per GPU\n" + run + "--bf16 --micro-batch-size 1 2\n"))[0]
    dense = check(run + "--bf16 --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5\n",
                  gpu="h100-sxm")
    assert dense["predicted_peak_gib"] is not None and "bad_model" not in _codes(dense)[1]
    variable = check(run + "${PRECISION_ARGS}\n", gpu="h100-sxm")
    assert "fp32_training" not in _codes(variable)[1] and variable["predicted_peak_gib"] is not None
    sbatch = check("#SBATCH -N 1\n#SBATCH -N 2\n#SBATCH -t01:00:00\n#SBATCH --ntasks-per-node=8\n" +
                   run.replace("torchrun --nproc-per-node 1", "srun python") + "--bf16\n")
    assert sbatch["world_size"] == 16 and sbatch["script"]["sbatch"]["time"] == "01:00:00"
