"""The skill's fused paths compute what the plain ones do: values and gradients."""
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
    from types import SimpleNamespace

    from megatron_skill.runtime import fused_head
    from megatron_skill.runtime.fused_head import output_processor

    monkeypatch.setattr(fused_head, "CHUNK_TOKENS", 4)  # 10 tokens: more than two chunks, fused
    layer = torch.nn.Linear(8, 11, bias=False)
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(module))
    hidden = torch.randn(5, 2, 8, requires_grad=True)
    labels, mask = torch.randint(0, 11, (2, 5)), torch.ones(2, 5)
    losses = output_processor(hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels,
                              loss_mask=mask, config=SimpleNamespace(sequence_parallel=False),
                              compute_language_model_loss=None, scale_logits=None)
    assert seen == [layer] and losses.shape == (2, 5)
    ref = F.cross_entropy((hidden @ layer.weight.t()).transpose(0, 1).reshape(-1, 11), labels.reshape(-1),
                          reduction="none").view(2, 5)
    torch.testing.assert_close(losses, ref)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_matmul_is_linear_within_fp8_precision():
    """Forward in E4M3, gradients in E5M2 (the hybrid format), per-tensor current scaling; on CPU
    the quantised values are multiplied in fp32, the same numbers torch._scaled_mm would see."""
    from megatron_skill.runtime.fp8_linear import FP8Matmul, quantize, E4M3

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
    specs.FP8_LINEAR = True
    try:
        layer = specs.local_sdpa_spec()
    finally:
        specs.FP8_LINEAR = False
    attn, mlp = layer.submodules.self_attention.submodules, layer.submodules.mlp.keywords["submodules"]
    assert attn.linear_qkv is FP8ColumnParallelLinear and attn.linear_proj is FP8RowParallelLinear
    assert mlp.linear_fc1 is FP8ColumnParallelLinear and mlp.linear_fc2 is FP8RowParallelLinear
    assert specs.local_sdpa_spec().submodules.mlp.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    x, w = torch.randn(32, 64), torch.randn(128, 64, requires_grad=True)
    assert _fp8_ok(x, w, {"sequence_parallel": False, "allreduce_dgrad": False})
    assert not _fp8_ok(x, w, {"sequence_parallel": True})          # TP communication inside: BF16 path
    assert not _fp8_ok(x, w, {"allreduce_dgrad": True})
    assert not _fp8_ok(torch.randn(30, 64), w, {})                  # tokens not a multiple of 16
    del cfg


def test_small_micro_batches_take_megatrons_own_output_layer_and_loss():
    """At two chunks or fewer the fp32 weight gradient of the fused path would outweigh the
    logits it saves: Megatron's path runs (and the memory model says the same)."""
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
