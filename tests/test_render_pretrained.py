"""render for a run from a Hugging Face folder that lies on the cluster: the import as part of the
job (a preflight step, the script, an init container), and the environment check each job step
runs before anything starts, run for real under this machine's Pythons (none has Transformer
Engine) and under the test Slurm."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, require_modules
from test_render import _pod_template_validator, _shellcheck

from megatron_skill.contract import call

HF, OUT = "/shared/models/Qwen-tiny", "/shared/ckpt/qwen-tiny"
BASE = {"model": "llama3-8b", "num_gpus": 16, "seq_length": 4096, "dry_run": True, "launcher": "slurm",
        "training": {"data_path": ["/shared/data/corpus"]}}


def _text(res: dict, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(res["files"][0]["content"])
    return path


def _render(**req):
    env = call("render", {k: v for k, v in {**BASE, **req}.items() if v is not None})
    assert env["ok"], env
    return env["result"]


def test_the_import_is_a_preflight_job_step_of_the_slurm_script_in_the_same_container(tmp_path):
    for runtime, image in (("pyxis", "nvcr.io#nvidia/pytorch:26.01-py3"),
                           ("apptainer", "docker://nvcr.io/nvidia/pytorch:26.01-py3")):
        res = _render(launcher="slurm", container={"runtime": runtime}, import_hf={"hf_model": HF, "output": OUT})
        text = res["files"][0]["content"]
        script = _text(res, tmp_path, f"{runtime}.sbatch")
        _shellcheck(script)
        argv = res["megatron_args"]
        # the run starts from what the job imports, with the import's tokenizer
        assert argv[argv.index("--pretrained-checkpoint") + 1] == OUT
        assert argv[argv.index("--tokenizer-model") + 1] == OUT + "/hf"
        assert res["import"]["command"] == f"python tools/launch.py import-hf --hf-model {HF} --output {OUT}"
        # one step on one node, in the job's container, before the training step
        preflight = next(line for line in text.splitlines() if line.startswith("srun") and "preflight.sh" in line)
        assert "--nodes=1 --ntasks-per-node=1" in preflight and '"${CONTAINER[@]}"' in preflight
        assert text.index(preflight) < text.index('bash "$RUN_DIR/job_step.sh"')
        body = text.split("<<'PREFLIGHT'")[1].split("\nPREFLIGHT\n")[0]
        assert f"import-hf --hf-model {HF} --output {OUT}" in body and "doctor" in body
        assert '"modules": ["safetensors", "psutil", "jinja2", "jsonschema"]' in body  # the import's own needs
        # the container sees the Hugging Face folder and where the import goes, at the same paths
        mounts = next(line for line in text.splitlines() if line.startswith("CONTAINER_MOUNTS="))
        assert f"{HF}:{HF}" in mounts and "/shared/ckpt:/shared/ckpt" in mounts
        assert image in text
        assert str(ROOT) not in text and str(tmp_path) not in text


def test_torchrun_and_kubernetes_import_before_training_and_wait_for_each_other(tmp_path):
    for launcher in ("torchrun-multinode", "torchrun"):
        res = _render(launcher=launcher, num_gpus=16 if launcher != "torchrun" else 8,
                      import_hf={"hf_model": HF}, training={"data_path": ["/d/x"], "pretrained": OUT})
        text = res["files"][0]["content"]
        _shellcheck(_text(res, tmp_path, launcher + ".sh"))
        call_at = text.index("\nimport_weights\n")
        assert call_at < text.index("-m torch.distributed.run")
        assert "MEGATRON_SKILL_IMPORT_WAIT" in text and res["import"]["output"] == OUT
    res = _render(launcher="kubernetes", import_hf={"hf_model": "/workspace/models/q", "output": "/workspace/ckpt/q"})
    import yaml

    job = yaml.safe_load(res["files"][0]["content"])
    pods = _pod_template_validator()
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        errors = list(pods.iter_errors(spec["template"]))
        assert not errors, f"{role}: {errors[0].message}"
        (init,) = spec["template"]["spec"]["initContainers"]
        (main,) = spec["template"]["spec"]["containers"]
        assert init["image"] == main["image"] and init["env"] == main["env"]
        assert init["volumeMounts"][0]["mountPath"] == "/workspace"
        assert init["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["limits"]["nvidia.com/gpu"]
        assert "import-hf --hf-model /workspace/models/q --output /workspace/ckpt/q" in init["args"][0]
        assert "import-hf --hf-model" not in main["args"][0]
    step = tmp_path / "init.sh"
    step.write_text("#!/usr/bin/env bash\n" + init["args"][0])
    _shellcheck(step)


def test_an_import_the_job_cannot_do_is_refused_at_its_field(tmp_path):
    import transformers

    other = tmp_path / "other"  # a folder visible here that holds another model than the request's
    transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2).save_pretrained(other)
    for req, where in [
        ({"import_hf": {"hf_model": str(other), "output": OUT}}, "/import_hf/hf_model"),
        ({"container": {"runtime": "pyxis"}, "import_hf": {"hf_model": HF, "output": "/ckpt"}}, "/import_hf/output"),
        ({"import_hf": {"hf_model": HF}}, "/import_hf/output"),  # nowhere to go
        ({"import_hf": {"hf_model": HF, "output": OUT}, "training": {"pretrained": "/elsewhere"}},
         "/training/pretrained"),  # the run would not start from what the job imports
        ({"import_hf": {"hf_model": "models/q", "output": OUT}}, "/import_hf/hf_model"),  # not a path of the job's
        ({"import_hf": {"hf_model": HF, "output": HF}}, "/import_hf/output"),
        ({"launcher": "kubernetes", "import_hf": {"hf_model": HF, "output": "/workspace/c"}}, "/import_hf/hf_model"),
        ({"launcher": "slurm", "container": {"runtime": "pyxis"}, "import_hf": {"hf_model": "/a,b", "output": OUT}},
         "/import_hf/hf_model"),  # a comma would split the container's mount list
    ]:
        env = call("render", {**BASE, **req})
        assert not env["ok"] and env["error"]["where"] == where, (req, env)
        assert env["error"]["fix"]
    assert f"hf_config {other}" in call("render", {**BASE, "import_hf": {"hf_model": str(other), "output": OUT}})[
        "error"]["fix"]
    # Megatron-LM's entry needs no skill folder, but the import does: the job says so before anything runs
    res = _render(megatron_lm="/opt/Megatron-LM", import_hf={"hf_model": HF, "output": OUT})
    assert "the job imports the Hugging Face weights with its tools/launch.py" in res["files"][0]["content"]


def test_a_folder_the_job_will_import_into_may_already_exist_here_empty(tmp_path):
    """Rendering again after the folder was made by hand, or after an import cut short (an import
    builds beside its output and renames into place, so it leaves the output empty): the job's own
    import fills it. Files no import wrote are refused here, as the job's import would refuse them;
    a forged tracker too; and without an import in the job an empty folder is no checkpoint."""
    out = tmp_path / "ckpt" / "qwen"
    out.mkdir(parents=True)
    res = _render(import_hf={"hf_model": HF, "output": str(out)})
    assert res["megatron_args"][res["megatron_args"].index("--pretrained-checkpoint") + 1] == str(out)
    (out / "notes.txt").write_text("mine")
    env = call("render", {**BASE, "import_hf": {"hf_model": HF, "output": str(out)}})
    assert not env["ok"] and env["error"]["code"] == "conflict" and "no import wrote" in env["error"]["message"], env
    (out / "notes.txt").unlink()
    (out / "latest_checkpointed_iteration.txt").write_text("abc")
    env = call("render", {**BASE, "import_hf": {"hf_model": HF, "output": str(out)}})
    assert not env["ok"] and env["error"]["where"] == "/training/pretrained", env
    (out / "latest_checkpointed_iteration.txt").unlink()
    env = call("render", {**BASE, "training": {**BASE["training"], "pretrained": str(out)}})
    assert not env["ok"] and env["error"]["code"] == "not_found", env


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_the_slurm_scripts_with_an_import_pass_sbatch_test_only(tmp_path, slurm):
    for runtime in ("pyxis", "apptainer"):
        res = _render(launcher="slurm", container={"runtime": runtime}, num_gpus=8,
                      slurm={"gpus": False, "exclusive": False, "time": "00:10:00"},
                      import_hf={"hf_model": HF, "output": OUT})
        proc = subprocess.run(["sbatch", "--test-only", "--nodes=1", str(_text(res, tmp_path, runtime + ".sbatch"))],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr


# ---- the environment check, run for real -----------------------------------------------------------
def _run_script(res: dict, tmp_path: Path, python: str | None = None, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "launch.sh"
    script.write_text(res["files"][0]["content"])
    full = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"),
            "MEGATRON_SKILL_EMIT": "/nonexistent", "OMP_NUM_THREADS": "1", **env}
    if python:
        full["PYTHON"] = python
    return subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=600)


def _one_gpu(tmp_path: Path, **req) -> dict:
    """A one-GPU script that runs here (the model None: hf_config gives it)."""
    return _render(**{"model": "llama3.2-1b", "num_gpus": 1, "seq_length": 1024, "global_batch_size": 8,
                      "launcher": "torchrun", "run_dir": str(tmp_path / "run"), "python": sys.executable,
                      "skill_home": str(ROOT), "training": {"mock_data": True}, **req})


def _lines(proc: subprocess.CompletedProcess, start: str) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith(start)]


@pytest.mark.slow
def test_the_step_stops_before_training_with_one_line_per_missing_piece(tmp_path):
    """FP8 planned for Transformer Engine and a TikTokenizer, under this machine's .venv (no TE, no
    tiktoken): two lines, each naming its piece, then exit 5 before the entry runs."""
    tok, data = tmp_path / "tokenizer.json", tmp_path / "corpus"
    for f in (tok, Path(f"{data}.bin"), Path(f"{data}.idx")):
        f.write_text("")
    res = _one_gpu(tmp_path, precision="fp8", training={"data_path": [str(data)], "tokenizer_type": "TikTokenizer",
                                                        "tokenizer_model": str(tok)})
    assert res["environment_check"]["te"] and res["environment_check"]["megatron_core"].startswith("0.19")
    proc = _run_script(res, tmp_path)
    assert proc.returncode == 5, proc.stderr[-3000:]
    errors = _lines(proc, "error:")
    assert len(errors) == 2, errors
    te = next(e for e in errors if "Transformer Engine" in e)
    tiktoken = next(e for e in errors if "tiktoken" in e)
    assert "Transformer Engine does not import" in te and "planned to train in FP8 with Transformer Engine" in te
    assert "runtime.fp8_linear" in te  # the other way out
    assert "cannot import tiktoken, which Megatron's TikTokenizer needs" in tiktoken and "pip install tiktoken" in tiktoken
    assert _lines(proc, "stop: 2 missing piece(s)")
    assert not (tmp_path / "run" / "probe-0.json").exists()


@pytest.mark.slow
def test_a_python_without_torch_or_megatron_is_told_each_and_another_megatron_version_is_named(tmp_path):
    # A bare venv of the same interpreter: nothing installed (a container without the packages).
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    res = _one_gpu(tmp_path, training={"data_path": [str(tmp_path / "c")], "tokenizer_model": str(tmp_path)})
    for ext in (".bin", ".idx"):
        (tmp_path / ("c" + ext)).write_text("")
    proc = _run_script(res, tmp_path, python=str(bare / "bin" / "python"))
    assert proc.returncode == 5
    errors = _lines(proc, "error:")
    assert [e.split(" ")[1] for e in errors] == ["torch", "megatron.core", "cannot"], errors
    assert "pip install 'megatron-core==0.19.*'" in errors[1] and "transformers" in errors[2]
    # megatron-core 0.18 installed (a distribution of that version first on the path): named, with the fix
    old = tmp_path / "old"
    (old / "megatron" / "core").mkdir(parents=True)
    (old / "megatron" / "__init__.py").write_text("")
    (old / "megatron" / "core" / "__init__.py").write_text("")
    (old / "megatron_core-0.18.0.dist-info").mkdir()
    (old / "megatron_core-0.18.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\n"
                                                                      "Version: 0.18.0\n")
    res = _one_gpu(tmp_path)
    proc = _run_script(res, tmp_path, PYTHONPATH=str(old))
    assert proc.returncode == 5
    (error,) = _lines(proc, "error:")
    want = res["environment_check"]["megatron_core"]
    assert f"megatron-core 0.18.0 here, but the script's flags were checked against megatron-core {want}" in error
    # asked to go on anyway: a warning, and the step starts
    proc = _run_script(res, tmp_path, PYTHONPATH=str(old), MEGATRON_SKILL_ANY_MEGATRON="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc, "warning: megatron-core 0.18.0 here") and (tmp_path / "run" / "probe-0.json").exists()


@pytest.mark.slow
def test_with_a_megatron_lm_checkout_the_check_reads_the_checkouts_own_version(tmp_path):
    """Megatron-LM's entry imports the checkout's megatron.core, so the check does too (its
    package_info), not the distribution installed beside it."""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "core").mkdir(parents=True)
    (checkout / "megatron" / "__init__.py").write_text("")
    (checkout / "megatron" / "core" / "__init__.py").write_text("")
    info = checkout / "megatron" / "core" / "package_info.py"
    res = _one_gpu(tmp_path, megatron_lm=str(checkout))
    want = res["environment_check"]["megatron_core"]
    info.write_text("__version__ = '0.20.0rc0'\n")
    proc = _run_script(res, tmp_path)
    assert proc.returncode == 5
    (error,) = _lines(proc, "error:")
    assert f"megatron-core 0.20.0rc0 here, but the script's flags were checked against megatron-core {want}" in error
    info.write_text(f"__version__ = '{want.split('+')[0]}'\n")
    proc = _run_script(res, tmp_path)
    assert proc.returncode == 0 and not _lines(proc, "error:"), proc.stderr[-3000:]


# ---- the import in the job, for real -----------------------------------------------------------------
@pytest.mark.slow
def test_the_job_imports_the_hugging_face_folder_before_training_and_only_once(tmp_path):
    require_modules("torch", "megatron.core", "transformers", "safetensors")
    from hf_tiny import hf_tokenizer, tiny

    hf, out, data = tmp_path / "hf", tmp_path / "ckpt" / "qwen", tmp_path / "corpus"
    tiny("qwen2", hf)
    hf_tokenizer(hf)
    for ext in (".bin", ".idx"):  # the probe entry reads nothing: the job only checks they are there
        Path(f"{data}{ext}").write_text("")
    res = _one_gpu(tmp_path, model=None, hf_config=str(hf), seq_length=128, training={"data_path": [str(data)]},
                   import_hf={"hf_model": str(hf), "output": str(out)})
    assert res["import"]["tokenizer"] == f"{out}/hf" and res["import"]["checked_here"]
    started = time.time()
    proc = _run_script(res, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(next((tmp_path / "run" / "logs").glob("import.*.json")).read_text())
    assert answer["ok"] and not answer["result"].get("already_done")
    assert (out / "conversion.json").is_file() and (out / "release").is_dir()
    assert json.loads(next((tmp_path / "run" / "logs").glob("doctor.*.json")).read_text())["ok"]
    argv = json.loads((tmp_path / "run" / "probe-0.json").read_text())["argv"]
    assert argv[argv.index("--pretrained-checkpoint") + 1] == str(out) and "--finetune" in argv
    assert argv[argv.index("--tokenizer-model") + 1] == f"{out}/hf" and (out / "hf" / "tokenizer.json").is_file()
    first = time.time() - started
    proc = _run_script(res, tmp_path)  # the same job again: the import is already there
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(next((tmp_path / "run" / "logs").glob("import.*.json")).read_text())
    assert answer["result"]["already_done"] is True, (first, answer)
    # A CPU train from the same import takes fine-tuning's defaults as render's script does: 5e-6
    # cosine to 0 after 50 warm-up steps (from scratch: 3e-4 to 3e-5 after a tenth of the run).
    from megatron_skill.contract import validate_request
    from megatron_skill.runtime.cpu_run import plan_cpu_run

    for training, lr, min_lr, warmup in (({"pretrained": str(out)}, 5e-6, 0.0, 50), ({}, 3e-4, 3e-5, 100)):
        request = validate_request("train", {"hf_config": str(hf), "backend": "cpu", "num_gpus": 1, "seq_length": 32,
                                             "global_batch_size": 2, "training": {"mock_data": True,
                                                                                  "train_iters": 1000, **training}})
        run_dir = tmp_path / f"cpu-{len(training)}"
        run_dir.mkdir()
        plan_cpu_run(request, run_dir, "r")["write"]()
        config = json.loads((run_dir / "cpu_run.json").read_text())
        assert (config["lr"], config["min_lr"], config["lr_warmup_iters"]) == (lr, min_lr, warmup), training


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_under_slurm_the_preflight_step_imports_and_the_training_step_starts_from_it(tmp_path, slurm):
    require_modules("torch", "megatron.core", "transformers", "safetensors")
    from hf_tiny import hf_tokenizer, tiny

    hf, out, data = tmp_path / "hf", tmp_path / "ckpt" / "qwen", tmp_path / "corpus"
    tiny("qwen2", hf)
    hf_tokenizer(hf)
    for ext in (".bin", ".idx"):
        Path(f"{data}{ext}").write_text("")
    res = _one_gpu(tmp_path, model=None, hf_config=str(hf), seq_length=128, launcher="slurm", dry_run=False,
                   training={"data_path": [str(data)]},
                   output_dir=str(tmp_path / "out"),
                   slurm={"gpus": False, "exclusive": False, "time": "00:10:00", "job_name": "skill-import"},
                   import_hf={"hf_model": str(hf), "output": str(out)})
    env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), "OMP_NUM_THREADS": "1",
           "MASTER_PORT": "29741"}
    proc = subprocess.run(["sbatch", "--wait", f"--chdir={tmp_path}", res["files"][0]["path"]], env=env,
                          capture_output=True, text=True, timeout=900)
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    assert log.index("import-hf: wrote") < log.index(f"import: {out} is ready") and (out / "conversion.json").is_file()
    argv = json.loads((tmp_path / "run" / "probe-0.json").read_text())["argv"]
    assert argv[argv.index("--pretrained-checkpoint") + 1] == str(out)
    assert argv[argv.index("--tokenizer-model") + 1] == f"{out}/hf"


def test_a_container_job_mounts_the_checkpoint_it_starts_from_and_where_it_saves():
    """An import already on the cluster and a save folder outside the run folder: both at their own
    paths in the container (a save inside the container's own file system is lost with it); the
    run folder's own checkpoints need no mount of their own."""
    res = _render(container={"runtime": "pyxis"}, training={"data_path": ["/shared/data/corpus"],
                                                            "pretrained": "/shared/imports/llama3-8b",
                                                            "save": "/scratch/ckpt/llama"})
    mounts = next(line for line in res["files"][0]["content"].splitlines() if line.startswith("CONTAINER_MOUNTS="))
    for path in ("/shared/data", "/shared/imports/llama3-8b", "/scratch/ckpt"):
        assert f",{path}:{path}" in mounts, mounts
    plain = _render(container={"runtime": "pyxis"})
    mounts = next(line for line in plain["files"][0]["content"].splitlines() if line.startswith("CONTAINER_MOUNTS="))
    assert "checkpoints" not in mounts and mounts.count(",/") == 1, mounts   # the data's folder only
