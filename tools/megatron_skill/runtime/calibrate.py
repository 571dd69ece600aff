"""Measure what the step-time model needs on this GPU: GEMM, attention and HBM efficiency.

Each figure is a fraction of the catalog's dense peak (or HBM bandwidth), measured with
CUDA events over repeated runs after a warm-up: large and transformer-shaped bf16 GEMMs,
FP8 GEMMs through torch._scaled_mm (per-tensor scales) on Hopper or newer, causal SDPA
attention forward + backward (counted as Megatron counts it), and a device-to-device copy.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F


def cuda_time(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds of fn on the GPU, timed with CUDA events after warm-up calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemm(m: int, n: int, k: int, dtype: str) -> float:
    """TFLOP/s of an (m x k) @ (k x n) product."""
    dev = "cuda"
    if dtype == "fp8":
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        fn = lambda: a @ b  # noqa: E731
    return 2 * m * n * k / cuda_time(fn) / 1e12


def attention(batch: int, heads: int, groups: int, seq: int, dim: int, backend: str | None = None,
              gqa: str = "expand") -> float:
    """TFLOP/s of causal SDPA forward + backward, counted as Megatron counts it (3 x 2 s^2 h d / 2 x 2).

    backend: an SDPBackend name (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION) or None for
    torch's choice; gqa: "expand" repeats keys and values to the query heads, "native" passes
    enable_gqa.  Returns 0.0 when the backend refuses the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = heads if gqa == "expand" else groups
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kv, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    def step():
        if backend:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
        out.backward(g)

    flops = 3 * 2 * batch * seq * seq * heads * dim  # fwd: 2 GEMMs x 2 FMA x s^2/2 causal; x3 fwd+bwd
    try:
        return flops / cuda_time(step, iters=10) / 1e12
    except RuntimeError:
        return 0.0


def attention_backends() -> dict[str, float]:
    """Each SDPA backend, K/V expanded or native GQA, on the attention of the 3B shape (b 2,
    24 heads, 8 KV groups, d 128) and the 1B shape (b 4, 32 heads, 8 groups, d 64), s 4096."""
    out = {}
    for tag, (b, heads, groups, d) in (("3b", (2, 24, 8, 128)), ("1b", (4, 32, 8, 64))):
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            for gqa in ("expand", "native"):
                out[f"{tag}_{backend.lower()}_{gqa}"] = round(attention(b, heads, groups, 4096, d, backend, gqa), 1)
    return out


def hbm() -> float:
    """GB/s of a device-to-device copy (read + write)."""
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / cuda_time(lambda: y.copy_(x)) / 1e9


def measure(peak_bf16: float, peak_fp8: float | None, hbm_gbps: float) -> dict[str, Any]:
    shapes = {"square_8192": (8192, 8192, 8192), "qkv_3b": (8192, 5120, 3072), "fc1_3b": (8192, 16384, 3072),
              "fc2_3b": (8192, 3072, 8192), "logits_3b": (8192, 128256, 3072), "fc1_1b": (16384, 16384, 2048)}
    out: dict[str, Any] = {"gemm_bf16_tflops": {k: round(gemm(*s, "bf16"), 1) for k, s in shapes.items()}}
    fp8_ok = peak_fp8 and torch.cuda.get_device_capability() >= (8, 9)
    if fp8_ok:
        out["gemm_fp8_tflops"] = {k: round(gemm(*s, "fp8"), 1) for k, s in shapes.items()}
    out["attention_tflops"] = {f"s{s}_d{d}": round(attention(2, h, h, s, d), 1)
                               for s, h, d in ((4096, 24, 128), (4096, 32, 64), (8192, 32, 128))}
    out["attention_backends_tflops"] = attention_backends()
    out["hbm_gbps"] = round(hbm(), 1)
    big = [v for k, v in out["gemm_bf16_tflops"].items() if k != "square_8192"]
    cal = {"gemm_bf16": round(statistics.median(big) / peak_bf16, 3),
           "attention": round(statistics.median(out["attention_tflops"].values()) / peak_bf16, 3),
           "hbm": round(out["hbm_gbps"] / hbm_gbps, 3)}
    if fp8_ok:
        big8 = [v for k, v in out["gemm_fp8_tflops"].items() if k != "square_8192"]
        cal["gemm_fp8"] = round(statistics.median(big8) / peak_fp8, 3)
    out["calibration"] = cal
    return out
