"""Unit tests of the core: the rule book (core/layout.py), the step-time model (core/timing.py)
and the search's parts (core/planner.py), each on small hand-made inputs whose answers are
known without the code."""
import dataclasses

import pytest

from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.layout import RULES, Layout, broken_rules, check_layout
from megatron_skill.core.megatron_options import MegatronOptions
from megatron_skill.core.memory import memory_report, peak
from megatron_skill.core.model import build_spec
from megatron_skill.core.moe import MoEOptions
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import _divisors, error_pct, pipeline_splits, predict, rank
from megatron_skill.core.timing import step_time

H100 = get_gpu("h100-sxm")
LLAMA8B = get_model("llama3-8b")          # 32 layers, 32 heads, 8 query groups, seq 8192
MIXTRAL = get_model("mixtral-8x7b")       # 8 experts
GOOD = Layout(tp=2, pp=2, cp=1, dp=2, mbs=1, gbs=64, seq_length=8192, sequence_parallel=True)
QK_NORM = build_spec("qk", {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
                            "vocab_size": 1000, "qk_layernorm": True})
GPT2 = build_spec("gpt2", {"num_layers": 12, "hidden_size": 768, "ffn_hidden_size": 3072, "num_attention_heads": 12,
                           "vocab_size": 50257, "position_embedding_type": "learned_absolute",
                           "max_position_embeddings": 1024, "activation": "gelu", "normalization": "LayerNorm"})

MOE_GOOD = dataclasses.replace(GOOD, pp=2, vp=2, ep=2, dp=2)
TINY = get_model("tiny-gpt")
TINY_TIED = build_spec("tied", {"num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 512, "num_attention_heads": 4,
                                "vocab_size": 1024, "untie_embeddings_and_output_weights": False})
CPU_GOOD = Layout(tp=2, pp=2, dp=1, mbs=1, gbs=8, seq_length=256, distributed_optimizer=False)
CPU_LOOP = (None, None, True)   # broken_rules' moe, megatron, cpu_loop
OVERLAP = MoEOptions(overlap_ep_comm=True)

# Each rule, broken by one change to a layout that breaks nothing (model, gpu, world, te[, MoE options]).
BREAKS = {
    "world_size": (LLAMA8B, GOOD, H100, 16, True),
    "tp_heads": (LLAMA8B, dataclasses.replace(GOOD, tp=3, dp=1, gbs=64), H100, 6, True),
    "tp_query_groups": (LLAMA8B, dataclasses.replace(GOOD, tp=16, dp=1), H100, 32, True),
    "tp_within_nvlink": (get_model("llama3-70b"), dataclasses.replace(GOOD, tp=16, dp=1), H100, 32, True),
    "ep_without_moe": (LLAMA8B, dataclasses.replace(GOOD, ep=2), H100, 8, True),
    "ep_experts": (MIXTRAL, dataclasses.replace(GOOD, ep=3, dp=3, gbs=60), H100, 12, True),
    "expert_folding": (MIXTRAL, dataclasses.replace(GOOD, ep=8), H100, 8, True),
    "sp_needs_tp": (LLAMA8B, dataclasses.replace(GOOD, tp=1, dp=4), H100, 8, True),
    "moe_needs_sp": (MIXTRAL, dataclasses.replace(GOOD, sequence_parallel=False), H100, 8, True),
    "pp_layers": (LLAMA8B, dataclasses.replace(GOOD, pp=3, dp=1, gbs=64), H100, 6, True),
    "pp_uneven": (LLAMA8B, dataclasses.replace(GOOD, pipeline_split="uneven", first_stage_layers=40,
                                               last_stage_layers=1), H100, 8, True),
    "vp_layers": (LLAMA8B, dataclasses.replace(GOOD, vp=3), H100, 8, True),
    "pp_layout": (LLAMA8B, dataclasses.replace(GOOD, pipeline_split="layout", pipeline_layout="E(t*16|)*2L"), H100, 8,
                  True),
    "vp_needs_pp": (LLAMA8B, dataclasses.replace(GOOD, pp=1, dp=4, vp=2), H100, 8, True),
    "vp_microbatches": (LLAMA8B, dataclasses.replace(GOOD, vp=2, gbs=2), H100, 8, True),
    "cp_sequence": (LLAMA8B, dataclasses.replace(GOOD, cp=2, dp=1, seq_length=8194), H100, 8, True),
    "cp_needs_te": (LLAMA8B, dataclasses.replace(GOOD, cp=2, dp=1), H100, 8, False),
    "qk_norm_sp_needs_te": (QK_NORM, dataclasses.replace(GOOD, pp=2), H100, 8, False),
    "gbs_divisible": (LLAMA8B, dataclasses.replace(GOOD, gbs=65), H100, 8, True),
    "fp8_arch": (LLAMA8B, dataclasses.replace(GOOD, precision="fp8"), get_gpu("a100-80gb"), 8, True),
    "recompute_layers": (LLAMA8B, dataclasses.replace(GOOD, recompute="full", recompute_layers=17), H100, 8, True),
    "seq_positions": (GPT2, dataclasses.replace(GOOD, seq_length=2048), H100, 8, True),
    "moe_pad_needs_capacity": (MIXTRAL, MOE_GOOD, H100, 8, True, MoEOptions(pad_to_capacity=True)),
    "moe_flex_needs_te": (MIXTRAL, MOE_GOOD, H100, 8, False, MoEOptions(dispatcher="flex")),
    "moe_overlap_needs_ep": (MIXTRAL, dataclasses.replace(MOE_GOOD, ep=1), H100, 8, True, OVERLAP),
    "moe_overlap_dispatcher": (MIXTRAL, MOE_GOOD, H100, 8, True, MoEOptions(overlap_ep_comm=True,
                                                                           dispatcher="allgather")),
    "moe_overlap_needs_vp": (MIXTRAL, dataclasses.replace(MOE_GOOD, vp=1), H100, 8, True, OVERLAP),
    "moe_overlap_recompute": (MIXTRAL, dataclasses.replace(MOE_GOOD, recompute="full", recompute_layers=1), H100, 8,
                              True, OVERLAP),
    "fp8_param_gather_needs_te_fp8": (LLAMA8B, GOOD, H100, 8, True, None, MegatronOptions(fp8_param_gather=True)),
    "fsdp_needs_te": (LLAMA8B, GOOD, H100, 8, False, None, MegatronOptions(fsdp=True)),
    "precision_aware_needs_distopt": (LLAMA8B, dataclasses.replace(GOOD, distributed_optimizer=False), H100, 8, True,
                                      None, MegatronOptions(precision_aware_optimizer=True)),
    "activation_offload": (LLAMA8B, GOOD, H100, 8, True, None, MegatronOptions(activation_offload_layers=32)),
    # The CPU loop's own limits (local layers, cpu_loop=True).
    "cpu_loop_vp": (TINY, dataclasses.replace(CPU_GOOD, vp=2), H100, 4, False, *CPU_LOOP),
    "cpu_loop_ep": (TINY, dataclasses.replace(CPU_GOOD, ep=2), H100, 4, False, *CPU_LOOP),
    "cpu_loop_pipeline_split": (TINY, dataclasses.replace(CPU_GOOD, pipeline_split="embedding_loss"), H100, 4, False,
                                *CPU_LOOP),
    "cpu_loop_pp_tied": (TINY_TIED, CPU_GOOD, H100, 4, False, *CPU_LOOP),
    "cpu_loop_sequence_parallel": (TINY, dataclasses.replace(CPU_GOOD, sequence_parallel=True), H100, 4, False,
                                   *CPU_LOOP),
    "cpu_loop_moe_tp": (MIXTRAL, CPU_GOOD, H100, 4, False, *CPU_LOOP),
    "cpu_loop_recompute": (TINY, dataclasses.replace(CPU_GOOD, recompute="selective"), H100, 4, False, *CPU_LOOP),
    "cpu_loop_distributed_optimizer": (TINY, dataclasses.replace(CPU_GOOD, dp=2, distributed_optimizer=True), H100, 8,
                                       False, *CPU_LOOP),
}


def test_the_unbroken_layout_breaks_nothing():
    assert check_layout(GOOD, LLAMA8B, H100, 8) is None
    assert check_layout(MOE_GOOD, MIXTRAL, H100, 8, True, OVERLAP) is None
    assert check_layout(dataclasses.replace(GOOD, pp=2), QK_NORM, H100, 8, te=True) is None
    assert check_layout(CPU_GOOD, TINY, H100, 4, te=False, cpu_loop=True) is None


@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_each_rule_is_broken_by_its_one_change(rule):
    model, lay, gpu, n, te, *moe = BREAKS[rule]
    broken = list(broken_rules(lay, model, gpu, n, te, *moe))
    assert rule in broken, broken


def test_every_layout_rule_has_a_case():
    assert set(RULES) - {"out_of_memory"} == set(BREAKS)


# ---- step time: properties that hold whatever the calibration --------------------------
def _time(lay, model=LLAMA8B, te=True, **kw):
    return step_time(model, lay, H100, 128256, te, **kw)


def test_the_pipeline_bubble_is_pp_minus_one_over_vp_micro_batches_of_the_busiest_stage():
    per_rank = ("gemm", "attention", "elementwise", "grad_accum", "loss", "recompute", "tp_comm", "cp_comm", "ep_comm")
    for vp in (1, 2):
        lay = dataclasses.replace(GOOD, pp=4, dp=1, vp=vp)   # 64 micro-batches
        t = _time(lay)
        work = sum(getattr(t, f) for f in per_rank)
        assert t.bubble == pytest.approx(work * 3 / (vp * lay.num_microbatches))


def test_more_tensor_parallel_means_more_tp_communication_and_no_faster_gemms():
    """The same FLOPs per GPU at TP 2 x DP 4 and TP 8: thinner GEMMs are no faster, and the
    collectives grow with TP; TP 1 has none."""
    t2 = _time(dataclasses.replace(GOOD, tp=2, pp=1, dp=4))
    t8 = _time(dataclasses.replace(GOOD, tp=8, pp=1, dp=1))
    assert t8.tp_comm > t2.tp_comm > 0
    assert t8.gemm >= t2.gemm
    assert _time(dataclasses.replace(GOOD, tp=1, pp=2, dp=4, sequence_parallel=False)).tp_comm == 0


def test_fp8_gemms_are_faster_than_bf16_and_recompute_costs_time():
    bf16 = _time(GOOD)
    fp8 = _time(dataclasses.replace(GOOD, precision="fp8"))
    assert fp8.gemm < bf16.gemm
    full = _time(dataclasses.replace(GOOD, recompute="full", recompute_layers=16))
    assert full.recompute > 0 and full.total > bf16.total and bf16.recompute == 0


def test_local_layers_without_te_pay_for_unfused_element_wise_work():
    te = _time(GOOD, te=True)
    local = _time(GOOD, te=False)
    assert local.elementwise > te.elementwise


# ---- planner parts -------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 12, 97, 1024, 16384, 2**27, 3 * 5 * 7 * 11 * 13])
def test_divisors_are_every_divisor_in_order(n):
    got = _divisors(n)
    assert got == sorted(got) and all(n % d == 0 for d in got)
    if n < 100000:
        assert got == [d for d in range(1, n + 1) if n % d == 0]


def test_pipeline_splits_even_embedding_loss_and_uneven():
    assert pipeline_splits(32, 4) == [{"pipeline_split": "even"}]
    assert pipeline_splits(30, 4) == [{"pipeline_split": "embedding_loss"}]   # 30 + 2 = 32
    uneven = pipeline_splits(61, 16)    # DeepSeek-V3
    assert uneven and all(s["pipeline_split"] == "uneven" for s in uneven)
    for s in uneven:
        lay = Layout(pp=16, pipeline_split="uneven", first_stage_layers=s["first_stage_layers"],
                     last_stage_layers=s["last_stage_layers"])
        counts = lay.rank_layer_counts(61)
        assert sum(counts) == 61 and min(counts) >= 1


def test_rank_is_fastest_first_with_near_ties_to_the_leaner():
    from types import SimpleNamespace as C

    fast, lean, slow = C(tokens_per_s=100, peak_gib=80), C(tokens_per_s=99.5, peak_gib=40), C(tokens_per_s=80, peak_gib=1)
    assert rank([slow, fast, lean]) == [lean, fast, slow]
    # a plan that leaves less than the margin free ranks after those that leave it
    from megatron_skill.core.memory import PLAN_MARGIN_GIB
    edge = C(tokens_per_s=200, peak_gib=80 - PLAN_MARGIN_GIB / 2, gpu_gib=80)
    roomy = C(tokens_per_s=10, peak_gib=80 - PLAN_MARGIN_GIB, gpu_gib=80)
    assert rank([edge, slow, roomy]) == [slow, roomy, edge]
    assert error_pct(110, 100) == 10.0 and error_pct(90, 100) == -10.0


def test_a_prediction_adds_up():
    opts = RuntimeOptions.from_request(None)
    c = predict(LLAMA8B, H100, GOOD, 128256, opts)
    assert c.peak_gib == pytest.approx(peak(memory_report(LLAMA8B, GOOD, 128256, opts.memory(GOOD))) / 2**30)
    assert c.tokens_per_s == pytest.approx(GOOD.gbs * GOOD.seq_length / c.time.total)
    assert 0 < c.mfu < 1


# ---- the search's branch and bound (core/planner.py, timing.step_floor) ----------------------
def _exhaustive(monkeypatch):
    """The planner with its bound off: every layout the rules accept is costed."""
    from megatron_skill.core import planner

    planner.forget()
    monkeypatch.setattr(planner, "KEPT", 10**9)


FLOOR_CASES = [  # model, GPUs, GPU, precisions, the runtime: TE's layers, the local ones, MoE and Megatron options
    (MIXTRAL, 64, "h100-sxm", ["bf16", "fp8"], {}),
    (LLAMA8B, 16, "h100-sxm", ["bf16"], {}),
    (LLAMA8B, 8, "h100-sxm", ["bf16", "fp8"], {"te": False}),
    (MIXTRAL, 72, "gb200", ["fp8"], {"moe": {"recompute": ["moe_act", "moe"], "dispatcher": "alltoall"},
                                     "megatron": {"fsdp": True, "cuda_graph_impl": "transformer_engine",
                                                  "cuda_graph_modules": ["attn"]}}),
]


@pytest.mark.parametrize("model,n_gpus,gpu,precisions,runtime", FLOOR_CASES)
def test_the_speed_floor_is_never_above_the_step_it_bounds(monkeypatch, model, n_gpus, gpu, precisions, runtime):
    """Every layout the exhaustive search costs: its step is at least step_floor, whatever
    recompute the search gave it (the bound's soundness; a floor above a step would prune a
    layout that belongs in the ranking)."""
    from megatron_skill.core import planner
    from megatron_skill.core.timing import step_floor

    _exhaustive(monkeypatch)
    opts = RuntimeOptions.from_request(None, **runtime)
    found = planner.search(model, get_gpu(gpu), n_gpus, 4096, 576 if n_gpus % 9 == 0 else 512, precisions, opts=opts)
    assert len(found.candidates) > 200
    tight = 0
    for c in found.candidates:
        floor = step_floor(model, c.layout, get_gpu(gpu), opts.te, opts.fp8_local(c.layout), opts.moe, opts.megatron,
                           opts.attention_kernel)
        assert 0 < floor <= c.time.total * (1 + 1e-12), c.layout.label()
        tight += floor > 0.6 * c.time.total
    assert tight > len(found.candidates) / 2    # a floor far below every step would prune nothing


@pytest.mark.parametrize("request_", [
    {"model": "mixtral-8x7b", "num_gpus": 64, "gpu": "h100-sxm", "top": 100, "precision": "any"},
    {"model": "qwen3-30b-a3b", "num_gpus": 8, "gpu": "h100-sxm", "top": 100},
    {"model": "llama3-8b", "num_gpus": 16, "gpu": "h100-sxm", "top": 100}])
def test_the_bounded_search_shows_the_plans_of_the_exhaustive_one(monkeypatch, request_):
    """The plans a request can ask for (up to 100) are the same, in the same order, with the
    bound on and with every layout costed; the bounded search costs fewer and says how many it
    skipped."""
    from megatron_skill.contract import call
    from megatron_skill.core import planner

    planner.forget()
    bounded = call("plan", dict(request_))["result"]
    _exhaustive(monkeypatch)
    full = call("plan", dict(request_))["result"]
    planner.forget()
    assert [(p["label"], p["tokens_per_s"]) for p in bounded["plans"]] == \
        [(p["label"], p["tokens_per_s"]) for p in full["plans"]]
    assert len(bounded["plans"]) == min(100, full["feasible"])
    if full["feasible"] > 2 * planner.KEPT:
        assert bounded["feasible"] < full["feasible"] and bounded["rejected"]["bounded"]["count"] > 0


def test_layouts_the_moe_rules_refuse_are_not_counted_out_of_memory(monkeypatch):
    """A layout whose every recompute the MoE rules refuse (the all-to-all overlap with the MoE
    block recomputed) says nothing of the memory of its larger micro-batches: the search counts
    out of memory no more layouts than those of families that do not fit at micro-batch 1 under
    the heaviest recompute (the review's case: 740 were counted, 85 at most are)."""
    from megatron_skill.core import planner

    model, gpu = get_model("qwen3-30b-a3b"), H100
    opts = RuntimeOptions.from_request(None, moe={"overlap_ep_comm": True, "recompute": ["moe"]})
    seen = {}
    cost = planner._cost_in_order

    def spy(model, gpu, todo, recomputes, capacity, rej, out, opts):
        seen.update(todo=list(todo), recomputes=recomputes, capacity=capacity)
        return cost(model, gpu, todo, recomputes, capacity, rej, out, opts)

    monkeypatch.setattr(planner, "_cost_in_order", spy)
    planner.forget()
    found = planner.search(model, gpu, 16, 4096, 1024, ["bf16"], {"recompute": ["selective"]}, opts=opts)
    planner.forget()
    families: dict = {}
    for _, _, lay in seen["todo"]:
        families.setdefault(lay.but(mbs=0), []).append(lay)
    unfit = sum(len(lays) for family, lays in families.items()
                if not planner._fits_at_all(model, family.but(mbs=1), seen["recomputes"], seen["capacity"], opts))
    assert found.rejected["moe_overlap_recompute"]["count"] > 100
    assert found.rejected.get("out_of_memory", {"count": 0})["count"] <= unfit


def test_an_infeasible_plans_nearest_values_do_not_depend_on_the_bound(monkeypatch):
    """The nearby GPU counts and batches an infeasible plan names are searched within a budget of
    layouts considered (the rules accepted or refused them), not of layouts costed: the same with
    the bound on and off (the review's case named 32 or 64 GPUs bounded, 32 exhaustive)."""
    from megatron_skill.contract import call
    from megatron_skill.core import planner

    request = {"model": "mixtral-8x7b", "num_gpus": 8, "gpu": "h100-sxm", "headroom_gib": 40}
    planner.forget()
    bounded = call("plan", dict(request))
    _exhaustive(monkeypatch)
    full = call("plan", dict(request))
    planner.forget()
    assert bounded["error"]["code"] == full["error"]["code"] == "infeasible"
    assert bounded["error"]["details"]["nearest_feasible"] == full["error"]["details"]["nearest_feasible"]
    assert bounded["error"]["details"]["nearest_feasible"]["num_gpus"]
