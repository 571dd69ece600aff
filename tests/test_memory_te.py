"""What Transformer Engine's layers keep beyond what Megatron-Core's local layers keep, and the
buffers TE allocates outside torch's allocator (core/memory.py): TE's core attention keeps its
own contiguous V and lets the QKV output go; --tp-comm-overlap's userbuffers. TE does not run
on the machines we have: the V test checks, on Megatron-Core's real split, the layout that makes
TE copy V (its get_qkv_layout, TE 2.8 to 2.13), and the published GB200 run NVIDIA made at this
memory is the check of the whole (tests/test_evidence.py)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_skill.core.catalog import get_model
from megatron_skill.core.layout import Layout
from megatron_skill.core.memory import BF16, FP8, FP32, GIB, MemoryOptions, attention_saved_bytes, stage_memory, userbuffer_bytes
from megatron_skill.core.options import RuntimeOptions

LLAMA405 = get_model("llama3.1-405b")


def test_te_attention_keeps_q_k_v_and_o_where_the_local_layers_keep_the_whole_qkv_output():
    m = LLAMA405
    q = m.num_attention_heads * m.head_dim
    kv = 2 * m.query_groups * m.head_dim
    te = attention_saved_bytes(m, te=True)
    assert te == BF16 * (q + kv + q) + FP32 * m.num_attention_heads    # Q, K, V, O and the log-sum-exp
    # the local path keeps the QKV output whole beside the RoPE'd Q and K: Q and V's share more
    assert attention_saved_bytes(m) - te == BF16 * (q + kv / 2)


def test_te_qk_norm_keeps_each_norms_input():
    qwen = get_model("qwen3-30b-a3b")
    q = qwen.num_attention_heads * qwen.head_dim
    kv = 2 * qwen.query_groups * qwen.head_dim
    assert attention_saved_bytes(qwen, te=True) == BF16 * (q + kv + q + q + kv / 2) + FP32 * qwen.num_attention_heads


def test_the_planners_te_runs_count_te_attention_and_the_local_runs_do_not():
    lay = Layout(tp=4, pp=1, dp=1, mbs=1, gbs=8, seq_length=8192, sequence_parallel=True, precision="bf16")
    te = RuntimeOptions.from_request(None, te=True).memory(lay)
    local = RuntimeOptions.from_request(None, te=False).memory(lay)
    assert te.te_attention and not local.te_attention
    per_token_layer = (attention_saved_bytes(LLAMA405) - attention_saved_bytes(LLAMA405, te=True)) / lay.tp
    layers = LLAMA405.num_layers
    a = stage_memory(LLAMA405, lay, 0, 128256, MemoryOptions(te_attention=True))
    b = stage_memory(LLAMA405, lay, 0, 128256, MemoryOptions())
    assert b.activations - a.activations == pytest.approx(per_token_layer * 8192 * layers)


def test_userbuffers_are_twelve_sequence_by_hidden_buffers_eight_of_them_fp8_under_fp8():
    elements = 8192 * LLAMA405.hidden_size
    fp8 = Layout(tp=4, pp=16, vp=4, dp=4, mbs=1, gbs=1536, seq_length=8192, sequence_parallel=True, precision="fp8")
    assert userbuffer_bytes(LLAMA405, fp8) == elements * (8 * FP8 + 4 * BF16)    # 2 GiB on NVIDIA's GB200 layout
    assert userbuffer_bytes(LLAMA405, fp8) == 2 * GIB
    bf16 = Layout(tp=8, pp=8, cp=2, dp=8, mbs=1, gbs=512, seq_length=8192, sequence_parallel=True, precision="bf16")
    assert userbuffer_bytes(LLAMA405, bf16) == elements / 2 * 12 * BF16          # a CP rank's half of the sequence
    assert userbuffer_bytes(LLAMA405, Layout(tp=1, seq_length=8192, precision="fp8")) == 0
    assert userbuffer_bytes(LLAMA405, Layout(tp=4, seq_length=8192, sequence_parallel=False)) == 0


def test_userbuffers_are_outside_the_allocator_and_only_where_tp_overlap_runs_on_te():
    lay = Layout(tp=4, pp=16, vp=4, dp=4, mbs=1, gbs=1536, seq_length=8192, sequence_parallel=True, precision="fp8")
    on = stage_memory(LLAMA405, lay, 1, 128256, MemoryOptions(tp_comm_overlap=True))
    off = stage_memory(LLAMA405, lay, 1, 128256, MemoryOptions())
    assert on.allocated == off.allocated
    assert on.total - off.total == on.userbuffers == 2 * GIB
    assert on.to_json()["userbuffers_gib"] == 2.0
    assert RuntimeOptions.from_request(None, te=True).memory(lay).tp_comm_overlap
    assert not RuntimeOptions.from_request(None, te=True, megatron={"tp_comm_overlap": False}).memory(lay).tp_comm_overlap
    assert not RuntimeOptions.from_request(None, te=False).memory(lay).tp_comm_overlap


SPLIT = r"""
import json, os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29567")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron_skill.runtime import cpu_loop
m = json.loads(sys.argv[2])
s = 64
model = cpu_loop.build_model({"model": m, "tp": 1, "padded_vocab_size": 128, "seq_length": s}).to(torch.bfloat16)
attn = model.decoder.layers[0].self_attention
query, key, value = attn.get_query_key_value_tensors(torch.randn(s, 1, m["hidden_size"], dtype=torch.bfloat16))
k_rope = torch.empty(key.shape)   # TE's fused RoPE makes K anew: at::empty(input.sizes()), contiguous
print(json.dumps({"v_storage_bytes": value.untyped_storage().nbytes(), "v_contiguous": value.is_contiguous(),
                  "v_strides": [st / value.shape[-1] for st in value.stride()[:-1]],
                  "k_strides": [st / k_rope.shape[-1] for st in k_rope.stride()[:-1]]}))
"""


@pytest.mark.slow   # builds a Megatron-Core layer on CPU in a process of its own
def test_megatron_hands_te_a_v_strided_inside_the_qkv_output_which_te_copies():
    """Megatron-Core's split leaves V a view inside the whole QKV output with strides that are not
    a contiguous K's: TE's get_qkv_layout finds no layout for that (check_strides_kv fails) and
    makes Q, K and V contiguous, so what its attention saves is its own V, and the QKV output is
    not kept (attention_saved_bytes(te=True))."""
    shape = {"num_layers": 1, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 8,
             "num_query_groups": 2, "kv_channels": 32, "vocab_size": 128}
    proc = subprocess.run([sys.executable, "-c", SPLIT, str(ROOT), json.dumps(shape)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    qkv_out = 64 * (8 + 2 * 2) * 32 * BF16      # tokens x (Q + K + V) x head size, bf16
    assert got["v_storage_bytes"] == qkv_out and not got["v_contiguous"]
    assert got["v_strides"] != got["k_strides"]


def test_te_fp8_saves_the_projections_input_once_unless_the_recipe_is_delayed():
    """Under TE's FP8 the linear layers save their inputs as the FP8 copies they multiply; for any
    recipe but delayed Megatron has the attention projection save its bf16 input instead, which
    core attention's output already is (set_save_original_input): one FP8 copy per token and layer
    fewer than the skill's own FP8 layers keep. validate reads the recipe from the script, where
    Megatron's default is delayed."""
    import dataclasses

    from conftest import require_modules
    require_modules("megatron.training")
    from megatron_skill.adapter import arguments
    from megatron_skill.adapter import parser as megatron_parser
    from megatron_skill.adapter.described import runtime_options
    from megatron_skill.core.catalog import get_gpu

    model = get_model("llama3-8b")
    lay = Layout(tp=1, pp=1, dp=8, mbs=1, gbs=64, seq_length=8192, precision="fp8")
    te = RuntimeOptions.from_request(None, te=True)
    planned = stage_memory(model, lay, 0, 128256, te.memory(lay))
    delayed = stage_memory(model, lay, 0, 128256, dataclasses.replace(te, te_fp8_delayed=True).memory(lay))
    assert delayed.activations - planned.activations == pytest.approx(FP8 * model.hidden_size * 8192 * model.num_layers)
    # the copy is of the heads' output, wider than the hidden size in Qwen3 (32 x 128 against 2,048)
    from megatron_skill.core.memory import fp8_linear_saved_bytes
    qwen3 = get_model("qwen3-30b-a3b")
    gap = fp8_linear_saved_bytes(qwen3, lay, True) - fp8_linear_saved_bytes(qwen3, lay, False)
    assert gap == qwen3.num_attention_heads * qwen3.head_dim == 2 * qwen3.hidden_size
    bf16 = dataclasses.replace(lay, precision="bf16")   # (the FP8 flags below, not render's)
    argv = (arguments.model_args(model, 8192) + arguments.layout_args(bf16, model, get_gpu("h100-sxm"))
            + ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"])
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert runtime_options(megatron_parser.parse(argv, world_size=8, env=env)).te_fp8_delayed
    tensorwise = megatron_parser.parse(argv + ["--fp8-recipe", "tensorwise"], world_size=8, env=env)
    assert not runtime_options(tensorwise).te_fp8_delayed
    # a BF16 script: Megatron's recipe default says nothing of its memory
    bf16_args = [a for a in argv if a not in ("--fp8-format", "hybrid")]
    assert not runtime_options(megatron_parser.parse(bf16_args, world_size=8, env=env)).te_fp8_delayed
