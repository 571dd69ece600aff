"""How an MoE layer runs (core/moe.py): each option moves memory and step time the way its
mechanism says, the rule book refuses what Megatron refuses, plan and render carry the options to
Megatron's flags, and validate reads them back from a script."""
import pytest

from megatron_skill.contract import call
from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.flops import padded_vocab_size
from megatron_skill.core.layout import Layout, check_layout
from megatron_skill.core.moe import MoEOptions
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import predict
from megatron_skill.core.timing import calibration

H100 = get_gpu("h100-sxm")
QWEN = get_model("qwen3-30b-a3b")
QWEN_LAYOUT = Layout(tp=1, pp=2, vp=12, ep=8, dp=32, mbs=2, gbs=512, seq_length=4096)


def cost(moe: dict | None, model=QWEN, lay=QWEN_LAYOUT):
    return predict(model, H100, lay, padded_vocab_size(model.vocab_size, lay.tp), RuntimeOptions.from_request(None, moe=moe))


def test_the_schema_defaults_are_the_options_defaults():
    assert MoEOptions.from_request(None) == MoEOptions()
    assert MoEOptions().dropless and MoEOptions().host_sync


def test_only_padding_to_a_capacity_removes_the_dropless_cost():
    assert MoEOptions(capacity_factor=1.0).host_sync               # sizes still read back per layer
    assert not MoEOptions(capacity_factor=1.0, pad_to_capacity=True).host_sync
    dropless, padded = cost(None), cost({"capacity_factor": 1.0, "pad_to_capacity": True})
    cal = calibration("h100-sxm")
    local = QWEN.num_experts // QWEN_LAYOUT.ep
    every = cal["moe_us_per_token_expert"] * local
    synced = cal["moe_dropless_us_per_token"] + cal["moe_dropless_us_per_token_expert"] * local
    tokens = QWEN_LAYOUT.num_microbatches * QWEN_LAYOUT.mbs * QWEN_LAYOUT.seq_length * 24   # 24 layers a stage
    assert dropless.time.moe_experts == pytest.approx(tokens * (every + synced) * 1e-6)
    # padded, only the part every MoE layer pays is left (it is not zero: the token-drop runs pay it)
    assert padded.time.moe_experts == pytest.approx(tokens * every * 1e-6) and padded.time.moe_experts > 0
    assert padded.time.gemm == dropless.time.gemm   # balanced: same work
    assert padded.tokens_per_s > dropless.tokens_per_s


def test_a_padded_capacity_above_one_costs_its_share_in_expert_work_and_memory():
    one = cost({"capacity_factor": 1.0, "pad_to_capacity": True})
    more = cost({"capacity_factor": 1.5, "pad_to_capacity": True})
    assert more.time.gemm > one.time.gemm and more.time.ep_comm == pytest.approx(1.5 * one.time.ep_comm, rel=0.01)
    assert more.peak_gib > one.peak_gib
    unpadded = cost({"capacity_factor": 1.5})                       # drops nothing under balance, pads nothing
    assert unpadded.time.gemm == cost(None).time.gemm


def test_allgather_moves_more_than_alltoall_when_ep_exceeds_top_k():
    lay = QWEN_LAYOUT.but(ep=32, dp=32)
    a2a, ag = cost({"dispatcher": "alltoall"}, lay=lay), cost({"dispatcher": "allgather"}, lay=lay)
    assert ag.time.ep_comm > 2 * a2a.time.ep_comm


def test_flex_sends_a_token_once_per_remote_domain():
    v3 = get_model("deepseek-v3")
    across = Layout(tp=2, pp=8, vp=4, ep=64, dp=64, mbs=1, gbs=8192, seq_length=4096, sequence_parallel=True,
                    pipeline_split="embedding_loss")
    assert cost({"dispatcher": "flex"}, v3, across).time.ep_comm < 0.8 * cost(None, v3, across).time.ep_comm
    # inside one NVLink domain there is no network traffic to save
    assert cost({"dispatcher": "flex"}).time.ep_comm == cost(None).time.ep_comm


def test_overlapping_the_all_to_all_leaves_the_calibrated_share():
    plain, overlapped = cost(None), cost({"overlap_ep_comm": True})
    share = calibration("h100-sxm")["ep_overlap_exposed"]
    assert overlapped.time.ep_comm == pytest.approx(share * plain.time.ep_comm)


def test_ungrouped_experts_cost_more_and_a_fp64_router_more_memory():
    assert cost({"grouped_gemm": False}).time.moe_experts > cost(None).time.moe_experts
    assert cost({"router_dtype": "fp64"}).peak_gib > cost(None).peak_gib


@pytest.mark.parametrize("moe, lay, rule", [
    ({"overlap_ep_comm": True}, QWEN_LAYOUT.but(vp=1), "moe_overlap_needs_vp"),
    ({"overlap_ep_comm": True}, QWEN_LAYOUT.but(ep=1, dp=32), "moe_overlap_needs_ep"),
    ({"overlap_ep_comm": True, "dispatcher": "allgather"}, QWEN_LAYOUT, "moe_overlap_dispatcher"),
    ({"overlap_ep_comm": True}, QWEN_LAYOUT.but(recompute="full", recompute_layers=1), "moe_overlap_recompute"),
    ({"pad_to_capacity": True}, QWEN_LAYOUT, "moe_pad_needs_capacity"),
])
def test_the_rule_book_refuses_what_megatron_refuses(moe, lay, rule):
    assert check_layout(lay, QWEN, H100, 64, True, MoEOptions.from_request(moe)) == rule
    assert check_layout(lay, QWEN, H100, 64, True, MoEOptions()) in (None, "recompute_layers")


def test_plan_with_overlap_never_offers_full_recompute_or_a_plain_pipeline():
    out = call("plan", {"model": "qwen3-30b-a3b", "num_gpus": 64, "gpu": "h100-sxm", "top": 5, "include_args": True,
                        "moe": {"overlap_ep_comm": True}})
    assert out["ok"], out
    for p in out["result"]["plans"]:
        lay = p["layout"]
        assert lay["recompute"] != "full" and (lay["pp"] == 1 or lay["vp"] > 1) and lay["ep"] > 1
        assert "--overlap-moe-expert-parallel-comm" in p["megatron_args"]


def test_render_writes_the_options_and_megatrons_parser_takes_both_variants(tmp_path):
    req = {"model": "qwen3-30b-a3b", "num_gpus": 64, "gpu": "h100-sxm", "output_dir": str(tmp_path), "launcher": "slurm",
           "layout": {"tp": 1, "pp": 2, "vp": 12, "ep": 8, "mbs": 1, "recompute": "selective"},
           "moe": {"capacity_factor": 1.25, "pad_to_capacity": True, "overlap_ep_comm": True}}
    out = call("render", req)
    assert out["ok"], out
    text = open(out["result"]["files"][0]["path"]).read()
    for flag in ("--moe-expert-capacity-factor 1.25", "--moe-pad-expert-input-to-capacity",
                 "--overlap-moe-expert-parallel-comm", "--moe-router-dtype fp32"):
        assert flag in text, flag
    # TE's fused permutation only in the variant that runs TE's layers
    assert "IMPL_ARGS=(--transformer-impl transformer_engine --moe-permute-fusion)" in text
    refused = call("render", {**req, "output_dir": str(tmp_path / "b"), "layout": {**req["layout"], "vp": 1}})
    assert not refused["ok"] and "moe_overlap_needs_vp" in refused["error"]["message"]


def test_validate_reads_the_options_back_from_a_script():
    args = ["--num-layers", "48", "--hidden-size", "2048", "--ffn-hidden-size", "6144", "--num-attention-heads", "32",
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
            "--global-batch-size", "512", "--pipeline-model-parallel-size", "2", "--num-experts", "128",
            "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768", "--expert-model-parallel-size", "8",
            "--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm", "--bf16",
            "--vocab-size", "151936", "--tokenizer-type", "NullTokenizer", "--mock-data"]
    out = call("validate", {"args": args, "num_gpus": 64, "gpu": "h100-sxm"})
    assert out["ok"], out
    assert [e["code"] for e in out["result"]["errors"]] == ["moe_overlap_needs_vp"]
    fixed = call("validate", {"args": args + ["--num-virtual-stages-per-pipeline-rank", "2"], "num_gpus": 64,
                              "gpu": "h100-sxm"})
    assert fixed["ok"] and fixed["result"]["errors"] == [], fixed["result"]["errors"]


def test_recomputing_whole_moe_layers_trades_time_for_memory():
    lay = QWEN_LAYOUT.but(recompute="selective")
    act, whole = cost(None, lay=lay), cost({"recompute": ["moe"]}, lay=lay)
    assert whole.peak_gib < act.peak_gib and whole.time.recompute > act.time.recompute
    args = RuntimeOptions.from_request(None, moe={"recompute": ["moe", "shared_experts"]}).moe
    assert args.selective_modules() == {"core_attn", "layernorm", "moe", "shared_experts"}
    assert check_layout(lay, QWEN, H100, 64, True, MoEOptions.from_request(
        {"recompute": ["moe"], "overlap_ep_comm": True})) == "moe_overlap_recompute"


def test_render_takes_the_moe_options_the_plan_was_costed_with(tmp_path):
    plan = {"model": "qwen3-30b-a3b", "num_gpus": 16, "gpu": "h100-sxm", "seq_length": 4096,
            "moe": {"capacity_factor": 1.0, "pad_to_capacity": True}}
    out = call("render", {"plan": plan, "launcher": "slurm", "output_dir": str(tmp_path)})
    assert out["ok"], out
    assert "--moe-pad-expert-input-to-capacity" in out["result"]["megatron_args"]
    twice = call("render", {"plan": plan, "moe": {}, "launcher": "slurm", "output_dir": str(tmp_path / "b")})
    assert not twice["ok"] and twice["error"]["where"] == "/moe"


def test_a_cpu_run_refuses_moe_options_it_would_not_run(tmp_path):
    out = call("train", {"model": "tiny-gpt", "backend": "cpu", "runs_root": str(tmp_path), "dry_run": True,
                         "moe": {"dispatcher": "alltoall"}})
    assert not out["ok"] and out["error"]["where"] == "/moe"


def test_the_planner_asks_the_rule_book_about_each_recompute_it_tries():
    # whole-MoE recompute and full recompute are both refused with the all-to-all overlap: with
    # no other recompute allowed, no layout is left, and the answer names the rule
    out = call("plan", {"model": "qwen3-30b-a3b", "num_gpus": 64, "gpu": "h100-sxm", "seq_length": 4096,
                        "constraints": {"recompute": ["selective", "full"]},
                        "moe": {"overlap_ep_comm": True, "recompute": ["moe"]}})
    assert not out["ok"] and out["error"]["code"] == "infeasible", out
    assert "moe_overlap_recompute" in out["error"]["details"]["rejected"]
    # the same without the overlap plans whole-MoE recompute
    plain = call("plan", {"model": "qwen3-30b-a3b", "num_gpus": 64, "gpu": "h100-sxm", "seq_length": 4096,
                          "constraints": {"recompute": ["selective"]}, "moe": {"recompute": ["moe"]}, "top": 1})
    assert plain["ok"] and plain["result"]["plans"][0]["layout"]["recompute"] == "selective"
