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


def test_output_processor_runs_the_output_layers_forward_pre_hooks():
    """Megatron's DDP finishes the weight's all-gather in a forward pre-hook of the output
    layer (--overlap-param-gather); the fused head uses the weight without calling the
    layer, so it must run those hooks itself."""
    from types import SimpleNamespace

    from megatron_skill.runtime.fused_head import output_processor

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
