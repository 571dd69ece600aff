"""Hugging Face checkpoints into Megatron-Core and back: tiny randomly initialised models of each
family, built and saved by transformers here (nothing downloaded), converted, loaded into
Megatron-Core's GPTModel on CPU at TP 1, TP 2, PP 2 (and EP 2 for the MoE families), and
compared by their logits."""
import os
import subprocess
import sys

from conftest import ROOT, require_modules

require_modules("torch", "megatron.core", "transformers", "safetensors")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import FAMILIES, MOE, VOCAB  # noqa: E402
from hf_tiny import tiny as _tiny
from safetensors.torch import load_file  # noqa: E402

from megatron_skill.convert import hf as conv  # noqa: E402
from megatron_skill.core.model import from_hf_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: (root / f, _tiny(f, root / f)) for f in FAMILIES}


def test_each_family_reads_as_the_model_it_is(tiny_models):
    specs = {f: from_hf_config(folder) for f, (folder, _) in tiny_models.items()}
    assert specs["qwen2"].add_qkv_bias and not specs["llama"].add_qkv_bias
    assert specs["qwen3"].qk_layernorm and not specs["qwen3"].untie_embeddings_and_output_weights
    assert all(s.norm_epsilon == 1e-6 and s.query_groups == (8 if f == "llama2" else 2) and s.head_dim == 8
               and s.rotary_base == 50000 for f, s in specs.items())
    assert specs["llama3.1"].rope_scaling_factor == 4.0 and specs["llama"].rope_scaling_factor is None
    assert specs["mixtral"].num_experts == 4 and not specs["mixtral"].moe_router_pre_softmax
    assert specs["qwen3_moe"].moe_pattern() == [0, 1] and specs["qwen3_moe"].moe_router_pre_softmax


def test_configs_without_a_megatron_counterpart_are_refused_by_name():
    from megatron_skill.errors import ToolError

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert conv.check_config(base) == "llama"
    for bad, says in (({"architectures": ["GemmaForCausalLM"]}, "LlamaForCausalLM"),
                      ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
                      ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq"),
                      ({"hidden_act": "gelu"}, "SiLU")):
        with pytest.raises(ToolError) as e:
            conv.check_config({**base, **bad})
        assert says in e.value.message + e.value.fix


def test_hugging_face_to_megatron_and_back_is_exact(tiny_models):
    for family, (folder, _) in tiny_models.items():
        spec = from_hf_config(folder)
        get = conv.hf_reader(folder)
        megatron = dict(conv.to_megatron(get, spec, padded_vocab=384))
        assert megatron["embedding.word_embeddings.weight"].shape == (384, 64)
        back = dict(conv.to_hf(megatron.__getitem__, spec))
        # What the folder holds (transformers keeps MoE experts fused in memory, per expert on disk).
        original = load_file(folder / "model.safetensors")
        assert set(back) == set(original), family
        for name, tensor in original.items():
            assert torch.equal(back[name], tensor), f"{family}: {name}"


def test_tensor_parallel_pieces_join_back_to_the_whole(tiny_models):
    folder, _ = tiny_models["qwen2"]
    spec = from_hf_config(folder)
    megatron = dict(conv.to_megatron(conv.hf_reader(folder), spec, padded_vocab=384))
    for tp in (2, 4):
        if spec.query_groups % tp:
            continue
        for name, full in megatron.items():
            pieces = [conv.tp_piece(name, full, tp, r, spec) for r in range(tp)]
            assert torch.equal(conv.tp_join(name, pieces, spec), full), name
    # A TP rank's QKV holds whole key/value groups: group 1 of 2 is rank 1's at TP 2.
    qkv = megatron["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(conv.tp_piece("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 2, 1, spec),
                       qkv[qkv.shape[0] // 2:])


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_logits_match_the_hugging_face_model(tiny_models, tmp_path, tp, pp, ep):
    """fp32 both sides. Positions run past Llama 3.1's low-frequency wavelength, so its RoPE
    scaling shows. At TP 1 the dense families run the same operations in the same order; the MoE
    layers gather the chosen experts' outputs in another order than Hugging Face's loop, and TP 2
    sums the row-parallel halves in another order: a few ulps of the largest logit (5e-6
    relative) separate them -- a wrong mapping moves them by whole units."""
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    chosen = {f: m for f, m in tiny_models.items() if ep == 1 or f in MOE}
    folders = [str(folder) for folder, _ in chosen.values()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(tp * pp * ep), str(ROOT / "tests" / "convert_probe.py"), str(tp), str(pp), str(ep),
                           str(tmp_path / "ids.pt"), str(tmp_path), *folders],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for family, (folder, model) in chosen.items():
        with torch.no_grad():
            expected = model(ids).logits
        got = torch.load(tmp_path / f"{folder.name}.pt")
        scale = expected.abs().max().item()
        assert scale > 1.0, family  # logits of a size that a wrong weight would move
        diff = (got - expected).abs().max().item()
        exact = tp == pp == ep == 1 and family not in MOE
        assert diff <= (0.0 if exact else 5e-6 * scale), f"{family} TP{tp} PP{pp} EP{ep}: {diff}"
