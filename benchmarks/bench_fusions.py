#!/usr/bin/env python3
"""Time each fused path of the skill's local layers against the plain one, alone, on one GPU.

    python benchmarks/bench_fusions.py [OUT.json]      # needs CUDA; the 1B shape's tensors

The prediction for a throughput lever, before the training run measures it: forward +
backward milliseconds of one micro-batch's worth of work (4 x 4096 tokens; hidden 2048,
32 heads of 64, 8 KV groups, vocabulary 128256), median of 20 after 5 warm-up calls.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_skill.runtime.calibrate import cuda_time  # noqa: E402

S, B, HEADS, GROUPS, D, HIDDEN, VOCAB, CHUNK = 4096, 4, 32, 8, 64, 2048, 128256, 4096


def timed(fn, reps: int = 20, warm: int = 5) -> float:
    """Median milliseconds of fn on the GPU (the calibration's CUDA-event timer)."""
    return round(cuda_time(fn, reps, warm) * 1e3, 3)


def rope() -> dict:
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_skill.runtime import compiled

    eager = rope_utils._apply_rotary_pos_emb_bshd
    fused = compiled.kernel(eager)
    freqs = torch.randn(S, 1, 1, D, device="cuda")
    q = torch.randn(S, B, HEADS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(S, B, GROUPS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run(fn):
        def step():
            out = fn(q, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0)
            out2 = fn(k, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0)
            torch.autograd.backward([out, out2], [torch.ones_like(out), torch.ones_like(out2)])
        return step
    return {"eager_ms": timed(run(eager)), "compiled_ms": timed(run(fused))}


def attention() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(S, B, HEADS, D, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()
    k = torch.randn(S, B, GROUPS, D, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()
    v = torch.randn(S, B, GROUPS, D, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()
    out = {}
    for backend in ("auto", "cudnn", "flash", "efficient"):
        for native in (False, True):
            def step(native=native):
                kk, vv = (k, v) if native else (k.repeat_interleave(HEADS // GROUPS, 1),
                                                v.repeat_interleave(HEADS // GROUPS, 1))
                y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=native)
                y.backward(torch.ones_like(y))
            name = f"{backend}_{'native_gqa' if native else 'expanded'}_ms"
            try:
                if backend == "auto":
                    out[name] = timed(step)
                else:
                    enum = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                            "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
                    with sdpa_kernel([enum]):
                        out[name] = timed(step)
            except RuntimeError as e:
                out[name] = f"not supported: {str(e).splitlines()[0][:120]}"
    return out


def loss_chunks() -> dict:
    from megatron_skill.runtime.fused_head import chunk_grad, chunk_stats

    logits = torch.randn(CHUNK, VOCAB, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, VOCAB, (CHUNK,), device="cuda")
    here = torch.ones(CHUNK, dtype=torch.bool, device="cuda")
    mask = torch.ones(CHUNK, device="cuda")

    def run(stats, grad):
        def step():
            m, s, t = stats(logits, idx, here)
            grad(logits, m, s, idx, here, mask)
        return step

    def previous():  # the in-place eager chain the fused head ran before (fp32 copy of the chunk)
        lf = logits.float()
        row_max = lf.max(dim=-1).values
        lf.sub_(row_max.unsqueeze(1))
        (lf.gather(1, idx.unsqueeze(1)) * here.unsqueeze(1)).squeeze(1)
        p = lf.exp_()
        se = p.sum(dim=-1)
        p.div_(se.unsqueeze(1))
        p.scatter_add_(1, idx.unsqueeze(1), -here.unsqueeze(1).to(p.dtype))
        p.mul_(mask.unsqueeze(1))
        p.to(torch.bfloat16)
    return {"per_chunk_tokens": CHUNK, "previous_eager_ms": timed(previous),
            "eager_ms": timed(run(chunk_stats.eager, chunk_grad.eager)),
            "compiled_ms": timed(run(chunk_stats, chunk_grad))}


def fp8_quantize() -> dict:
    from megatron_skill.runtime.fp8_linear import E4M3, quantize, quantize_with_transpose

    x = torch.randn(S * B, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def previous():  # quantize, then the transposed copy the backward GEMM needs
        q, _ = quantize(x, E4M3)
        q.t().contiguous()
    return {"shape": [S * B, HIDDEN], "eager_ms": timed(previous),
            "compiled_ms": timed(lambda: quantize_with_transpose(x, E4M3))}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "bench_fusions needs a CUDA GPU"}))
        return 5
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (("rope", rope), ("attention", attention), ("loss_chunk", loss_chunks),
                     ("fp8_quantize", fp8_quantize)):
        print(f"bench_fusions: {name}", file=sys.stderr, flush=True)
        res[name] = fn()
    text = json.dumps(res, indent=1)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
