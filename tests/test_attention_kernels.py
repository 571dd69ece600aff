"""The slower attention kernels a stock script asks for are costed by the step-time model itself:
SDPA over the explicit mask at the measured factor of the causal kernel, the unfused
DotProductAttention from its count of score bytes and FLOPs, never faster than the planned kernel;
the arguments of a log name which kernel ran."""
import dataclasses

import pytest

from megatron_skill.adapter import described
from megatron_skill.core.attention_kernels import MASKED_SDPA_FACTOR, PLANNED, AttentionKernel
from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.flops import padded_vocab_size
from megatron_skill.core.layout import Layout
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import predict

MODEL = get_model("llama3.2-1b")
GPU = get_gpu("h100-sxm")
LAY = Layout(tp=1, pp=2, dp=1, mbs=1, gbs=8, seq_length=4096, precision="bf16")
LOCAL = RuntimeOptions.from_request(None, te=False)


def _step(kernel: AttentionKernel):
    return predict(MODEL, GPU, LAY, padded_vocab_size(MODEL.vocab_size, 1),
                   dataclasses.replace(LOCAL, attention_kernel=kernel)).time


def test_the_masked_kernel_costs_its_measured_factor_and_the_pipeline_carries_it():
    planned, masked = _step(PLANNED), _step(AttentionKernel("sdpa_masked"))
    assert masked.attention == pytest.approx(MASKED_SDPA_FACTOR * planned.attention)
    assert masked.gemm == planned.gemm and masked.bubble > planned.bubble


def test_the_unfused_kernel_grows_with_its_passes_and_is_never_faster_than_planned():
    plain = _step(AttentionKernel("unfused"))
    heavier = _step(AttentionKernel("unfused", fp32_softmax=True, dropout=True))
    assert _step(PLANNED).attention < plain.attention < heavier.attention


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="attention kernel"):
        AttentionKernel("eager")


def test_a_logs_arguments_name_the_kernel():
    stock = described.Args({"transformer_impl": "local", "attention_dropout": 0.0})
    assert described.attention_kernel(stock) == AttentionKernel("unfused", dropout=False)
    masked = described.Args({"transformer_impl": "local", "skill_entry": True})
    assert described.attention_kernel(masked).kind == "sdpa_masked"
    causal = described.Args({"transformer_impl": "local", "skill_entry": True,
                             "create_attention_mask_in_dataloader": False})
    assert described.attention_kernel(causal) == PLANNED
    assert described.attention_kernel(described.Args({"transformer_impl": "transformer_engine"})) == PLANNED
