"""doctor on a machine without a GPU, the unrelated PyPI 'apex', and bench without a GPU."""
import json

from conftest import ROOT, run_cli


def test_doctor_without_gpu(cli):
    rc, out, err = cli("doctor")
    assert rc == 0, out
    r = out["result"]
    assert r["gpus"]["count"] == 0
    assert r["will_use"]["transformer_impl"] in ("local", "transformer_engine")
    if r["will_use"]["transformer_impl"] == "local":
        assert "--no-rope-fusion" in r["will_use"]["extra_megatron_flags"]
    assert any("GPU" in p["what"] for p in r["problems"])
    assert "GPUs:" in err  # the short human summary


def test_doctor_recognises_the_pypi_apex_impostor(tmp_path):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("# a web toolkit that happens to be called apex\n")
    rc, out, _ = run_cli("doctor", env={"PYTHONPATH": str(tmp_path)})  # a process of its own: its own path
    apex = out["result"]["packages"]["apex"]
    assert apex["installed"] is False and apex.get("impostor") is True
    assert "github.com/NVIDIA/apex" in apex["howto"]


def test_doctor_names_a_missing_shell_parser(tmp_path):
    """validate reads launch scripts through shfmt: doctor says when its binary is not there."""
    rc, out, _ = run_cli("doctor")
    assert out["result"]["packages"]["shfmt-py"] and not any("shfmt" in p["what"] for p in out["result"]["problems"])
    rc, out, _ = run_cli("doctor", env={"MEGATRON_SKILL_SHFMT": str(tmp_path / "no-shfmt")})
    assert rc == 0, out
    missing = [p for p in out["result"]["problems"] if "shfmt" in p["what"]]
    assert missing and "pip install shfmt-py" in missing[0]["fix"], out["result"]["problems"]


def test_bench_without_gpu(cli, tmp_path):
    rc, out, _ = cli("bench", "--calibrate", "--runs-root", str(tmp_path))
    assert rc == 5 and out["error"]["code"] == "environment"
    rc, out, _ = cli("bench", "--request", "benchmarks/requests/llama-1b-shape-bf16.json", "--runs-root", str(tmp_path),
                     "--dry-run")
    assert rc == 0 and out["result"]["dry_run"] and out["result"]["prediction"]["tokens_per_s"] > 0
    request = json.loads((ROOT / "benchmarks/requests/llama-1b-shape-bf16.json").read_text())
    assert out["result"]["layout"]["mbs"] == request["layout"]["mbs"]   # the request's layout, not a plan's


def test_kernel_families_of_the_profile():
    """bench --profile sums GPU time by kernel family; names as the H200 profile reported them."""
    from megatron_skill.runtime.gpu_profile import family

    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert family("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert family("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>") == "optimizer"
    assert family("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "copy_cast"
    assert family("void at::native::elementwise_kernel<128, 4, BinaryFunctor<float>>") == "elementwise_other"


def test_bench_profile_is_part_of_the_request_and_its_id(cli, tmp_path):
    base = ["bench", "--request", "benchmarks/requests/llama-1b-shape-bf16.json", "--gpu", "h200", "--runs-root",
            str(tmp_path), "--dry-run"]
    rc1, plain, _ = cli(*base)
    rc2, profiled, _ = cli(*base, "--profile")
    assert rc1 == rc2 == 0 and plain["request_id"] != profiled["request_id"]


def test_bench_plans_for_the_layers_installed_here(cli, tmp_path):
    """Without a layout, bench (and train) take the planner's first for the path the run will
    really have: no Transformer Engine here, so the local layers with the fused head and
    fused weight-gradient accumulation, and the skill's FP8 linears when asked for."""
    from megatron_skill.environment import have_transformer_engine

    assert not have_transformer_engine()
    req = json.loads((ROOT / "benchmarks" / "requests" / "llama-3b-shape-bf16.json").read_text())
    del req["layout"]
    req.update(gpu="h200", runs_root=str(tmp_path), dry_run=True)

    def planned(**extra):
        rc, out, _ = cli("bench", "--request", "-", stdin=json.dumps({**req, **extra}))
        assert rc == 0, out
        return out["result"]["prediction"], out["result"]["layout"]

    here, lay = planned()
    assert here["transformer_engine"] is False
    rc, plan, _ = cli("plan", "--request", "-", stdin=json.dumps(
        {"model": req["model"], "gpu": "h200", "num_gpus": 1, "seq_length": 4096, "global_batch_size": 16,
         "transformer_engine": False}))
    assert rc == 0 and plan["result"]["plans"][0]["layout"]["mbs"] == lay["mbs"]
    te, _ = planned(transformer_engine=True, layout={"tp": 1, "pp": 1, "mbs": lay["mbs"]})
    assert te["transformer_engine"] is True and te["peak_gib"] > here["peak_gib"]   # TE's path keeps full logits
    fp8, _ = planned(runtime={"fp8_linear": True})
    assert fp8["tokens_per_s"] > here["tokens_per_s"]                              # FP8 GEMMs in the ranking
