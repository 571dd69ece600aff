"""doctor on a machine without a GPU, the unrelated PyPI 'apex', and bench without a GPU."""
import json


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


def test_doctor_recognises_the_pypi_apex_impostor(cli, tmp_path):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("# a web toolkit that happens to be called apex\n")
    rc, out, _ = cli("doctor", env={"PYTHONPATH": str(tmp_path)})
    apex = out["result"]["packages"]["apex"]
    assert apex["installed"] is False and apex.get("impostor") is True
    assert "github.com/NVIDIA/apex" in apex["howto"]


def test_bench_without_gpu(cli, tmp_path):
    rc, out, _ = cli("bench", "--calibrate", "--runs-root", str(tmp_path))
    assert rc == 5 and out["error"]["code"] == "environment"
    rc, out, _ = cli("bench", "--request", "tools/benchmarks/llama-1b-shape-bf16.json", "--runs-root", str(tmp_path),
                     "--dry-run")
    assert rc == 0 and out["result"]["dry_run"] and out["result"]["prediction"]["tokens_per_s"] > 0
    assert json.loads(json.dumps(out))["result"]["layout"]["mbs"] == 4
