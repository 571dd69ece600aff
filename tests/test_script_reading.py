"""validate on launch scripts as people write them: the shell constructs of real launch scripts,
in fixtures of our own (arrays of quoted pairs, if/else on FP8, an entry in a variable, bash -c
strings, heredocs to sbatch, sourced configuration, functions), read the way bash reads them and
never run."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from conftest import ROOT

from megatron_skill.adapter import shell
from megatron_skill.contract import call
from megatron_skill.errors import ToolError

MODEL = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
    --max-position-embeddings 8192 --position-embedding-type rope --swiglu --normalization RMSNorm
    --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256
    --tokenizer-type NullTokenizer --mock-data"""


def _validate(text: str, **extra) -> dict:
    env = call("validate", {"script_text": text, **extra})
    assert env["ok"], env
    return env["result"]


def _args(text: str, **kw) -> list[list[str]]:
    """The argument vector of every launch, one per way through the script."""
    return [la.args for p in shell.read(textwrap.dedent(text), **kw).paths for la in p.launches]


def test_quoted_array_items_stay_one_word_and_unquoted_ones_split():
    text = """
    A=("--fp8-format hybrid" --bf16)
    python pretrain_gpt.py "${A[@]}"
    python pretrain_gpt.py ${A[@]}
    python pretrain_gpt.py "${A[*]}"
    """
    quoted, unquoted, star = [la.args for la in shell.read(textwrap.dedent(text)).paths[0].launches]
    assert quoted == ["--fp8-format hybrid", "--bf16"]
    assert unquoted == ["--fp8-format", "hybrid", "--bf16"]
    assert star == ["--fp8-format hybrid --bf16"]


def test_parameter_expansion_defaults_arithmetic_and_positional_arguments():
    text = """
    TP=${TP:-2}
    : ${PP:=4}
    NODES=$(( ${NNODES:-2} * 8 ))
    CKPT=${1:-ckpt/default}
    NAME=${CKPT##*/}
    python pretrain_gpt.py --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \\
        --world $NODES --save "$CKPT" --name ${NAME%.pt} --n ${#NAME}
    """
    assert _args(text) == [["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4", "--world",
                            "16", "--save", "ckpt/default", "--name", "default", "--n", "7"]]
    assert _args(text, env={"TP": "8"}, positional=("runs/x.pt",))[0][:2] == ["--tensor-model-parallel-size", "8"]
    assert _args(text, positional=("runs/x.pt",))[0][-4:] == ["--name", "x", "--n", "4"]


def test_an_undecided_condition_is_followed_both_ways_and_labelled():
    text = """
    if [[ "${FP8:-0}" == 1 ]]; then
      PREC=(--fp8-format hybrid --fp8-recipe tensorwise)
    else
      PREC=(--bf16)
    fi
    if python -c 'import transformer_engine' 2>/dev/null; then IMPL=transformer_engine; else IMPL=local; fi
    torchrun --nproc-per-node 8 pretrain_gpt.py "${PREC[@]}" --transformer-impl $IMPL
    """
    reading = shell.read(textwrap.dedent(text))
    vectors = [la.args for p in reading.paths for la in p.launches]
    assert vectors == [["--bf16", "--transformer-impl", "transformer_engine"],
                       ["--bf16", "--transformer-impl", "local"]]   # FP8 unset: its default decides
    assert [len(p.choices) for p in reading.paths] == [1, 1]
    assert "import transformer_engine" in reading.paths[0].choices[0]
    both = shell.read(textwrap.dedent(text).replace("${FP8:-0}", "$FP8"))
    assert len(both.paths) == 4   # FP8 comes from the caller: both of its ways too
    assert _args(text, env={"FP8": "1"})[0][:2] == ["--fp8-format", "hybrid"]


def test_case_functions_and_loops():
    text = """
    launch() { local size=$1; shift; torchrun --nproc-per-node "$size" pretrain_gpt.py "$@"; }
    case "${MODEL:-8b}" in
      8b) LAYERS=32 ;;
      70b) LAYERS=80 ;;
      *) echo unknown; exit 1 ;;
    esac
    EXTRA=()
    for flag in --bf16 --use-distributed-optimizer; do EXTRA+=("$flag"); done
    launch 8 --num-layers $LAYERS "${EXTRA[@]}"
    """
    assert _args(text) == [["--num-layers", "32", "--bf16", "--use-distributed-optimizer"]]
    assert _args(text, env={"MODEL": "70b"})[0][1] == "80"
    assert _args(text, env={"MODEL": "405b"}) == []


def test_bash_c_strings_heredocs_to_sbatch_and_sourced_files(tmp_path):
    conf = tmp_path / "model.conf.sh"
    conf.write_text("MODEL_ARGS=(--num-layers 16 --hidden-size 2048)\n")
    text = """
    source "$(dirname "$0")/model.conf.sh"
    CMD="python pretrain_gpt.py ${MODEL_ARGS[@]} --bf16"
    sbatch <<EOF
    #!/bin/bash
    #SBATCH --nodes=4
    #SBATCH --gpus-per-node=8
    srun --ntasks-per-node=8 bash -c "$CMD --seed \\$SLURM_PROCID"
    EOF
    """
    script = tmp_path / "launch.sh"
    script.write_text(textwrap.dedent(text))
    launches = [la for p in shell.read(script.read_text(), script_path=script).paths for la in p.launches]
    assert len(launches) == 1
    la = launches[0]
    assert la.args[:5] == ["--num-layers", "16", "--hidden-size", "2048", "--bf16"]
    assert la.sbatch["nodes"] == "4" and "heredoc" in la.where
    res = call("validate", {"script": str(script)})["result"]
    assert res["world_size"] == 32, res["script"]   # 4 nodes x 8 tasks under srun


def test_module_entries_and_entry_paths_in_variables():
    text = """
    PRETRAIN_SCRIPT_PATH="pretrain_gpt.py"
    if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then echo "run from Megatron-LM"; exit 1; fi
    uv run python -m torch.distributed.run --nproc-per-node 4 -m megatron_recipes.train_gpt --num-layers 2
    torchrun --nproc-per-node 8 "$PRETRAIN_SCRIPT_PATH" --num-layers 4
    """
    reading = shell.read(textwrap.dedent(text))
    ran = [p for p in reading.paths if p.launches]
    assert len(reading.paths) == 2 and len(ran) == 1   # the file check: one way exits
    assert [la.entry for la in ran[0].launches] == ["megatron_recipes.train_gpt", "pretrain_gpt.py"]


def test_nothing_in_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    text = f"""
    touch {marker}
    X=$(touch {marker}; echo 3)
    echo hi > {marker}
    python -c 'open("{marker}", "w")'
    torchrun --nproc-per-node $X pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4
    """
    res = _validate(textwrap.dedent(text))
    assert not marker.exists()
    assert res["num_megatron_args"] == 6


# ---- validate on the patterns of NVIDIA's example scripts, in fixtures of our own -------
LLAMA_FP8 = f"""#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=${{CUDA_DEVICE_MAX_CONNECTIONS:-1}}
CHECKPOINT_PATH=${{1:-"checkpoints/llama"}}
PRETRAIN_SCRIPT_PATH="pretrain_gpt.py"
DTYPE=${{DTYPE:-fp8}}
MODEL_ARGS=(
    --use-mcore-models
    {MODEL}
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 100 --lr 1.5e-4
    --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid"
        "--fp8-amax-history-len 1024"
        "--fp8-param-gather"
    )
fi
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --sequence-parallel)
if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Error: pretrain_gpt.py not found"; exit 1
fi
torchrun --nproc_per_node 8 --nnodes 1 \\
    "$PRETRAIN_SCRIPT_PATH" \\
    ${{MODEL_ARGS[@]}} \\
    ${{TRAINING_ARGS[@]}} \\
    ${{DTYPE_ARGS[@]}} \\
    ${{PARALLEL_ARGS[@]}} --save "$CHECKPOINT_PATH" --save-interval 1000
"""


def test_an_fp8_script_with_arrays_of_quoted_pairs_has_no_false_error():
    res = _validate(LLAMA_FP8, gpu="h100-sxm")
    assert res["valid"], res["errors"]
    assert res["layout"]["precision"] == "fp8" and res["world_size"] == 8
    assert res["memory"]["peak_gib"] < 79.6   # FP8 params, bf16 gradients, fused CE: fits an H100
    warned = {w["code"] for w in res["warnings"]}
    assert "obsolete_flag" in warned   # --use-mcore-models: ignored by 0.19, so a warning
    assert res["script"]["paths_without_launch"], res["script"]   # the exit when the entry is missing


def test_a_bf16_branch_chosen_by_the_environment():
    res = _validate(LLAMA_FP8, env={"DTYPE": "bf16"}, gpu="h100-sxm")
    assert res["layout"]["precision"] == "bf16"


def test_a_quoted_value_split_by_an_unquoted_expansion_is_found():
    text = LLAMA_FP8.replace("--lr 1.5e-4", '--lr 1.5e-4 --step-batch-size-schedule "0:16 1B:64 2B:128"')
    res = _validate(text, gpu="h100-sxm")
    stray = [e for e in res["errors"] if e["code"] == "stray_arguments"]
    assert stray and "1B:64 2B:128" in stray[0]["message"] and '"${ARGS[@]}"' in stray[0]["fix"]
    quoted = text.replace("${TRAINING_ARGS[@]}", '"${TRAINING_ARGS[@]}"')
    res = _validate(quoted, gpu="h100-sxm")
    assert [e["code"] for e in res["errors"]] == ["megatron_validate_args"]
    assert "--step-batch-size-schedule and --global-batch-size" in res["errors"][0]["message"]


def test_findings_of_one_branch_name_it():
    text = LLAMA_FP8.replace('DTYPE=${DTYPE:-fp8}', 'DTYPE=$DTYPE').replace(
        "PARALLEL_ARGS=(--tensor-model-parallel-size 1 --sequence-parallel)",
        "PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel)")
    res = _validate(text, gpu="a100-80gb")
    fp8 = [e for e in res["errors"] if e["code"] == "fp8_arch"]
    assert len(fp8) == 1 and fp8[0]["paths"] and "fp8" in fp8[0]["paths"][0], res["errors"]
    assert len(res["launches"]) == 2 and [la["valid"] for la in res["launches"]].count(False) >= 1


def test_sbatch_heredoc_with_srun_bash_c_and_placeholders():
    text = """#!/bin/bash
MEGATRON_PATH=${MEGATRON_PATH:-"your_megatron_path"}
ARGS=(
  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096
  --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 256 --bf16
  --use-mcore-models --use-flash-attn
)
CMD="cd ${MEGATRON_PATH}; export PYTHONPATH=${MEGATRON_PATH}:${PYTHONPATH}; python ${MEGATRON_PATH}/pretrain_gpt.py ${ARGS[@]}"
sbatch <<EOF
#!/bin/bash
#SBATCH --nodes=your_num_nodes
srun --container-image=img bash -c "${CMD}"
EOF
"""
    res = _validate(text, num_gpus=32, gpu="h100-sxm")
    assert res["valid"], res["errors"]
    assert not any(e["code"] == "unknown_flag" for e in res["errors"] + res["warnings"])
    assert {w["message"].split()[0] for w in res["warnings"] if w["code"] == "obsolete_flag"} == \
        {"--use-mcore-models", "--use-flash-attn"}
    assert res["fixed_args"]["valid"] and "--use-flash-attn" not in res["fixed_args"]["args"]


def test_scripts_that_run_no_training_entry_are_told_so_plainly(tmp_path):
    loop = call("validate", {"script_text": "#!/bin/bash\ntorchrun --nproc-per-node 2 examples/run_simple_loop.py\n"})
    assert loop["error"]["code"] == "invalid_script" and "receives no Megatron flags" in loop["error"]["message"]
    caller = call("validate", {"script_text": "python -u $DIR/pretrain_gpt.py ${MEGATRON_PARAMS}\n"})
    assert "MEGATRON_PARAMS" in caller["error"]["message"] and "env" in caller["error"]["fix"]
    # a template's placeholder is the script's error to fix, and the rest of it is still read
    placeholder = call("validate", {"script_text": "DATA=<PATH_TO_DATA>\npython pretrain_gpt.py --data-path $DATA\n"})
    found = placeholder["result"]["errors"][0]
    assert found["code"] == "unfilled_placeholder" and "<PATH_TO_DATA>" in found["message"], placeholder
    inference = _validate("export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
                          "torchrun --nproc-per-node 8 tools/run_text_generation_server.py --num-layers 32 "
                          "--hidden-size 4096 --num-attention-heads 32 --tensor-model-parallel-size 8 --port 5000\n",
                          gpu="h100-sxm")
    assert inference["valid"] and "skipped" in inference["memory"]   # its own --port: a warning only
    assert [w["code"] for w in inference["warnings"]] == ["unknown_flag"]


def test_a_configuration_file_of_flag_variables_is_checked_as_flags():
    conf = 'MODEL_ARGS=" --num-layers 32 --hidden-size 4096 --fp8-hybrid"\nTRAIN_ARGS=(--bf16 --lr 1e-4)\n'
    res = _validate(conf)
    assert res["script"]["variables"] == ["MODEL_ARGS", "TRAIN_ARGS"]
    assert [e["code"] for e in res["errors"]] == ["obsolete_flag"]
    assert "no_launch" in {w["code"] for w in res["warnings"]}


def test_the_planning_only_install_says_megatron_checks_were_skipped():
    """Without megatron-core (made unimportable, as on the planning-only install) the answer is
    not a plain valid: it says how far it checked, and the skill's copy of Megatron's combination
    rules still applies."""
    code = ("import sys, json; [sys.modules.__setitem__(m, None) for m in ('torch', 'megatron', 'megatron.core', "
            "'megatron.training')]; sys.path.insert(0, sys.argv[1]);"
            "from megatron_skill.contract import call;"
            "print(json.dumps(call('validate', {'args': json.loads(sys.argv[2]), 'num_gpus': 8})))")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--use-distributed-optimizer", "--optimizer-cpu-offload"]
    import json
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools"), json.dumps(argv)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MEGATRON_SKILL_CACHE": "/nonexistent"})
    res = json.loads(proc.stdout.strip().splitlines()[-1])["result"]
    assert "skipped" in res["checks"]["megatron"]
    assert "megatron_checks_skipped" in {w["code"] for w in res["warnings"]}
    assert [e["code"] for e in res["errors"]] == ["optimizer_cpu_offload_needs_precision_aware"]
    fixed = call("validate", {"args": argv + ["--use-precision-aware-optimizer"], "num_gpus": 8})["result"]
    assert fixed["valid"] and "validate_args ran" in fixed["checks"]["megatron"]


@pytest.mark.parametrize("combo", ["tp_comm_overlap_needs_sp", "fp8_param_gather_needs_distopt",
                                   "overlap_param_gather_needs_distopt", "overlap_param_gather_needs_grad_reduce",
                                   "optimizer_cpu_offload_needs_precision_aware", "fp4_and_fp8"])
def test_each_combination_rule_is_one_megatron_itself_refuses(combo):
    """The skill's copies of validate_args' asserts (for the planning-only install) are Megatron's:
    the same vector, given to Megatron 0.19.2's own parser and validate_args, is refused."""
    from megatron_skill.adapter import parser as megatron_parser
    from megatron_skill.errors import ToolError

    vectors = {
        "tp_comm_overlap_needs_sp": ["--tensor-model-parallel-size", "2", "--tp-comm-overlap"],
        "fp8_param_gather_needs_distopt": ["--fp8-format", "hybrid", "--fp8-param-gather"],
        "overlap_param_gather_needs_distopt": ["--overlap-grad-reduce", "--overlap-param-gather"],
        "overlap_param_gather_needs_grad_reduce": ["--use-distributed-optimizer", "--overlap-param-gather"],
        "optimizer_cpu_offload_needs_precision_aware": ["--use-distributed-optimizer", "--optimizer-cpu-offload"],
        "fp4_and_fp8": ["--fp8-format", "hybrid", "--fp4-format", "e2m1"],
    }
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            *vectors[combo]]
    res = call("validate", {"args": argv, "num_gpus": 8})["result"]
    assert combo in [e["code"] for e in res["errors"]]
    with pytest.raises(ToolError):
        megatron_parser.parse(argv, world_size=8)


def test_a_command_string_with_a_variable_left_to_the_caller_still_launches():
    """X=$Y leaves X unknown; a longer string holding $Y keeps the rest (the launch in it)."""
    text = """
    A=(--num-layers 2)
    CMD="cd ${MP}; export PYTHONPATH=${MP}:${PYTHONPATH}; python ${MP}/pretrain_gpt.py ${A[@]}"
    bash -c "${CMD}"
    COPY=$UNSET_BY_SCRIPT
    if [ "$COPY" = "1" ]; then torchrun pretrain_gpt.py --num-layers 4; fi
    """
    reading = shell.read(textwrap.dedent(text))
    vectors = [la.args for p in reading.paths for la in p.launches]
    assert ["--num-layers", "2"] in vectors and ["--num-layers", "2", "--num-layers", "4"] not in vectors
    assert len(reading.paths) == 2   # COPY is as unknown as what it copies: both ways


# ---- the parser under the reader: shfmt's syntax tree

def test_an_array_item_that_starts_with_a_bracket_is_one_word_as_bash_reads_it():
    # NVIDIA's DeepSeek-V3 example (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh): shfmt alone
    # refuses `[0]*3+[1]*58` in an array ("`[x]` must be followed by `=`"); bash takes it as a word.
    text = """
    MOE_ARGS=(
        --num-experts 256
        --moe-layer-freq [0]*3+[1]*58
        --moe-router-topk 8
    )
    torchrun --nproc-per-node 8 pretrain_gpt.py ${MOE_ARGS[@]} --seq-length 4096
    """
    assert _args(text) == [["--num-experts", "256", "--moe-layer-freq", "[0]*3+[1]*58", "--moe-router-topk", "8",
                            "--seq-length", "4096"]]
    # An index written as bash writes one still is one.
    assert _args("A=([1]=--bf16 [0]=--fp16)\npython pretrain_gpt.py \"${A[@]}\"\n") == [["--fp16", "--bf16"]]


def test_a_heredoc_with_more_on_its_line_is_read(tmp_path):
    # render writes `if ! python - <<'PY'; then` (the TE check); bash reads the heredoc's body from the
    # next line and goes on with `; then` on the first.
    text = """
    if ! python - <<'PY' 2>/dev/null; then
    import transformer_engine
    PY
        echo "Transformer Engine does not import"; exit 1
    fi
    torchrun --nproc-per-node 8 pretrain_gpt.py --transformer-impl transformer_engine
    """
    reading = shell.read(textwrap.dedent(text))
    assert [p.ended for p in reading.paths] == ["exit at line 5", None]
    assert reading.paths[1].launches[0].args == ["--transformer-impl", "transformer_engine"]
    assert reading.paths[1].launches[0].where == "line 7"
    assert reading.paths[0].choices == ["if at line 2: `! python - <<'PY' 2>/dev/null` true"]


def test_shell_syntax_errors_name_their_line_and_an_oversized_text_is_refused(tmp_path):
    with pytest.raises(shell.ShellSyntax) as e:
        shell.read("python pretrain_gpt.py \\\n  --save '/x\n")
    assert e.value.line == 2
    with pytest.raises(shell.ScriptTooLarge):
        shell.read("echo " + "a " * shell.MAX_PARSE_BYTES)
    with pytest.raises(shell.ScriptTooLarge, match="syntax tree would take"):   # 400 KB, 300,000 words
        shell.read("X=1\n" * 100_000)
    big = tmp_path / "big.sh"
    big.write_text("X=1\n" * 100_000 + "python pretrain_gpt.py --num-layers 2\n")
    res = call("validate", {"script": str(big)})
    assert not res["ok"] and res["error"]["code"] == "invalid_script", res
    assert "syntax tree would take" in res["error"]["message"] and "kilobytes" in res["error"]["fix"]


def test_without_shfmt_validate_answers_one_json_environment_error(tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n")
    env = {**os.environ, shell.SHFMT_ENV: str(tmp_path / "no-such-shfmt")}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "validate", "--script", str(script)],
                          env=env, capture_output=True, text=True, timeout=300)
    answer = json.loads(proc.stdout)
    assert proc.returncode == 5 and answer["error"]["code"] == "environment", (proc.returncode, proc.stdout)
    assert "pip install shfmt-py" in answer["error"]["fix"] and "Traceback" not in proc.stderr


def test_a_script_nested_deeper_than_the_reader_follows_is_refused_plainly():
    # shfmt stops at its own depth limit; a tree deeper than Python's JSON reader or the evaluator
    # recurses is refused the same way (never a RecursionError).
    for text in ("python pretrain_gpt.py " + "$(" * 3000 + "echo 1" + ")" * 3000,
                 "if true; then " * 2000 + "python pretrain_gpt.py" + "; fi" * 2000,
                 "X=$((" + "(" * 3000 + "1" + ")" * 3000 + "))"):
        with pytest.raises(shell.ScriptTooLarge, match="nested too deeply|nests commands deeper"):
            shell.read(text + "\n")
    assert _args("if true; then " * 60 + "python pretrain_gpt.py --bf16" + "; fi" * 60 + "\n") == [["--bf16"]]


def _fake_shfmt(tmp_path, body: str) -> str:
    path = tmp_path / "shfmt"
    path.write_text("#!/bin/sh\ncat >/dev/null\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_parser_that_answers_no_syntax_tree_is_an_environment_error(tmp_path, monkeypatch):
    # Not JSON, not UTF-8, or JSON that is not shfmt's File node: the binary is not the parser we read
    # (an internal error, a bug of ours, before).
    for answer in ("echo 'not json {'", "printf '\\377\\376{'", "echo '[1, 2]'"):
        monkeypatch.setenv(shell.SHFMT_ENV, _fake_shfmt(tmp_path, answer))
        with pytest.raises(ToolError, match="something other than a syntax tree") as e:
            shell.read("python pretrain_gpt.py --bf16\n")
        assert e.value.code == "environment"


def test_a_parser_that_hangs_is_ended_with_its_children(tmp_path, monkeypatch):
    # A wrapper script whose child keeps the pipe open: killing the script alone left the read waiting
    # on the child (and the child running).
    monkeypatch.setenv(shell.SHFMT_ENV, _fake_shfmt(tmp_path, "sleep 60\ntrue"))
    monkeypatch.setattr(shell, "SHFMT_TIMEOUT_S", 1)
    start = time.monotonic()
    with pytest.raises(ToolError, match="did not answer within 1 s"):
        shell.read("python pretrain_gpt.py --bf16\n")
    assert time.monotonic() - start < 20


def test_the_parsers_answer_and_memory_are_bounded_where_the_estimate_misses(monkeypatch):
    # A chain `a && a && ...` nests one level per operator in shfmt's tree; the scan's estimate sees a
    # flat line (2,000 of them: 10 KB, 6.6 MB estimated, 427 MB of JSON and 1.8 GB in shfmt).
    chain = " && ".join(["a"] * 200) + "\n"
    assert shell._json_estimate(chain.encode()) < 2 << 20
    monkeypatch.setattr(shell, "MAX_JSON_BYTES", 2 << 20)     # its JSON is about 4 MB
    with pytest.raises(shell.ScriptTooLarge, match="more than 2 MiB"):
        shell.parse(chain)
    monkeypatch.undo()
    assert shell.parse(chain)["Type"] == "File"
    monkeypatch.setattr(shell, "SHFMT_MEMORY_BYTES", 1 << 30)   # shfmt alone reserves about 650 MB
    with pytest.raises(shell.ScriptTooLarge, match="memory in the parser"):
        shell.parse(" && ".join(["a"] * 2000) + "\n")


def test_a_slice_of_an_array_or_of_the_arguments_takes_items_not_characters():
    # "${ARGS[@]:1}" (every flag but the first) cut one character off each item: --num-layers became
    # -num-layers and 4 an empty word. As bash: items from the offset (from the end when negative),
    # ${@:0} starting at $0, an empty slice no word, a negative length (which bash refuses) unknown.
    text = """
    ARGS=(--x --num-layers 4 --bf16)
    python pretrain_gpt.py "${ARGS[@]:1}" / "${ARGS[@]:1:2}" / ${ARGS[*]:2} / "${ARGS[*]: -2}" / "${ARGS[@]:9}" /
    python pretrain_gpt.py "${@:0}" / "${@: -1}" / "${@:1:2}" / "$*" / "${*:2}" / "${ARGS[1]:2}"
    """
    assert _args(text, positional=("a", "b", "c")) == [
        ["--num-layers", "4", "--bf16", "/", "--num-layers", "4", "/", "4", "--bf16", "/", "4 --bf16", "/", "/"],
        ["script.sh", "a", "b", "c", "/", "c", "/", "a", "b", "/", "a b c", "/", "b c", "/", "num-layers"]]


def test_a_case_item_that_falls_through_runs_the_next_body_as_bash_does():
    # ;& runs the next item's body without testing it; ;;& goes on testing the items after it. Both
    # stopped at the first match before. An unknown subject's way through an item falls through too.
    text = """
    L= N= P= Q=
    case "$MODE" in
      big) L=--num-layers ;&
      small) N=4 ;;
      fp8) P=--fp8-format ;;&
      *) Q=--bf16 ;;
    esac
    python pretrain_gpt.py $L $N $P $Q
    """
    assert _args(text, env={"MODE": "big"}) == [["--num-layers", "4"]]
    assert _args(text, env={"MODE": "fp8"}) == [["--fp8-format", "--bf16"]]
    assert _args(text, env={"MODE": "small"}) == [["4"]]
    assert _args(text)[0] == ["--num-layers", "4"]


def test_appending_to_an_unset_array_and_an_array_with_gaps_add_no_empty_words():
    # ARGS+=(--bf16) with ARGS never set gave ("", "--bf16"): an empty word before the flag (the old
    # reader had it right). [5]=z after three items left two empty words for the unset 3 and 4.
    text = """
    ARGS+=(--bf16)
    ARGS+=(--num-layers 4)
    GAPS=(--a [0]*3 --b [5]=--c --d)
    python pretrain_gpt.py "${ARGS[@]}" / "${GAPS[@]}"
    """
    assert _args(text) == [["--bf16", "--num-layers", "4", "/", "--a", "[0]*3", "--b", "--c", "--d"]]
    # [1]=--bf16 [0]=--fp16 --x: --x goes to index 1, over --bf16 (as bash does)
    assert _args("A=([1]=--bf16 [0]=--fp16 --x)\npython pretrain_gpt.py \"${A[@]}\"\n") == [["--fp16", "--x"]]


def test_no_temporary_folder_is_an_environment_error(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    with pytest.raises(ToolError, match="temporary file") as e:
        shell.read("python pretrain_gpt.py --bf16\n")
    assert e.value.code == "environment"


def test_a_value_left_as_written_shows_no_backslash_of_the_bracket_retry():
    # The '[' retry parses a text with a backslash inserted; a value the reader cannot know is shown
    # as the script wrote it, not as the retry rewrote it.
    assert _args('A=( [0]*3 )\npython pretrain_gpt.py "${A[@]}" --x "$(B=( [1] [2] ); foo)"\n') == [
        ["[0]*3", "--x", "$(B=( [1] [2] ); foo)"]]
