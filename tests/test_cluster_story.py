"""One request, end to end, as an agent following SKILL.md meets it: "16 nodes x 8 H100 under Slurm
with Pyxis/enroot, the NGC container, continue pre-training Qwen2.5-14B from its Hugging Face
checkpoint at sequence 8192, ~4M tokens per step, FP8 if it helps". The Hugging Face folder lies on
the cluster; here there is only a copy of its config.json (tests/fixtures/hf/qwen2.5-14b).

The agent plans from that config in BF16 and FP8, takes FP8 where it is predicted faster, and
renders the plan's first layout for Slurm in Pyxis with the import as part of the job. Nothing of
what render writes is edited afterwards: Megatron's parser, validate, shellcheck, sbatch --test-only
on the test Slurm and enroot's image grammar read the files as written, and the job's own
environment check runs under this machine's .venv, which has no Transformer Engine, as a container
without TE would: it must stop before training, with exit 5 and the line that says so."""
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from test_images import ENROOT_URI
from test_render import _shellcheck

from megatron_skill.adapter import parser as megatron_parser
from megatron_skill.contract import call

HF_CONFIG = ROOT / "tests" / "fixtures" / "hf" / "qwen2.5-14b"
CLUSTER = "/shared"  # the cluster's shared file system, as its nodes see it
NUM_GPUS, SEQ = 16 * 8, 8192
GBS = 4 * 1024 * 1024 // SEQ  # ~4M tokens per step: 512 sequences of 8192


def _places(root: str) -> dict:
    return {"hf_model": f"{root}/models/Qwen2.5-14B", "output": f"{root}/ckpt/qwen2.5-14b",
            "data": f"{root}/data/qwen-corpus_text_document"}


def _plan(precision: str) -> dict:
    env = call("plan", {"hf_config": str(HF_CONFIG), "gpu": "h100-sxm", "num_gpus": NUM_GPUS, "seq_length": SEQ,
                        "global_batch_size": GBS, "precision": precision, "top": 3})
    assert env["ok"], env
    return env


def _render(plan: dict, root: str, output_dir: Path, **extra) -> dict:
    """What the agent asks render for, as instructions.md sections 4 and 12 say: the plan's answer,
    Slurm in Pyxis (NVIDIA's PyTorch image, the default), the Hugging Face folder on the cluster as
    import_hf, the data by its prefix there; the learning rate and schedule left to render."""
    places = _places(root)
    env = call("render", {"plan": plan, "launcher": "slurm", "container": {"runtime": "pyxis"},
                          "import_hf": {"hf_model": places["hf_model"], "output": places["output"]},
                          "training": {"data_path": [places["data"]]}, "output_dir": str(output_dir), **extra})
    assert env["ok"], env
    return env["result"]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    out = tmp_path_factory.mktemp("story")
    plans = {p: _plan(p) for p in ("bf16", "fp8")}
    best = {p: plans[p]["result"]["plans"][0] for p in plans}
    precision = "fp8" if best["fp8"]["tokens_per_s"] > best["bf16"]["tokens_per_s"] else "bf16"
    res = _render(plans[precision], CLUSTER, out / "render")
    path = Path(res["files"][0]["path"])
    return {"plans": plans, "best": best, "precision": precision, "res": res, "path": path,
            "text": path.read_text(), "out": out}


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _heredoc(text: str, tag: str) -> str:
    """A script the sbatch writes at run time (cat > FILE <<'TAG' ... TAG), as the job writes it."""
    return text.split(f"<<'{tag}'\n")[1].split(f"\n{tag}\n")[0] + "\n"


def test_the_plan_reads_qwen25_14b_and_fp8_is_the_faster_precision(story):
    """The model is the fixture's (Qwen2.5-14B's published config), and FP8 helps: its best layout is
    predicted faster than BF16's, so the agent takes it (SKILL.md: FP8's MFU is over the BF16 peak)."""
    plan = story["plans"]["fp8"]["result"]
    assert plan["tokens_per_step"] == GBS * SEQ == 4_194_304 and plan["global_batch_size"] == GBS
    assert plan["padded_vocab_size"] == 152064
    bf16, fp8 = story["best"]["bf16"], story["best"]["fp8"]
    assert story["precision"] == "fp8", (bf16["label"], bf16["tokens_per_s"], fp8["label"], fp8["tokens_per_s"])
    assert fp8["tokens_per_s"] > 1.2 * bf16["tokens_per_s"] and fp8["layout"]["precision"] == "fp8"
    assert fp8["memory"]["peak_gib"] < fp8["memory"]["gpu_gib"]
    res = story["res"]
    assert res["layout"] == fp8["layout"] and res["label"] == fp8["label"]
    # Megatron's own parser and validate_args on the vector the script passes (with TE's layers, as
    # the NGC container runs it): Qwen2.5-14B's shape, QKV bias, untied embeddings, RoPE base 1e6.
    argv = res["megatron_args"]
    te = ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    args = megatron_parser.parse(argv + te, world_size=NUM_GPUS)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
            args.num_query_groups, args.kv_channels) == (48, 5120, 13824, 40, 8, 128)
    assert args.add_qkv_bias and not args.add_bias_linear and args.untie_embeddings_and_output_weights
    assert args.rotary_base == 1_000_000 and args.layernorm_epsilon == 1e-5 and args.normalization == "RMSNorm"
    assert args.swiglu and args.seq_length == SEQ and args.global_batch_size == GBS
    assert args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size == NUM_GPUS
    assert args.fp8 == "hybrid" and args.bf16


def test_the_script_as_written_passes_megatrons_parser_validate_and_shellcheck(story):
    res, path, text = story["res"], story["path"], story["text"]
    assert res["parser_check"] == "megatron.training.arguments"  # render's own check: Megatron's parser
    _shellcheck(path)
    for name, tag in (("preflight.sh", "PREFLIGHT"), ("job_step.sh", "STEP")):  # what the job writes and runs
        step = story["out"] / name
        step.write_text(_heredoc(text, tag))
        _shellcheck(step)
    checked = call("validate", {"script": str(path), "gpu": "h100-sxm"})
    assert checked["ok"], checked
    verdict = checked["result"]
    assert verdict["valid"] and not verdict["errors"], verdict["errors"]
    assert verdict["world_size"] == NUM_GPUS
    assert str(ROOT) not in text and str(story["out"]) not in text  # no path of the machine that rendered it
    assert "#SBATCH --nodes=16" in text and "#SBATCH --gpus-per-node=8" in text


def test_the_pyxis_image_has_enroots_grammar_and_the_container_sees_what_the_job_reads(story):
    res, text = story["res"], story["text"]
    image = res["container"]["image"]
    match = ENROOT_URI.match("docker://" + image)  # what Pyxis hands enroot
    assert match, image
    registry, name = match.group(4), match.group(5)
    assert registry == "nvcr.io" and name == "nvidia/pytorch"  # the registry named by '#', not read as Docker Hub
    assert f"CONTAINER_IMAGE=${{CONTAINER_IMAGE:-'{image}'}}" in text
    assert '--container-image="$CONTAINER_IMAGE"' in text and "nvcr.io/nvidia" not in text
    # Every place the steps read is mounted at its own path: the Hugging Face folder, the folder the
    # import writes into (it holds the tokenizer once imported), the data's folder, the run, the skill.
    line = next(x for x in text.splitlines() if x.startswith("CONTAINER_MOUNTS="))
    mounts = line.split(':-"', 1)[1].rsplit('"}', 1)[0].split(",")
    places = _places(CLUSTER)
    for needed in (places["hf_model"], str(Path(places["output"]).parent), str(Path(places["data"]).parent)):
        assert f"{needed}:{needed}" in mounts, (needed, mounts)
    assert "$RUN_DIR:$RUN_DIR" in mounts and "$SKILL_HOME:/opt/megatron-core-training" in mounts
    assert all(re.fullmatch(r"(/[\w.@+/-]+|\$\w+):/[\w.@+/-]*|\$RUN_DIR:\$RUN_DIR", m) for m in mounts), mounts
    for step in ("preflight.sh", "job_step.sh"):
        (srun,) = [x for x in text.splitlines() if x.startswith("srun") and step in x]
        assert '"${CONTAINER[@]}"' in srun


def test_continued_pretraining_starts_from_the_import_with_its_tokenizer_and_a_gentle_rate(story):
    res, text = story["res"], story["text"]
    argv, places = res["megatron_args"], _places(CLUSTER)
    assert _value(argv, "--pretrained-checkpoint") == places["output"]
    assert _value(argv, "--tokenizer-type") == "HuggingFaceTokenizer"
    assert _value(argv, "--tokenizer-model") == places["output"] + "/hf"  # the import's tokenizer
    assert _value(argv, "--data-path") == places["data"] and "--mock-data" not in argv
    # not a from-scratch rate: render the same model from scratch and compare (fine-tuning's
    # defaults, references/training-recipes.md "From pretrained weights"), and no warning about it
    scratch = call("render", {"plan": story["plans"][story["precision"]], "launcher": "slurm", "dry_run": True,
                              "training": {"data_path": [places["data"]]}})["result"]["megatron_args"]
    assert float(_value(argv, "--lr")) <= float(_value(scratch, "--min-lr")) < float(_value(scratch, "--lr"))
    assert (_value(argv, "--lr"), _value(argv, "--min-lr"), _value(argv, "--lr-warmup-iters")) == ("5e-06", "0.0", "50")
    assert not any("pre-training rate" in w for w in res.get("warnings", []))
    # weights only on the first start; a restart resumes the run's own checkpoint with none of them
    loading = res["pretrained"]["loading"]
    assert loading["first_start_args"] == ["--finetune", "--no-load-optim", "--no-load-rng"]
    assert loading["resume_args"] == []
    assert not {"--finetune", "--no-load-optim", "--no-load-rng"} & set(argv)
    step = _heredoc(text, "STEP")
    guard = 'if [ ! -f "$RUN_DIR"/checkpoints/latest_checkpointed_iteration.txt ]; then\n' \
            "  MEGATRON_ARGS+=(--finetune --no-load-optim --no-load-rng)\nfi"
    assert guard in step and step.count("--finetune") == 1
    assert _value(argv, "--load") == "$RUN_DIR/checkpoints" == _value(argv, "--save")
    # the import is a step of the same job, in the same container, before training
    imp = res["import"]
    assert imp["command"] == f"python tools/launch.py import-hf --hf-model {places['hf_model']} --output {places['output']}"
    assert text.index("preflight.sh\" 2>&1") < text.index("job_step.sh\" \"$@\"")
    assert f"import-hf --hf-model {places['hf_model']} --output {places['output']}" in _heredoc(text, "PREFLIGHT")


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_sbatch_test_only_accepts_the_script_as_written(story, slurm):
    """The file as render wrote it. The test cluster is one node without GPUs, so only those two
    counts are given again on sbatch's command line (which overrides #SBATCH); the rest (time,
    exclusive, output, comment, the script itself) is checked as written."""
    proc = subprocess.run(["sbatch", "--test-only", "--nodes=1", "--gpus-per-node=0", str(story["path"])],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr


def _run(body: str, tmp_path: Path, name: str, **env) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(body)
    full = {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python"), "OMP_NUM_THREADS": "1",
            "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), **env}
    return subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _stopped_for_te(proc: subprocess.CompletedProcess) -> None:
    """Exit 5 before anything starts, with one error: Transformer Engine, missing for the FP8 the
    job was planned in (megatron-core, transformers and import-hf's modules are in the .venv)."""
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: Transformer Engine does not import (No module named 'transformer_engine')")
    assert "planned to train in FP8 with Transformer Engine" in errors[0]
    assert "an NGC PyTorch container ships it" in errors[0]
    assert any(x.startswith("stop: 1 missing piece(s) in ") for x in proc.stderr.splitlines())


def test_without_transformer_engine_the_jobs_first_step_stops_before_importing_or_training(story, tmp_path):
    """The preflight step as written (the job's first srun): the environment check stops it before
    doctor or the import run."""
    if not (ROOT / ".venv" / "bin" / "python").is_file():
        pytest.skip(".venv is missing (tools/setup.sh makes it)")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    proc = _run(_heredoc(story["text"], "PREFLIGHT"), tmp_path, "preflight.sh", RUN_DIR=str(run_dir),
                SKILL_LAUNCH=str(ROOT / "tools" / "launch.py"))
    _stopped_for_te(proc)
    assert not list((run_dir / "logs").iterdir())  # neither doctor's nor the import's answer: nothing ran


def test_without_transformer_engine_the_training_step_stops_before_torchrun(story, tmp_path):
    """The training step of the same request, its cluster folder here (tmp_path standing for
    /shared, with the data and the import in place, so that the step gets past its data check):
    the environment check stops it before torchrun starts a rank."""
    if not (ROOT / ".venv" / "bin" / "python").is_file():
        pytest.skip(".venv is missing (tools/setup.sh makes it)")
    root = str(tmp_path / "shared")
    places = _places(root)
    res = _render(story["plans"][story["precision"]], root, tmp_path / "out")
    here = [a.replace(root, CLUSTER) for a in res["megatron_args"]]
    assert here == story["res"]["megatron_args"]  # the same job, at other paths
    for made in (places["data"] + ".bin", places["data"] + ".idx"):  # then the data, and the import done
        Path(made).parent.mkdir(parents=True, exist_ok=True)
        Path(made).write_text("")
    (Path(places["output"]) / "hf").mkdir(parents=True)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    proc = _run(_heredoc(Path(res["files"][0]["path"]).read_text(), "STEP"), tmp_path, "job_step.sh",
                RUN_DIR=str(run_dir), SLURM_JOB_NUM_NODES="1", MASTER_ADDR="localhost", MASTER_PORT="29799",
                SLURM_JOB_ID="1")
    _stopped_for_te(proc)
    assert not (run_dir / "probe-0.json").exists()  # the entry never ran


def test_data_from_the_jobs_environment_asks_only_for_data_when_the_import_brings_the_tokenizer(story, tmp_path):
    """The same job with DATA_PATH given at submission instead: the tokenizer is the import's, so the
    script neither asks for TOKENIZER_MODEL nor mounts it (a mount of a folder that does not exist
    yet would stop Pyxis)."""
    places = _places(CLUSTER)
    env = call("render", {"plan": story["plans"][story["precision"]], "launcher": "slurm",
                          "container": {"runtime": "pyxis"}, "output_dir": str(tmp_path),
                          "import_hf": {"hf_model": places["hf_model"], "output": places["output"]}})
    assert env["ok"], env
    text = Path(env["result"]["files"][0]["path"]).read_text()
    assert "TOKENIZER_MODEL" not in text and ': "${DATA_PATH:?' in text
    assert '$(dirname "$DATA_PATH"):$(dirname "$DATA_PATH")' in text
    assert _value(env["result"]["megatron_args"], "--tokenizer-model") == places["output"] + "/hf"
    _shellcheck(env["result"]["files"][0]["path"])


def test_data_the_container_cannot_mount_is_refused_at_its_field(story):
    base = {"plan": story["plans"][story["precision"]], "launcher": "slurm", "container": {"runtime": "pyxis"},
            "dry_run": True}
    for data, where in ((["/corpus"], "/training/data_path/0"), (["0.5", "/a,b/corpus"], "/training/data_path/1")):
        env = call("render", {**base, "training": {"data_path": data, "tokenizer_model": "/shared/tok"}})
        assert not env["ok"] and env["error"]["where"] == where and env["error"]["fix"], env
    # a folder already mounted is not mounted twice
    env = call("render", {**base, "container": {"runtime": "pyxis", "mounts": ["/shared:/shared"]},
                          "training": {"data_path": ["/shared/data/a"], "tokenizer_model": "/shared/tok"}})
    line = next(x for x in env["result"]["files"][0]["content"].splitlines() if x.startswith("CONTAINER_MOUNTS="))
    assert line.count("/shared") == 2, line
