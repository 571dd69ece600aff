"""The skill's fused paths compute what the plain ones do: values and gradients."""
from conftest import require_modules  # noqa: E402

require_modules('torch', 'megatron.core')

import pytest
import torch
import torch.nn.functional as F

from megatron_skill.runtime.fused_head import LinearCrossEntropy


def _reference(x, w, target, mask, factor):
    logits = (x @ w.t()).float()
    losses = F.cross_entropy(logits.view(-1, w.shape[0]), target.view(-1), reduction="none").view(target.shape)
    return losses, (losses * mask).sum() * factor


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_linear_cross_entropy_matches_linear_then_cross_entropy(dtype, tol, chunk):
    g = torch.Generator().manual_seed(0)
    s, b, h, v = 16, 3, 32, 101
    x0 = torch.randn(s, b, h, generator=g).to(dtype)
    w0 = (torch.randn(v, h, generator=g) * 0.2).to(dtype)
    target = torch.randint(0, v, (s, b), generator=g)
    mask = (torch.rand(s, b, generator=g) > 0.3).float()  # masked tokens must get no gradient
    factor = 1.0 / (mask.sum() * 2)                        # Megatron's 1 / (tokens x micro-batches)

    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref_losses, ref = _reference(x1, w1, target, mask, factor)
    ref.backward()

    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    losses = LinearCrossEntropy.apply(x2, w2, target, mask, None, chunk)
    ((losses * mask).sum() * factor).backward()

    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), rtol=tol, atol=tol * 0.1)
    torch.testing.assert_close(w2.grad.float(), w1.grad.float(), rtol=tol, atol=tol * 0.1)
    assert x2.grad.dtype == dtype and w2.grad.dtype == dtype


def test_linear_cross_entropy_without_gradients_only_computes_the_loss():
    x, w = torch.randn(4, 2, 8), torch.randn(11, 8)
    target, mask = torch.randint(0, 11, (4, 2)), torch.ones(4, 2)
    with torch.no_grad():
        losses = LinearCrossEntropy.apply(x, w, target, mask, None, 3)
    torch.testing.assert_close(losses, _reference(x, w, target, mask, 1.0)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fp32-output GEMM path)")
def test_linear_cross_entropy_on_cuda_at_a_real_vocabulary():
    torch.manual_seed(0)
    s, b, h, v = 1024, 2, 512, 32000
    x0 = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16)
    w0 = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    target = torch.randint(0, v, (s, b), device="cuda")
    mask = torch.ones(s, b, device="cuda")
    factor = 1.0 / mask.sum()
    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref_losses, ref = _reference(x1, w1, target, mask, factor)
    ref.backward()
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    losses = LinearCrossEntropy.apply(x2, w2, target, mask, None, 700)
    ((losses * mask).sum() * factor).backward()
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-2)
    for got, want in ((x2.grad, x1.grad), (w2.grad, w1.grad)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 2e-2, rel


def test_output_processor_runs_the_output_layers_forward_pre_hooks(monkeypatch):
    """Megatron's DDP finishes the weight's all-gather in a forward pre-hook of the output
    layer (--overlap-param-gather); the fused head uses the weight without calling the
    layer, so it must run those hooks itself."""
    from functools import partial
    from types import SimpleNamespace

    from megatron_skill.runtime.fused_head import output_processor

    output_processor = partial(output_processor, chunk_tokens=4)  # 80 tokens in chunks of 4: fused
    layer = torch.nn.Linear(8, 11, bias=False)
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(module))
    hidden = torch.randn(40, 2, 8, requires_grad=True)
    labels, mask = torch.randint(0, 11, (2, 40)), torch.ones(2, 40)
    losses = output_processor(hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels,
                              loss_mask=mask, config=SimpleNamespace(sequence_parallel=False),
                              compute_language_model_loss=None, scale_logits=None)
    assert seen == [layer] and losses.shape == (2, 40)
    ref = F.cross_entropy((hidden @ layer.weight.t()).transpose(0, 1).reshape(-1, 11), labels.reshape(-1),
                          reduction="none").view(2, 40)
    torch.testing.assert_close(losses, ref)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_matmul_is_linear_within_fp8_precision():
    """Forward in E4M3, gradients in E5M2 (the hybrid format), per-tensor current scaling; on CPU
    the quantised values are multiplied in fp32, the same numbers torch._scaled_mm would see."""
    from megatron_skill.runtime.fp8_linear import E4M3, FP8Matmul, quantize

    torch.manual_seed(0)
    x0, w0 = torch.randn(64, 128), torch.randn(96, 128) * 0.05
    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y1 = x1 @ w1.t()
    g = torch.randn_like(y1)
    y1.backward(g)
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y2 = FP8Matmul.apply(x2, w2)
    y2.backward(g)
    assert _rel(y2, y1) < 0.05                       # E4M3: 3 mantissa bits, errors average out
    assert _rel(x2.grad, x1.grad) < 0.1 and _rel(w2.grad, w1.grad) < 0.1   # E5M2 gradients
    assert _rel(y2, y1) > 0                           # it really went through FP8
    q, scale = quantize(x0, E4M3)
    assert q.dtype == E4M3 and float(q.float().abs().max()) <= 448 and scale.shape == ()


def test_fp8_layers_swap_in_only_for_the_dense_linears_and_fall_back_with_tp_communication():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_skill.runtime import specs
    from megatron_skill.runtime.fp8_linear import FP8ColumnParallelLinear, FP8RowParallelLinear, _fp8_ok

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    from megatron_skill.core.options import RuntimeOptions

    layer = specs.local_sdpa_spec(RuntimeOptions.from_request({"fp8_linear": True}, te=False))
    attn, mlp = layer.submodules.self_attention.submodules, layer.submodules.mlp.keywords["submodules"]
    assert attn.linear_qkv is FP8ColumnParallelLinear and attn.linear_proj is FP8RowParallelLinear
    assert mlp.linear_fc1 is FP8ColumnParallelLinear and mlp.linear_fc2 is FP8RowParallelLinear
    plain = specs.local_sdpa_spec(RuntimeOptions.from_request(None, te=False))
    assert plain.submodules.mlp.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    x, w = torch.randn(32, 64), torch.randn(128, 64, requires_grad=True)
    assert _fp8_ok(x, w, {"sequence_parallel": False, "allreduce_dgrad": False})
    assert not _fp8_ok(x, w, {"sequence_parallel": True})          # TP communication inside: BF16 path
    assert not _fp8_ok(x, w, {"allreduce_dgrad": True})
    assert not _fp8_ok(torch.randn(30, 64), w, {})                  # tokens not a multiple of 16
    del cfg


def test_small_micro_batches_take_megatrons_own_output_layer_and_loss():
    """Where the fused path's fp32 weight gradient would outweigh the logits it saves, Megatron's
    path runs (core.memory.fused_head_runs: the memory model and step time say the same)."""
    from types import SimpleNamespace

    from megatron_skill.runtime.fused_head import output_processor

    calls = []

    def output_layer(h, weight=None, runtime_gather_output=None):
        calls.append("layer")
        return h @ torch.ones(h.shape[-1], 3), None

    def loss(labels, logits):
        calls.append("loss")
        return torch.zeros(labels.shape)

    out = output_processor(hidden_states=torch.randn(5, 2, 4), output_layer=output_layer, output_weight=None,
                           labels=torch.zeros(2, 5, dtype=torch.long), loss_mask=torch.ones(2, 5),
                           config=SimpleNamespace(sequence_parallel=False), compute_language_model_loss=loss,
                           scale_logits=lambda x: x)
    assert calls == ["layer", "loss"] and out.shape == (2, 5)


# ---- compiled kernels: the same values as the eager functions they compile --------------
def test_compiled_loss_chunk_kernels_match_eager_and_reference():
    """The fused head's per-chunk softmax statistics and gradient, torch.compile'd (the default
    path), against the same functions eager and against torch's own softmax."""
    from megatron_skill.runtime import compiled
    from megatron_skill.runtime.fused_head import chunk_grad, chunk_stats

    assert compiled.enabled()
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(24, 300, generator=g) * 4).to(torch.bfloat16)
    idx = torch.randint(0, 300, (24,), generator=g)
    here = torch.rand(24, generator=g) > 0.2          # some targets belong to another TP rank
    mask = (torch.rand(24, generator=g) > 0.3).float()
    m, s, t = chunk_stats(logits, idx, here)
    m0, s0, t0 = chunk_stats.eager(logits, idx, here)
    for a, b in ((m, m0), (s, s0), (t, t0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lf = logits.float()
    torch.testing.assert_close(m + s.log(), torch.logsumexp(lf, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t, lf.gather(1, idx[:, None]).squeeze(1) * here, rtol=0, atol=0)
    grad = chunk_grad(logits, m, s, idx, here, mask)
    ref = (torch.softmax(lf, dim=1) - F.one_hot(idx, 300) * here[:, None]) * mask[:, None]
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(grad, chunk_grad.eager(logits, m, s, idx, here, mask), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kind", ["plain", "interleaved", "partial"])
def test_compiled_rope_matches_megatrons_unfused_rope(dtype, tol, kind):
    """Megatron's own unfused RoPE compiled (runtime/fused_rope.py): forward and gradient
    against the eager function, including interleaved and partial rotary dimensions."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_skill.runtime import fused_rope

    eager = rope_utils._apply_rotary_pos_emb_bshd
    fused_rope.install()
    try:
        fused = rope_utils._apply_rotary_pos_emb_bshd
        assert fused is not eager and fused.eager is eager
        g = torch.Generator().manual_seed(2)
        t0 = torch.randn(32, 2, 4, 16, generator=g).to(dtype)
        freqs = torch.randn(32, 1, 1, 8 if kind == "partial" else 16, generator=g)
        gy = torch.randn(32, 2, 4, 16, generator=g).to(dtype)
        kw = dict(rotary_interleaved=kind == "interleaved", mla_rotary_interleaved=False, mscale=1.0)
        outs = []
        for fn in (eager, fused):
            t = t0.clone().requires_grad_()
            y = fn(t, freqs, **kw)
            y.backward(gy)
            outs.append((y, t.grad))
        (y1, g1), (y2, g2) = outs
        assert y2.dtype == dtype and g2.dtype == dtype
        torch.testing.assert_close(y2, y1, rtol=tol, atol=tol)
        torch.testing.assert_close(g2, g1, rtol=tol, atol=tol)
    finally:
        fused_rope.uninstall()
    assert rope_utils._apply_rotary_pos_emb_bshd is eager


def test_compiled_fp8_quantize_matches_eager_and_lays_out_the_transpose():
    from megatron_skill.runtime.fp8_linear import E4M3, E5M2, quantize, quantize_with_transpose

    torch.manual_seed(3)
    x = torch.randn(48, 80, dtype=torch.bfloat16) * 3
    for dtype in (E4M3, E5M2):
        q, q_t, scale = quantize_with_transpose(x, dtype)
        q0, scale0 = quantize(x, dtype)
        torch.testing.assert_close(scale, scale0)
        assert q.dtype == dtype and q.shape == (48, 80) and q_t.shape == (80, 48) and q_t.is_contiguous()
        assert torch.equal(q.float(), q0.float()) and torch.equal(q_t.float(), q0.float().t())


def test_delayed_scaling_scales_by_the_previous_pass_and_saturates_beyond_it():
    """TE's delayed recipe at history length 1: the first pass scales by its own maximum, each
    later pass by the previous pass's, values beyond that saturate (no NaN), a zero maximum
    scales by one, and each pass records its own maximum for the next."""
    from megatron_skill.runtime.fp8_delayed import DelayedScaling, cast_transpose_amax
    from megatron_skill.runtime.fp8_linear import E4M3, E5M2, MAX, quantize_with_transpose

    torch.manual_seed(5)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    s = DelayedScaling()
    q, q_t, scale = s.quantize(x, E4M3)
    q0, _, scale0 = quantize_with_transpose(x, E4M3)
    assert torch.equal(q.float(), q0.float()) and torch.equal(scale, scale0)
    big = x * 4
    q, q_t, scale = s.quantize(big, E4M3)
    torch.testing.assert_close(scale, x.float().abs().amax() / MAX[E4M3])     # the previous pass's
    assert not torch.isnan(q.float()).any() and q.float().abs().max() == MAX[E4M3]
    assert (q.float().abs() == MAX[E4M3]).sum() > 1                           # saturated, not wrapped
    assert torch.equal(q_t.float(), q.float().t()) and q_t.is_contiguous()
    torch.testing.assert_close(s.amax, big.float().abs().amax())              # this pass's, for the next
    q, _, scale = s.quantize(x, E4M3)
    torch.testing.assert_close(scale, big.float().abs().amax() / MAX[E4M3])
    zero = torch.zeros((), dtype=torch.float32)
    _, _, scale, amax = cast_transpose_amax(x, zero, E5M2)
    assert float(scale) == 1.0 and float(amax) == float(x.float().abs().max())
    _, _, scale, _ = cast_transpose_amax(x, torch.tensor(float("inf")), E5M2)
    assert float(scale) == 1.0


def test_fp8_matmul_with_delayed_scaling_stays_linear_over_passes():
    from megatron_skill.runtime.fp8_delayed import LayerScaling
    from megatron_skill.runtime.fp8_linear import FP8Matmul

    torch.manual_seed(6)
    w0 = torch.randn(96, 128) * 0.05
    scaling = LayerScaling()
    for step in range(3):
        x0 = torch.randn(64, 128) * (1 + 0.1 * step)
        x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y1 = x1 @ w1.t()
        g = torch.randn_like(y1)
        y1.backward(g)
        x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y2 = FP8Matmul.apply(x2, w2, scaling)
        y2.backward(g)
        assert _rel(y2, y1) < 0.05 and 0 < _rel(x2.grad, x1.grad) < 0.1 and _rel(w2.grad, w1.grad) < 0.1
    assert scaling.x.amax is not None and scaling.g.amax is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel)")
def test_delayed_scaling_kernel_matches_torch_on_cuda():
    from megatron_skill.runtime import fp8_delayed
    from megatron_skill.runtime.fp8_linear import E4M3, E5M2

    torch.manual_seed(7)
    for m, n in ((4096, 2048), (1000, 200)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
        prev = x.float().abs().amax() * 0.5
        for dtype in (E4M3, E5M2):
            got = fp8_delayed._cast_transpose_amax_triton(x, prev, dtype)
            want = fp8_delayed.cast_transpose_amax(x.cpu(), prev.cpu(), dtype)
            for a, b in zip(got, want):
                assert torch.equal(a.float().cpu(), b.float())


def test_native_gqa_attention_matches_expanded_keys_and_values():
    """SDPA reading the shared key/value heads itself (enable_gqa) against the expansion."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_skill.runtime import attention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    g = torch.Generator().manual_seed(4)
    q0 = torch.randn(16, 2, 8, 8, generator=g)
    k0, v0 = torch.randn(16, 2, 2, 8, generator=g), torch.randn(16, 2, 2, 8, generator=g)
    outs = []
    for native in (False, True):
        attn = attention.SDPAttention(cfg, 1, AttnMaskType.causal, native_gqa=native)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attn(q, k, v, None)
        out.pow(2).sum().backward()
        outs.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fp8_weight_copies_are_reused_within_a_step_and_dropped_by_the_optimizer_step():
    """With the per-step cache on (the entry script's FP8 path), a weight is cast once for all
    micro-batches of a step, and the optimizer's step empties the cache through torch's own
    optimizer hook, whatever loop calls it: Megatron's optimizers (which need CUDA to build)
    step a torch optimizer inside, as this test's AdamW steps here. After the step the next
    micro-batch casts the new weights."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_skill.runtime import fp8_linear

    torch.manual_seed(5)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    layer = fp8_linear.FP8ColumnParallelLinear(64, 48, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                               gather_output=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5)
    x = torch.randn(32, 1, 64)
    fp8_linear.WEIGHT_CACHE.enable()
    try:
        first = layer(x)[0]
        cached = next(iter(fp8_linear.WEIGHT_CACHE.entries.values()))[0]
        layer(x)[0].sum().backward()                    # a second micro-batch: the same FP8 copy
        assert len(fp8_linear.WEIGHT_CACHE.entries) == 1
        assert next(iter(fp8_linear.WEIGHT_CACHE.entries.values()))[0] is cached
        optimizer.step()                                 # the weights change
        assert not fp8_linear.WEIGHT_CACHE.entries       # and their FP8 copies are gone
        after = layer(x)[0]
        expected = fp8_linear.FP8Matmul.apply(x.view(32, 64), layer.weight.detach()).view(32, 1, 48)
        assert not torch.allclose(after, first) and torch.equal(after, expected)
    finally:
        fp8_linear.WEIGHT_CACHE.disable()
    layer(x)
    assert not fp8_linear.WEIGHT_CACHE.entries           # off again: nothing kept


WGRAD = r"""
import json, os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:29562")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_skill.runtime import wgrad_accum

installed = wgrad_accum.install()
out = {"installed": installed}
for fused in (False, True):
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            gradient_accumulation_fusion=fused, params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False)
    fc2 = RowParallelLinear(96, 64, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                            input_is_parallel=True, skip_bias_add=True)
    for p in (fc1.weight, fc2.weight):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)   # what Megatron's DDP attaches
    grads_x, hook_adds = [], 0
    for mb in range(2):                                              # two micro-batches accumulate
        x = torch.randn(16, 2, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(mb),
                        requires_grad=True)
        y, _ = fc2(fc1(x)[0])
        y.float().square().mean().backward()
        for p in (fc1.weight, fc2.weight):
            if p.grad is not None:                                   # DDP's hook: add, then drop
                hook_adds += 1
                p.main_grad.add_(p.grad)
                p.grad = None
        grads_x.append(x.grad.float().tolist())
    out[str(fused)] = {"main_grad": [fc1.weight.main_grad.tolist(), fc2.weight.main_grad.tolist()], "grad_x": grads_x,
                       "hook_adds": hook_adds}
print(json.dumps(out))
"""


def test_gradient_accumulation_fusion_stand_in_matches_megatrons_unfused_layers():
    """Megatron's own linear layers with gradient_accumulation_fusion on, through the skill's
    stand-in for apex's kernel: over two micro-batches the fp32 main_grad holds what the
    unfused layers' bf16 gradients add up to, and the input gradients are the same."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", WGRAD, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"]
    plain, fused = out["False"], out["True"]
    assert plain["hook_adds"] == 4 and fused["hook_adds"] == 0   # the GEMM itself added into main_grad
    torch.testing.assert_close(torch.tensor(fused["grad_x"]), torch.tensor(plain["grad_x"]), rtol=0, atol=0)
    for got, want in zip(fused["main_grad"], plain["main_grad"]):
        got, want = torch.tensor(got), torch.tensor(want)
        assert got.abs().sum() > 0
        # plain: each micro-batch's gradient rounded to bf16 before the fp32 add; fused: fp32 throughout
        assert _rel(got, want) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.addmm with an fp32 output)")
def test_wgrad_accumulation_into_fp32_on_cuda_is_the_fp32_product():
    from megatron_skill.runtime.wgrad_accum import wgrad_gemm_accum_fp32

    torch.manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(1024, 2048, device="cuda")
    want = acc + g.float().t() @ x.float()
    wgrad_gemm_accum_fp32(x, g, acc)
    assert acc.dtype == torch.float32
    assert _rel(acc, want) < 1e-5


def _ddp_weight(w0, tied=False, grad_dtype=torch.float32):
    """A weight as Megatron's DDP leaves it: a main_grad, the flag, and DDP's own backward
    hook (DistributedDataParallel._make_backward_post_hook) on its grad accumulator."""
    from types import SimpleNamespace

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    w = w0.clone().requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(w0.shape, dtype=grad_dtype), False
    if tied:
        w.zero_out_wgrad = True
    ddp = SimpleNamespace(param_to_bucket_group={w: None}, ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    grad_acc = w.expand_as(w).grad_fn.next_functions[0][0]
    grad_acc.register_hook(DistributedDataParallel._make_backward_post_hook(ddp, w))
    _GRAD_ACCS.append(grad_acc)              # kept alive, as DDP keeps its own (else autograd makes a new one)
    return w


_GRAD_ACCS: list = []


@pytest.mark.parametrize("grad_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("h,deferred", [(8, False), (12, True)])
def test_the_fused_head_adds_its_weight_gradient_into_megatrons_main_grad(h, deferred, tied, grad_dtype, tol):
    """Under gradient-accumulation fusion the output weight carries an fp32 main_grad: the fused
    head adds its gradient there itself and hands autograd a placeholder, as Megatron's own layers
    do under that fusion; Megatron's real backward hook then adds nothing, or, where the weight is
    the embedding's too (zero_out_wgrad), the lookup's gradient on top of zeros. Over two
    micro-batches main_grad is the plain path's gradient, in an fp32 main_grad or a bf16 one
    (--grad-reduce-in-bf16: Megatron's layers then add in bf16 too), whether the head accumulates
    the gradient in the forward or forms it in the backward from the kept logit gradients (fewer
    tokens than twice the hidden size)."""
    from types import SimpleNamespace

    from megatron_skill.core.memory import fused_head_chunk, fused_head_defers_wgrad
    from megatron_skill.runtime.fused_head import output_processor

    s, b, v = 8, 2, 101
    assert fused_head_defers_wgrad(s * b, h) == deferred and fused_head_chunk(s * b, h, v, 4)
    w0 = torch.randn(v, h, generator=torch.Generator().manual_seed(1)) * 0.3
    batches = [(torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(10 + i)),
                torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(20 + i)),
                (torch.rand(b, s, generator=torch.Generator().manual_seed(30 + i)) > 0.2).float()) for i in range(2)]
    proj = torch.randn(h, h, generator=torch.Generator().manual_seed(2)) * 0.3

    def hidden_of(w, tokens):
        emb = F.embedding(tokens, w) if tied else torch.randn(b, s, h, generator=torch.Generator().manual_seed(3))
        return torch.tanh(emb @ proj).transpose(0, 1).contiguous()          # [s, b, h] as GPTModel hands it

    def loss_of(losses, mask):                                               # the skill's loss_func, then Megatron's scaling
        return (losses * mask).sum() / mask.sum() / len(batches)

    ref_w = w0.clone().requires_grad_()
    for tokens, labels, mask in batches:
        logits = hidden_of(ref_w, tokens) @ ref_w.t()
        losses = F.cross_entropy(logits.view(-1, v), labels.t().reshape(-1), reduction="none").view(s, b).t()
        loss_of(losses, mask).backward()

    w = _ddp_weight(w0, tied, grad_dtype)
    config = SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=True)
    for tokens, labels, mask in batches:
        losses = output_processor(hidden_states=hidden_of(w, tokens), output_layer=torch.nn.Identity(), output_weight=w,
                                  labels=labels, loss_mask=mask, config=config,
                                  compute_language_model_loss=None, scale_logits=None, chunk_tokens=4)
        loss_of(losses, mask).backward()
    assert w.grad is None and w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad.float(), ref_w.grad, rtol=tol, atol=tol * 0.1)


@pytest.mark.parametrize("deferred", [False, True])
def test_the_forwards_weight_gradient_is_freed_before_the_placeholder_is_allocated(monkeypatch, deferred):
    """At the head's backward the model's activations are all alive: the peak.  The fp32 sum or
    the logit gradients the forward kept are dropped once added into main_grad, before the
    weight-sized placeholder for autograd is allocated (core.memory.fused_head_bytes counts them
    apart).  A 3B FP8 run ran out of memory allocating that placeholder beside them."""
    import weakref

    from megatron_skill.runtime import fused_head

    v, h, n = 11, 4, 6
    kept = torch.randn(n, v) if deferred else torch.randn(v, h)
    pending = fused_head.PendingWeightGrad(None if deferred else kept, kept if deferred else None)
    pending.x, pending.factor = torch.randn(n, h), torch.tensor(0.5)
    alive = weakref.ref(kept)
    del kept
    w = _ddp_weight(torch.randn(v, h))
    seen = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: seen.append(alive() is None) or empty(*a, **k))
    placeholder = fused_head.weight_grad(w, True, pending)
    assert seen == [True] and placeholder.shape == (v, h) and w.grad_added_to_main_grad


def test_a_second_backward_through_the_fused_head_is_refused_not_silent():
    """Its weight gradient is dropped once formed: a second backward over a retained graph would
    hand none; it raises instead."""
    w = torch.randn(11, 4, requires_grad=True)
    x = torch.randn(6, 1, 4, requires_grad=True)
    losses = LinearCrossEntropy.apply(x, w, torch.randint(0, 11, (6, 1)), torch.ones(6, 1), None, 4)
    losses.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        losses.sum().backward()


def test_without_the_fusion_a_fused_and_a_megatron_micro_batch_both_reach_main_grad():
    """Without gradient-accumulation fusion the fused head hands its gradient to DDP's hook, as
    Megatron's output layer does: in one iteration whose second micro-batch is too small for the
    fused path (Megatron's layer takes it, returning its gradient), both reach main_grad; a head
    that set DDP's flag itself would have the hook skip the second. A frozen output weight gets
    nothing."""
    from types import SimpleNamespace

    from megatron_skill.core.memory import fused_head_chunk
    from megatron_skill.runtime.fused_head import output_processor

    h, v = 16, 37
    w0 = torch.randn(v, h, generator=torch.Generator().manual_seed(1)) * 0.3
    micro = [(torch.randn(n, 1, h, generator=torch.Generator().manual_seed(10 + n)),
              torch.randint(0, v, (1, n), generator=torch.Generator().manual_seed(20 + n))) for n in (64, 2)]
    assert [fused_head_chunk(x.shape[0], h, v, 4) for x, _ in micro] == [4, 0]

    def ce(labels, logits):                                                  # Megatron's per-token losses [b, s]
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, v), labels.reshape(-1), reduction="none").view(labels.shape)

    class OutputLayer(torch.nn.Module):                                      # Megatron's, without the fusion: a real gradient
        def forward(self, x, weight=None, runtime_gather_output=None):
            return x @ weight.t(), None

    ref = w0.clone().requires_grad_()
    for x, y in micro:
        ce(y, x @ ref.t()).sum().backward()
    config = SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=False)
    w = _ddp_weight(w0)
    for x, y in micro:
        output_processor(hidden_states=x, output_layer=OutputLayer(), output_weight=w, labels=y,
                         loss_mask=torch.ones(y.shape), config=config, compute_language_model_loss=ce,
                         scale_logits=lambda logits: logits, chunk_tokens=4).sum().backward()
    assert not w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad, ref.grad, rtol=1e-5, atol=1e-6)

    frozen = _ddp_weight(w0)
    frozen.requires_grad_(False)
    x = micro[0][0].clone().requires_grad_()
    fused_config = SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=True)
    output_processor(hidden_states=x, output_layer=OutputLayer(), output_weight=frozen, labels=micro[0][1],
                     loss_mask=torch.ones(micro[0][1].shape), config=fused_config, compute_language_model_loss=ce,
                     scale_logits=lambda logits: logits, chunk_tokens=4).sum().backward()
    assert x.grad is not None and not frozen.grad_added_to_main_grad and not frozen.main_grad.any()
