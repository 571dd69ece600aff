"""What the H100 measurements of 2026-12-06 taught the planner, each as a check that fails on the
code before them: the optimizer step's temporaries (a 3B FP8 run ran out of memory there), the
fused head's memory rule and the cost of Megatron's own loss (the 3B and Qwen2.5-1.5B shapes ran
it), the memory outside PyTorch's pool, torch's fused AdamW as the runtime steps it, and the H100
calibration reproduced from its stored measurements."""
import json
import sys

import pytest
from conftest import ROOT, require_modules

from megatron_skill.core import timing
from megatron_skill.core.catalog import get_gpu
from megatron_skill.core.flops import padded_vocab_size
from megatron_skill.core.layout import Layout
from megatron_skill.core.memory import (
    GIB,
    fused_head_bytes,
    fused_head_chunk,
    fused_head_defers_wgrad,
    fused_head_runs,
    memory_report,
    peak,
)
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import predict, search
from megatron_skill.core.resolve import resolve_model
from megatron_skill.core.timing import MEGATRON_LOSS_BYTES_PER_LOGIT, calibration

H100 = get_gpu("h100-sxm")
REQUESTS = ROOT / "benchmarks" / "requests"
MODEL_3B = resolve_model(json.loads((REQUESTS / "llama-3b-shape-bf16.json").read_text()))
QWEN = resolve_model({"hf_config": str(REQUESTS / "hf" / "qwen2.5-1.5b" / "config.json")})
# the planner's first 3B FP8 layout before: it ran out of memory on the H100 twice
OOM_LAYOUT = Layout(tp=1, pp=1, dp=1, mbs=1, gbs=16, seq_length=4096, precision="fp8", recompute="selective")


def _local(**runtime) -> RuntimeOptions:
    return RuntimeOptions.from_request(runtime, te=False)


def _stage(model, lay, opts):
    return memory_report(model, lay, padded_vocab_size(model.vocab_size, lay.tp), opts.memory(lay))["last_stage"]


def test_torchs_multi_tensor_adam_keeps_a_four_byte_temporary_per_parameter_at_the_step():
    foreach = _stage(MODEL_3B, OOM_LAYOUT, _local(fused_adam=False))
    fused = _stage(MODEL_3B, OOM_LAYOUT, _local())
    # sqrt(exp_avg_sq) of the whole shard (DP 1: every parameter), plus the largest gradient's
    # scaled copy (Megatron's clipping without TE or apex): the embedding, 128256 x 3072 in fp32
    clip = 4 * 128256 * 3072
    # (the clipping frees its copies before Adam allocates its own: the larger of the two)
    assert foreach.step_transient == pytest.approx(4 * foreach.params)
    assert fused.step_transient == pytest.approx(clip)
    # the step's temporaries outweigh the activations there: they set the peak
    assert foreach.allocated == pytest.approx(foreach.weights + foreach.gradients + foreach.optimizer
                                              + foreach.step_transient)
    assert foreach.total / GIB > H100.memory_gib    # it ran out of memory in _foreach_sqrt


def test_no_3b_fp8_layout_fits_one_h100_under_torchs_multi_tensor_adam():
    result = search(MODEL_3B, H100, 1, 4096, 16, ["fp8"], None, 0.0, _local(fused_adam=False))
    assert not result.candidates


def test_a_plan_without_the_measured_margin_ranks_after_those_with_it():
    """2026-12-07: with the fused head's smaller footprint the 3B FP8 layout at mbs 1 was
    predicted at 79.25 of 79.6 GiB, ranked first, and ran out of memory in its second iteration
    (references/results/h100-2026-12-07).  It stays a plan (it fits the model), ranked after every
    plan that leaves the margin (catalog/calibration.json, memory.plan_margin_gib) free."""
    from megatron_skill.core.memory import PLAN_MARGIN_GIB
    from megatron_skill.core.planner import rank, tight

    ranked = rank(search(MODEL_3B, H100, 1, 4096, 16, ["fp8"], None, 0.0, _local()).candidates)
    by_label = {c.layout.label(): c for c in ranked}
    ran_out = by_label[OOM_LAYOUT.label()]
    assert tight(ran_out) and H100.memory_gib - ran_out.peak_gib < PLAN_MARGIN_GIB <= 1.6
    first = ranked[0]
    assert not tight(first) and first.tokens_per_s < ran_out.tokens_per_s
    assert ranked.index(ran_out) == sum(not tight(c) for c in ranked)
    # the same layout with the lightest heavier recompute that leaves the margin is a plan too
    roomier = by_label[OOM_LAYOUT.but(recompute="full", recompute_layers=14).label()]
    assert not tight(roomier) and roomier.peak_gib < ran_out.peak_gib
    # the layouts that ran on this card were all predicted with more than the margin left
    ran = Layout(tp=1, pp=1, dp=1, mbs=4, gbs=16, seq_length=4096, precision="fp8", recompute="full", recompute_layers=28)
    assert ran.label() == first.layout.label()


def test_the_layout_that_ran_out_of_memory_is_refused_with_the_memory_outside_pytorch():
    # at the out-of-memory error: 75.45 GiB allocated, 2.8 GiB outside PyTorch's pool, 1.96 GiB asked;
    # its one-sequence micro-batches took Megatron's output layer and loss (the fused head then
    # declined them)
    opts = _local(linear_cross_entropy=False)
    total = peak(memory_report(MODEL_3B, OOM_LAYOUT, 128256, opts.memory(OOM_LAYOUT)))
    assert total > H100.memory_bytes


@pytest.mark.parametrize("tokens,hidden,vocab,deferred,chunk", [
    (8192, 1536, 151936, False, 4096),  # Qwen2.5-1.5B at mbs 2: Megatron's path ran, and cost 12 % of the step
    (16384, 2048, 128256, False, 4096),  # the 1B shape at mbs 4
    # one 4,096-token sequence of the 1B shape: accumulating, the 4,096-token chunk and the fp32
    # weight gradient (1.05 GB) keep 4.2 GB against Megatron's 3.15; 2,048: 2.6 GB
    (4096, 2048, 128256, False, 2048),
    # the 3B shape at mbs 1: its fp32 weight gradient (1.58 GB) outweighs its bf16 logit
    # gradients (1.05 GB), which it keeps instead; in quarter chunks 1.94 GB against Megatron's 3.15
    (4096, 3072, 128256, True, 1024),
    (4096, 4096, 128256, True, 1024),   # an 8B-wide model at mbs 1, likewise: 2.24 GB
    # a small vocabulary under a wide model: without gradient-accumulation fusion the weight-sized
    # bf16 gradient (0.52 GB) is formed beside the logit gradients: 1.06 GB against 0.79
    (4096, 8192, 32000, True, 0),
    (1024, 2048, 128256, True, 0),      # a chunk of the whole micro-batch beside its logit gradients
    (1024, 256, 32000, False, 0),       # a narrow model: the whole micro-batch in one chunk, plus the weight gradient
])
def test_the_fused_head_takes_a_micro_batch_in_the_chunk_that_keeps_less_memory(tokens, hidden, vocab, deferred, chunk):
    """Accumulating the weight gradient in the forward, the largest chunk that keeps less than
    Megatron's logits (each chunk passes over the fp32 buffer); keeping the logit gradients
    instead (fewer tokens than twice the hidden size), the quarter chunk (chunks cost nothing
    more there); 0 where neither keeps less than Megatron's logits.  The peak counts the
    backward's weight-sized bf16 gradient beside what was kept (as it is without the fusion)."""
    assert fused_head_defers_wgrad(tokens, hidden) is deferred
    assert fused_head_chunk(tokens, hidden, vocab) == chunk
    assert fused_head_runs(tokens, hidden, vocab) is bool(chunk)
    megatron = tokens * vocab * 6
    if chunk:
        assert fused_head_bytes(tokens, hidden, vocab, chunk) < megatron
        assert deferred or chunk == 4096 or fused_head_bytes(tokens, hidden, vocab, 2 * chunk) >= megatron
    else:
        assert fused_head_bytes(tokens, hidden, vocab, 1024) >= megatron


def test_megatrons_own_loss_is_charged_where_the_fused_head_leaves_the_micro_batch_to_it():
    # one 1,024-token sequence: a chunk of all of it beside its logit gradients keeps more
    lay = Layout(tp=1, pp=1, dp=1, mbs=1, gbs=16, seq_length=1024)
    assert not fused_head_runs(1024, 3072, 128256)
    c = predict(MODEL_3B, H100, lay, 128256, _local())
    rate = H100.hbm_gbps * 1e9 * calibration("h100-sxm")["hbm"]
    assert c.time.loss == pytest.approx(16 * 1024 * 128256 * MEGATRON_LOSS_BYTES_PER_LOGIT / rate)
    fused = predict(QWEN, H100, Layout(tp=1, pp=1, dp=1, mbs=4, gbs=32, seq_length=4096), 151936, _local())
    # the fused head's loss term: its logit passes and its output weight's gradient (zeroed,
    # accumulated chunk by chunk, added into main_grad) under a quarter of Megatron's loss passes
    assert fused.time.loss < 0.25 * 8 * 16384 * 151936 * MEGATRON_LOSS_BYTES_PER_LOGIT / rate


def test_the_h100_calibration_is_the_fit_of_its_stored_measurements():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fit_calibration

    leases = [ROOT / "references" / "results" / "h100-2026-12-06" / name for name in ("calibration", "calibration-2")]
    calibs = [json.loads((d / "calibrate.json").read_text())["result"] for d in leases]
    runs = [r for d in leases for r in fit_calibration.load_runs(d) if r["profile"]]
    assert len(runs) == 10
    defaults = json.loads((ROOT / "tools" / "megatron_skill" / "core" / "catalog" / "calibration.json").read_text())
    rates = fit_calibration.pooled_rates(calibs)
    fitted = fit_calibration.fit(runs, {**defaults["default"], **rates})
    entry = defaults["gpus"]["h100-sxm"]
    assert set(fitted) == set(fit_calibration.FITTED)
    assert {k: entry[k] for k in fitted} == fitted, "re-fit: python benchmarks/fit_calibration.py ... --store"
    assert {k: entry[k] for k in rates} == rates


def test_the_local_gemm_share_scales_only_the_local_layers_gemms():
    gpu = get_gpu("h100-sxm")
    model = resolve_model({"model": "llama3-8b"})
    lay = Layout(tp=1, pp=1, dp=1, mbs=1, gbs=8, seq_length=4096)
    cal = calibration("h100-sxm")
    saved = dict(cal)
    try:
        local = timing.step_time(model, lay, gpu, 128256, te=False).gemm
        te = timing.step_time(model, lay, gpu, 128256, te=True).gemm
        cal["gemm_local_bf16"] = saved["gemm_local_bf16"] / 2
        timing.clear_caches_keep_calibration()
        assert timing.step_time(model, lay, gpu, 128256, te=False).gemm == pytest.approx(2 * local)
        assert timing.step_time(model, lay, gpu, 128256, te=True).gemm == pytest.approx(te)
    finally:
        cal.clear()
        cal.update(saved)
        timing.clear_caches_keep_calibration()


def test_delayed_fp8_scaling_reads_each_input_once_in_the_skills_layers_only():
    """The casts of the skill's FP8 layers: current scaling reads each GEMM input twice (amax,
    then the cast) and writes it twice in FP8 (6 bytes an element), delayed once (4); TE's layers
    are not the skill's and keep their cost; the flag travels as the entry's own."""
    from megatron_skill.core.options import RuntimeOptions

    gpu = get_gpu("h100-sxm")
    model = resolve_model({"model": "llama3-8b"})
    lay = Layout(tp=1, pp=1, dp=1, mbs=1, gbs=8, seq_length=4096, precision="fp8")
    cur = timing.step_time(model, lay, gpu, 128256, te=False, fp8_linear=True)
    dly = timing.step_time(model, lay, gpu, 128256, te=False, fp8_linear=True, fp8_delayed=True)
    bf16 = timing.step_time(model, lay, gpu, 128256, te=False, fp8_linear=False)
    assert cur.gemm == dly.gemm and dly.elementwise < cur.elementwise
    cast_cur, cast_dly = cur.elementwise - bf16.elementwise, dly.elementwise - bf16.elementwise
    assert cast_dly == pytest.approx(cast_cur * 4 / 6)
    te = timing.step_time(model, lay, gpu, 128256, te=True, fp8_delayed=True)
    assert te.total == timing.step_time(model, lay, gpu, 128256, te=True).total
    flags = RuntimeOptions.from_request({"fp8_linear": True, "fp8_scaling": "delayed"}, te=False).entry_flags()
    assert flags[flags.index("--skill-fp8-scaling") + 1] == "delayed"
    assert "--skill-fp8-scaling" not in RuntimeOptions.from_request({"fp8_linear": True}, te=False).entry_flags()


def test_the_fused_adam_hook_steps_torchs_fused_kernel_like_the_multi_tensor_one():
    require_modules("torch")
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from megatron_skill.runtime import fused_adam

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    opt = torch.optim.AdamW(mine, lr=1e-2, weight_decay=0.1)
    handle = register_optimizer_step_pre_hook(fused_adam._to_fused)
    try:
        for step in range(3):
            grads = [torch.randn_like(p) for p in ref]
            for p, q, g in zip(ref, mine, grads):
                p.grad, q.grad = g.clone(), g.clone()
            if step == 1:   # a checkpoint load leaves the step counter a float64 CPU tensor
                opt.state[mine[0]]["step"] = opt.state[mine[0]]["step"].double()
            opt_ref.step()
            opt.step()
    finally:
        handle.remove()
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert opt.state[mine[0]]["step"].dtype == torch.float32
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p)


def test_a_group_spanning_domains_moves_data_through_each_members_own_nic():
    """NCCL runs a ring per NIC across NVLink domains: eight members a domain send through eight
    NICs at once (up to NVLink's rate); one member a domain through its one NIC; all in one
    domain at NVLink's rate."""
    from megatron_skill.core.timing import _Rates

    rates = _Rates(H100, "bf16", True)
    one_nic = rates.collective(1e9, 64, 1, "ag")
    eight = rates.collective(1e9, 64, 8, "ag")
    assert eight == pytest.approx(one_nic / 8)
    assert rates.collective(1e9, 8, 8, "ag") == pytest.approx(7 / 8 * 1e9 / rates.nvlink)
    # a data-parallel group of 64 at TP 1 over eight nodes: eight members a node
    lay = Layout(tp=1, pp=1, dp=64, mbs=1, gbs=64, seq_length=8192)
    tp8 = Layout(tp=8, pp=1, dp=8, mbs=1, gbs=8, seq_length=8192, sequence_parallel=True)
    from megatron_skill.core.catalog import get_model

    llama = get_model("llama3-8b")
    dp1 = predict(llama, H100, lay, 128256, RuntimeOptions.from_request(None)).time.dp_comm_exposed
    dp8 = predict(llama, H100, tp8, 128256, RuntimeOptions.from_request(None)).time.dp_comm_exposed
    assert dp1 < dp8   # TP 1: eight NICs carry the 64-way reduction; TP 8: one NIC per member


def test_the_step_temporaries_are_those_of_the_optimizer_shard():
    """With the distributed optimizer over DP 4, Adam's temporary covers a quarter of the rank's
    parameters, and the clipping copy at most that shard."""
    import dataclasses

    dp4 = dataclasses.replace(OOM_LAYOUT, dp=4, gbs=64, precision="bf16", recompute="none")
    one = _stage(MODEL_3B, dataclasses.replace(dp4, dp=1, gbs=16), _local(fused_adam=False))
    four = _stage(MODEL_3B, dp4, _local(fused_adam=False))
    assert four.step_transient == pytest.approx(one.step_transient / 4)
    assert _stage(MODEL_3B, dp4, _local()).step_transient == pytest.approx(4 * min(128256 * 3072, four.params / 4))


def test_the_fp32_copy_of_a_bf16_gradient_shard_lives_through_the_step_only():
    """Megatron's distributed optimizer copies bf16 main gradients into fp32 for its shard at the
    step (_copy_model_grads_to_main_grads) and frees them at the next zero_grad, before any
    forward: a step temporary beside Adam's, never beside the activations."""
    import dataclasses

    from megatron_skill.core.memory import BF16, FP32, MemoryOptions, stage_memory

    llama = resolve_model({"model": "llama3-8b"})
    lay = Layout(tp=1, pp=1, dp=8, mbs=1, gbs=64, seq_length=8192)
    fp32 = stage_memory(llama, lay, 0, 128256, MemoryOptions())
    bf16 = stage_memory(llama, lay, 0, 128256, MemoryOptions(grad_bytes=BF16))
    assert bf16.optimizer == pytest.approx(fp32.optimizer)
    shard = fp32.optimizer / 12
    assert bf16.step_transient == pytest.approx(fp32.step_transient + FP32 * shard)
    assert bf16.gradients == pytest.approx(fp32.gradients / 2)
    # at PP 2 the second rank is the last stage (it holds the output layer), named so
    pp2 = memory_report(llama, dataclasses.replace(lay, pp=2, dp=4), 128256)
    assert set(pp2) == {"first_stage", "last_stage"} and pp2["last_stage"].logits > 0


def test_memory_and_step_time_cost_the_chunk_the_runtime_takes():
    """The 3B shape at mbs 1 runs the fused head in 1,024-token chunks, keeping its logit
    gradients for one weight-gradient GEMM in the backward (fused_head_chunk,
    fused_head_defers_wgrad): the memory model keeps what those chunks and gradients keep, the step
    time charges their copy, less than accumulating chunk by chunk into an fp32 buffer would cost;
    accumulating (the 3B shape at mbs 4), a smaller chunk costs its passes over that buffer."""
    lay = Layout(tp=1, pp=1, dp=1, mbs=1, gbs=16, seq_length=4096)
    vocab = padded_vocab_size(MODEL_3B.vocab_size, 1)
    assert fused_head_chunk(4096, 3072, vocab) == 1024
    stage = _stage(MODEL_3B, lay, _local())
    assert stage.logits == pytest.approx(fused_head_bytes(4096, 3072, vocab, 1024))
    rates = timing._Rates(H100, "bf16", te=False)
    st = timing.step_time(MODEL_3B, lay, H100, vocab, te=False, fused_head=True)
    per_micro_batch = (rates.memory_bound(4096 * vocab * timing.FUSED_LOSS_BYTES_PER_LOGIT)
                       + timing._fused_head_weight_grad(rates, 4096, vocab, 3072, 1024, True))
    assert st.loss == pytest.approx(16 * per_micro_batch)
    copy = rates.memory_bound(2 * 2 * 4096 * vocab)
    assert timing._fused_head_weight_grad(rates, 4096, vocab, 3072, 1024, True) == pytest.approx(copy)
    # each accumulating chunk's GEMM reads and writes the whole fp32 buffer: below about 1,024
    # tokens a chunk its bytes outlast its multiply on this GPU, and the chunks' count then shows
    accumulating = [timing._fused_head_weight_grad(rates, 16384, vocab, 3072, c, True) for c in (256, 1024, 4096)]
    assert accumulating[0] > 1.5 * accumulating[2] and copy < accumulating[1] / 2


def test_the_runtime_takes_the_fused_head_by_the_core_rule():
    """runtime/fused_head.py asks core.memory.fused_head_runs: 8 tokens in chunks of 4 with a tiny
    hidden size keep less than the logits, so the fused path runs (the layer's pre-hook fires);
    a rule of its own (more than two chunks) would leave them to Megatron's path."""
    require_modules("torch")
    from functools import partial
    from types import SimpleNamespace

    import torch

    from megatron_skill.runtime.fused_head import output_processor

    assert fused_head_runs(8, 2, 11, chunk=4)
    layer = torch.nn.Linear(2, 11, bias=False)
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(module))
    run = partial(output_processor, chunk_tokens=4)
    losses = run(hidden_states=torch.randn(4, 2, 2, requires_grad=True), output_layer=layer, output_weight=None,
                 labels=torch.randint(0, 11, (2, 4)), loss_mask=torch.ones(2, 4),
                 config=SimpleNamespace(sequence_parallel=False), compute_language_model_loss=None, scale_logits=None)
    assert seen == [layer] and losses.shape == (2, 4)


def test_the_runtime_takes_the_core_rules_smaller_chunk_and_its_loss_and_gradients_stay_exact(monkeypatch):
    """8 tokens offered chunks of 8: a whole-micro-batch chunk keeps more than the logits, half
    of it less (core.memory.fused_head_chunk), so the fused path runs in chunks of 4; its losses
    and gradients are those of the plain logits' cross-entropy."""
    require_modules("torch")
    from types import SimpleNamespace

    import torch

    from megatron_skill.runtime import fused_head

    assert fused_head_chunk(8, 2, 11, chunk=8) == 4
    rows = []
    stats = fused_head.chunk_stats
    monkeypatch.setattr(fused_head, "chunk_stats", lambda logits, *a: rows.append(logits.shape[0]) or stats(logits, *a))
    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 11, bias=False)
    hidden = torch.randn(4, 2, 2, requires_grad=True)
    labels = torch.randint(0, 11, (2, 4))
    losses = fused_head.output_processor(
        hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels, loss_mask=torch.ones(2, 4),
        config=SimpleNamespace(sequence_parallel=False), compute_language_model_loss=None, scale_logits=None,
        chunk_tokens=8)
    assert rows == [4, 4]
    losses.sum().backward()
    got = hidden.grad.clone(), layer.weight.grad.clone()
    hidden.grad, layer.weight.grad = None, None
    want = torch.nn.functional.cross_entropy(layer(hidden).transpose(0, 1).reshape(8, 11), labels.reshape(8),
                                             reduction="none").view(2, 4)
    torch.testing.assert_close(losses, want)
    want.sum().backward()
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], layer.weight.grad)


def test_te_fp8_experts_keep_their_inputs_in_fp8_for_the_backward():
    """TE's grouped GEMMs save the FP8 copies they multiply: per token and routed copy, the
    permuted input (h) and the activation output (the expert FFN) at one byte instead of two;
    not on the local path (its FP8 layers are dense only), not under the MoE recompute."""
    from megatron_skill.core.catalog import get_model
    from megatron_skill.core.memory import MemoryOptions, _layer_acts

    qwen = get_model("qwen3-30b-a3b")
    args = (qwen, 1, False, "none", 4096, 1, 1)
    bf16 = _layer_acts(*args, "bf16", MemoryOptions(te_fp8=True))[1]
    fp8 = _layer_acts(*args, "fp8", MemoryOptions(te_fp8=True))[1]
    assert bf16 - fp8 == pytest.approx(qwen.moe_router_topk * (qwen.hidden_size + qwen.expert_ffn))
    assert _layer_acts(*args, "fp8", MemoryOptions(fp8_linear=True))[1] == pytest.approx(bf16)
    no_act = MemoryOptions(te_fp8=True, recompute_modules=frozenset({"moe_act"}))
    sel = (qwen, 1, False, "selective", 4096, 1, 1)
    assert _layer_acts(*sel, "bf16", no_act)[1] - _layer_acts(*sel, "fp8", no_act)[1] == \
        pytest.approx(qwen.moe_router_topk * qwen.hidden_size)
