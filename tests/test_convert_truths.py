"""Small truths of the conversions: a RoPE base Megatron cannot hold is refused, not truncated; an
export under dtype auto writes the checkpoint's own dtype, however the checkpoint is named; the
TP 1 logits equal transformers' bit for bit also where the two attention-scale formulas differ."""
import json
import math
import os
import shutil
import subprocess
import sys

from conftest import ROOT, require_modules

require_modules("torch", "megatron.core", "transformers", "safetensors")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import tiny  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _set_rope_theta(folder, theta):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = theta
    if "rope_theta" in cfg or not isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_theta"] = theta
    path.write_text(json.dumps(cfg))


def test_a_rope_base_that_is_not_whole_is_refused_by_the_import_not_truncated(tmp_path, cli):
    """Megatron's --rotary-base is an integer: 10000.7 would train as 10000, another model."""
    tiny("llama", tmp_path / "hf")
    _set_rope_theta(tmp_path / "hf", 10000.7)
    code, out, _ = cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "m"), "--dry-run")
    assert code == 2 and out["error"]["code"] == "bad_model", out
    assert "rope_theta 10000.7 is not a whole number" in out["error"]["message"]
    assert out["error"]["where"].endswith("config.json") and "10001" in out["error"]["fix"]
    assert not (tmp_path / "m").exists()
    _set_rope_theta(tmp_path / "hf", 500000.0)  # a whole base written as a float converts
    code, out, _ = cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "m"), "--dry-run")
    assert code == 0, out


def _equal(a_dir, b_dir) -> bool:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_export_under_auto_writes_the_checkpoints_own_dtype(tmp_path, cli):
    tiny("llama", tmp_path / "hf")  # fp32 safetensors
    assert cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "m"))[0] == 0
    # the import's release/ folder given itself: still the import's (its record, its config)
    code, out, err = cli("export-hf", "--checkpoint", str(tmp_path / "m" / "release"), "--output", str(tmp_path / "a"))
    assert code == 0, err[-2000:]
    assert out["result"]["dtype"] == "fp32" and _equal(tmp_path / "hf", tmp_path / "a")
    # a copy without the record: the dtype its torch_dist metadata holds
    shutil.copytree(tmp_path / "m" / "release", tmp_path / "copy" / "weights")
    code, out, err = cli("export-hf", "--checkpoint", str(tmp_path / "copy" / "weights"), "--output",
                         str(tmp_path / "b"), "--hf-config", str(tmp_path / "hf"))
    assert code == 0, err[-2000:]
    assert out["result"]["dtype"] == "fp32" and _equal(tmp_path / "hf", tmp_path / "b")
    # and a bf16 checkpoint stays bf16 (not a default that happens to be fp32)
    assert cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "m16"),
               "--dtype", "bf16")[0] == 0
    shutil.copytree(tmp_path / "m16" / "release", tmp_path / "copy16" / "weights")
    code, out, err = cli("export-hf", "--checkpoint", str(tmp_path / "copy16" / "weights"), "--output",
                         str(tmp_path / "c"), "--hf-config", str(tmp_path / "hf"))
    assert code == 0, err[-2000:]
    assert out["result"]["dtype"] == "bf16"
    assert {t.dtype for t in load_file(tmp_path / "c" / "model.safetensors").values()} == {torch.bfloat16}


def test_the_two_attention_scale_formulas_give_the_same_fp32_scale():
    """Megatron scales by 1 / sqrt(head_dim), transformers by head_dim ** -0.5. In double they differ
    in the last bit for some head sizes (24, 128 among them); the attention kernels take the scale in
    fp32, where the two agree for every head size up to 1024."""
    differ = [d for d in range(1, 1025) if 1 / math.sqrt(d) != d ** -0.5]
    assert 24 in differ and 128 in differ
    as_fp32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert [d for d in differ if as_fp32(1 / math.sqrt(d)) != as_fp32(d ** -0.5)] == []


@pytest.mark.slow
def test_mistral_with_head_dim_24_gives_transformers_logits_bit_for_bit_at_tp_1(tmp_path):
    """head_dim 24 (not hidden / heads): the same fp32 SDPA kernel on both sides gives the same bits;
    transformers' own eager attention (matmul and softmax) is another computation, a few ulps off."""
    import transformers

    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                     max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(7)
    model = transformers.MistralForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "mistral24")
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(ROOT / "tests" / "convert_probe.py"), "1", "1", "1", str(tmp_path / "ids.pt"),
                           str(tmp_path), str(tmp_path / "mistral24")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "mistral24.pt")
    with torch.no_grad():
        sdpa = model(ids).logits
        model.config._attn_implementation = "eager"
        eager = model(ids).logits
    assert sdpa.abs().max().item() > 1.0
    assert torch.equal(got, sdpa)
    assert 0 < (got - eager).abs().max().item() < 1e-5 * sdpa.abs().max().item()
