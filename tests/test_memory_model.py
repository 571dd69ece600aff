"""The memory model against a real Megatron-Core layer: what core attention keeps for its
backward, counted with autograd's saved-tensor hooks on CPU (the skill's layer spec, native
grouped-query heads, compiled RoPE: the default path), equals memory.attention_saved_bytes."""
from conftest import require_modules  # noqa: E402

require_modules('torch', 'megatron.core')

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # each test runs a real layer in a process of its own

# Shared by the counting scripts: the bytes of the tensors autograd saves inside the block,
# each storage once, leaving out the storages in ``skip`` (parameters, the inputs).
SAVED_BYTES = r"""
import torch

class saved_bytes_of:
    def __init__(self, skip):
        self.skip, self.saved = skip, {}
    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.saved[st.data_ptr()] = st.nbytes()
        return t
    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self
    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.total = sum(self.saved.values())
"""

COUNT = SAVED_BYTES + r"""
import json, os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29561")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron_skill.runtime import cpu_loop
m = json.loads(sys.argv[2])
s = 256
model = cpu_loop.build_model({"model": m, "tp": 1, "padded_vocab_size": 128, "seq_length": s,
                              "native_gqa": True, "compiled_rope": True}).to(torch.bfloat16)
layer = model.decoder.layers[0]
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
x = torch.randn(s, 1, m["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
normed = layer.input_layernorm(x).detach().requires_grad_()
freqs = model.rotary_pos_emb(s)  # computed once per forward, shared by every layer
skip = params | {normed.untyped_storage().data_ptr(), freqs.untyped_storage().data_ptr()}
with saved_bytes_of(skip) as counted:
    out, _ = layer.self_attention(normed, attention_mask=None, rotary_pos_emb=freqs)
print(json.dumps({"bytes_per_token": counted.total / s}))
"""


@pytest.mark.slow   # Megatron's layers run forward and backward on CPU
def test_core_attention_keeps_what_the_memory_model_counts():
    from megatron_skill.core.memory import attention_saved_bytes
    from megatron_skill.core.resolve import resolve_model

    shape = {"num_layers": 1, "hidden_size": 512, "ffn_hidden_size": 1024, "num_attention_heads": 8,
             "num_query_groups": 2, "kv_channels": 64, "vocab_size": 128}
    proc = subprocess.run([sys.executable, "-c", COUNT, str(ROOT), json.dumps(shape)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(proc.stdout.strip().splitlines()[-1])["bytes_per_token"]
    model = resolve_model({"model": {"name": "probe", **shape}})
    assert counted == attention_saved_bytes(model)


COUNT_LAYER = SAVED_BYTES + r"""
import json, os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29563")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron_skill.runtime import cpu_loop
m, fp8 = json.loads(sys.argv[2]), sys.argv[3] == "fp8"
model = cpu_loop.build_model({"model": m, "tp": 1, "padded_vocab_size": 128, "seq_length": 512,
                              "native_gqa": True, "fp8_linear": fp8}).to(torch.bfloat16)
layer = model.decoder.layers[0]
params = {p.untyped_storage().data_ptr() for p in model.parameters()}

def saved_bytes(s):
    x = torch.randn(s, 1, m["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
    freqs = model.rotary_pos_emb(s)
    skip = params | {x.untyped_storage().data_ptr(), freqs.untyped_storage().data_ptr()}
    with saved_bytes_of(skip) as counted:
        out, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=freqs)
    return counted.total

# per token: the slope between two lengths (weight-sized FP8 copies are the same at both)
print(json.dumps({"bytes_per_token": (saved_bytes(512) - saved_bytes(256)) / 256}))
"""


@pytest.mark.slow   # Megatron's layers run forward and backward on CPU
def test_fp8_linear_layers_save_what_the_memory_model_counts():
    """A whole Megatron-Core layer (attention and SwiGLU MLP, the skill's spec) with the skill's
    FP8 linear layers against the same layer in BF16, saved tensors counted with autograd's
    hooks on CPU: the difference per token is memory.fp8_linear_saved_bytes."""
    from megatron_skill.core.layout import Layout
    from megatron_skill.core.memory import fp8_linear_saved_bytes
    from megatron_skill.core.resolve import resolve_model

    shape = {"num_layers": 1, "hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 4,
             "num_query_groups": 2, "kv_channels": 64, "vocab_size": 128}
    per_token = {}
    for mode in ("bf16", "fp8"):
        proc = subprocess.run([sys.executable, "-c", COUNT_LAYER, str(ROOT), json.dumps(shape), mode],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        per_token[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["bytes_per_token"]
    model = resolve_model({"model": {"name": "probe", **shape}})
    assert per_token["fp8"] - per_token["bf16"] == fp8_linear_saved_bytes(model, Layout())


COUNT_UNFUSED = SAVED_BYTES + r"""
import contextlib, json, sys, torch
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29565")
from megatron.core import parallel_state as ps, tensor_parallel
ps.initialize_model_parallel(1, 1)
# CPU stand-ins for the two CUDA-only helpers the layer calls: Megatron's global buffer (the
# baddbmm input, overwritten with beta 0: not saved) and the dropout RNG fork.
ps.get_global_memory_buffer().get_tensor = lambda shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype)
tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
out = {}
heads, d = 4, 64
for fp32 in (False, True):
    for dropout in (0.0, 0.1):
        cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, kv_channels=d,
                                attention_dropout=dropout, attention_softmax_in_fp32=fp32,
                                masked_softmax_fusion=False, bf16=True, params_dtype=torch.bfloat16)
        attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        per_s = {}
        for s in (128, 256):
            q, k, v = (torch.randn(s, 1, heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]   # shared by every layer
            skip = {t.untyped_storage().data_ptr() for t in (q, k, v, mask)}
            with saved_bytes_of(skip) as counted:
                attn(q, k, v, attention_mask=mask, attn_mask_type=AttnMaskType.causal)
            per_s[s] = counted.total / (heads * s * s)
        out[f"{int(fp32)}{int(dropout > 0)}"] = per_s
print(json.dumps(out))
"""


@pytest.mark.slow   # Megatron's layers run forward and backward on CPU
def test_unfused_attention_keeps_what_the_memory_model_counts():
    """Megatron's local DotProductAttention (the unfused path a stock pretrain_gpt.py takes with
    --transformer-impl local) keeps S x S tensors for its backward: per head and score element,
    memory.UNFUSED_SCORE_BYTES by softmax precision and attention dropout, at two lengths."""
    from megatron_skill.core.memory import UNFUSED_SCORE_BYTES

    proc = subprocess.run([sys.executable, "-c", COUNT_UNFUSED], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(proc.stdout.strip().splitlines()[-1])
    for (fp32, dropout), expected in UNFUSED_SCORE_BYTES.items():
        per_s = counted[f"{int(fp32)}{int(dropout)}"]
        assert per_s["128"] == per_s["256"] == expected, (fp32, dropout, per_s)
