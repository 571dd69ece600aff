"""Megatron's memory and communication options beyond the layout (core/megatron_options.py), as
NVIDIA's recipes set them: each costed in memory and step time, refused by the rule book where
Megatron refuses it, written as flags Megatron's own parser takes, and read back from them."""
import dataclasses

import pytest
from conftest import require_modules

from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.layout import Layout, check_layout
from megatron_skill.core.megatron_options import MegatronOptions
from megatron_skill.core.memory import memory_report
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import predict

H100 = get_gpu("h100-sxm")
LLAMA8B = get_model("llama3-8b")
DP8 = Layout(tp=1, pp=1, dp=8, mbs=1, gbs=128, seq_length=8192, precision="fp8")


def _opts(**megatron):
    return RuntimeOptions.from_request(None, megatron=megatron)


def _first(lay, **megatron):
    return memory_report(LLAMA8B, lay, 128256, _opts(**megatron).memory(lay))["last_stage"]


def test_bf16_gradient_reduction_halves_the_main_gradients_and_the_reduce_scatter():
    base, bf16 = _first(DP8), _first(DP8, grad_reduce_in_bf16=True)
    assert bf16.gradients == pytest.approx(base.gradients / 2)
    lay = dataclasses.replace(DP8, gbs=8)   # one micro-batch: the reduce-scatter outlasts its window
    t32 = predict(LLAMA8B, H100, lay, 128256, _opts()).time.dp_comm_exposed
    t16 = predict(LLAMA8B, H100, lay, 128256, _opts(grad_reduce_in_bf16=True)).time.dp_comm_exposed
    assert 0 < t16 < t32


def test_fp8_parameter_gather_keeps_the_gemm_weights_in_fp8_only():
    base, fp8 = _first(DP8), _first(DP8, fp8_param_gather=True)
    assert fp8.weights < base.weights / 2    # bf16 weights plus TE's FP8 copies -> FP8 alone


def test_megatron_fsdp_shards_weights_and_gradients_and_gathers_them_each_micro_batch():
    base, fsdp = _first(DP8), _first(DP8, fsdp=True)
    assert fsdp.weights < base.weights / 4 and fsdp.gradients < base.gradients / 4
    # NVIDIA's Llama 3 8B FP8 run on eight H100s is Megatron-FSDP: without it the layout cannot fit
    assert base.total > H100.memory_bytes > fsdp.total
    # the weights gathered twice and the gradients reduced in every one of the 16 micro-batches,
    # not once a step: more exposed traffic than the distributed optimizer's
    fsdp_t = predict(LLAMA8B, H100, DP8, 128256, _opts(fsdp=True)).time.dp_comm_exposed
    assert fsdp_t > 4 * predict(LLAMA8B, H100, DP8, 128256, _opts()).time.dp_comm_exposed


def test_the_fused_cross_entropy_keeps_no_fp32_copy_of_the_logits_and_costs_less():
    last = dataclasses.replace(DP8, precision="bf16")
    plain = memory_report(LLAMA8B, last, 128256, _opts().memory(last))["last_stage"]
    fused = memory_report(LLAMA8B, last, 128256, _opts(cross_entropy_fusion=True).memory(last))["last_stage"]
    assert fused.logits < plain.logits
    slow = predict(LLAMA8B, H100, last, 128256, _opts()).time.loss
    fast = predict(LLAMA8B, H100, last, 128256, _opts(cross_entropy_fusion=True)).time.loss
    assert fast < slow / 5


def test_the_precision_aware_optimizer_keeps_only_the_masters_missing_bits_and_smaller_moments():
    bf16 = dataclasses.replace(DP8, precision="bf16")
    base = _first(bf16)
    aware = _first(bf16, precision_aware_optimizer=True)
    assert aware.optimizer == pytest.approx(base.optimizer * 10 / 12)   # 2 + 4 + 4 bytes against 4 + 4 + 4
    small = _first(bf16, precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert small.optimizer == pytest.approx(base.optimizer * 6 / 12)
    # FP8 runs (tensorwise or MXFP8) keep the whole fp32 master: only the moments' dtypes count
    assert _first(DP8, precision_aware_optimizer=True).optimizer == pytest.approx(_first(DP8).optimizer)
    assert _first(DP8, precision_aware_optimizer=True, exp_avg_sq_dtype="bf16").optimizer == pytest.approx(
        _first(DP8).optimizer * 10 / 12)
    # it is Transformer Engine's Adam: without TE nothing changes (and a request is refused below)
    assert RuntimeOptions.from_request(None, te=False, megatron={"precision_aware_optimizer": True}).memory(
        bf16).optimizer_bytes == 12
    no_distopt = dataclasses.replace(bf16, distributed_optimizer=False)
    aware_opts = MegatronOptions(precision_aware_optimizer=True)
    assert check_layout(no_distopt, LLAMA8B, H100, 8, True, megatron=aware_opts) == "precision_aware_needs_distopt"
    assert check_layout(bf16, LLAMA8B, H100, 8, True, megatron=aware_opts) is None


def test_te_adams_fp32_copies_of_16_bit_moments_are_counted_at_the_step():
    bf16 = dataclasses.replace(DP8, precision="bf16")
    fp32 = _first(bf16, precision_aware_optimizer=True)
    small = _first(bf16, precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")
    # two moments copied to fp32 for the whole shard while the kernel runs: 8 bytes a shard parameter
    assert small.step_transient - fp32.step_transient == pytest.approx(8 * fp32.optimizer / 10)   # 10 B of state


def test_requests_the_options_contradict_are_bad_requests_and_the_script_needs_te():
    from megatron_skill.contract import call

    env = call("plan", {"model": "llama3-8b", "num_gpus": 8, "constraints": {"distributed_optimizer": False},
                        "megatron_options": {"precision_aware_optimizer": True}})
    assert not env["ok"] and env["error"]["code"] == "bad_request", env
    assert env["error"]["where"] == "/megatron_options/precision_aware_optimizer"
    res = call("render", {"model": "llama3-8b", "num_gpus": 8, "launcher": "torchrun", "layout": {"tp": 2, "mbs": 1},
                          "training": {"mock_data": True}, "dry_run": True,
                          "megatron_options": {"precision_aware_optimizer": True}})
    assert res["ok"], res
    script = res["result"]["files"][0]["content"]
    # the plan's memory counts TE's Adam: the script stops where TE is missing instead of running
    # the local branch with Megatron's 12 bytes a parameter
    assert '"te": "the precision-aware optimizer is Transformer Engine' in script


def test_fp8_parameter_gather_needs_te_fp8_and_a_sharded_optimizer():
    gather = MegatronOptions(fp8_param_gather=True)
    assert check_layout(DP8, LLAMA8B, H100, 8, True, megatron=gather) is None
    assert check_layout(dataclasses.replace(DP8, precision="bf16"), LLAMA8B, H100, 8, True,
                        megatron=gather) == "fp8_param_gather_needs_te_fp8"
    assert check_layout(DP8, LLAMA8B, H100, 8, False, megatron=gather) == "fp8_param_gather_needs_te_fp8"
    no_distopt = dataclasses.replace(DP8, distributed_optimizer=False)
    assert check_layout(no_distopt, LLAMA8B, H100, 8, True, megatron=gather) == "fp8_param_gather_needs_te_fp8"
    assert check_layout(no_distopt, LLAMA8B, H100, 8, True,
                        megatron=MegatronOptions(fp8_param_gather=True, fsdp=True)) is None


def test_the_flags_pass_megatrons_parser_and_read_back_as_the_same_options():
    require_modules("megatron.training")
    from megatron_skill.adapter import arguments
    from megatron_skill.adapter import parser as megatron_parser

    tp2 = Layout(tp=2, pp=1, dp=4, mbs=1, gbs=128, seq_length=8192, precision="fp8", sequence_parallel=True)
    every = MegatronOptions(grad_reduce_in_bf16=True, fp8_param_gather=True, fsdp=True, cross_entropy_fusion=True,
                            cuda_graph_impl="transformer_engine", cuda_graph_modules=("attn", "mlp"),
                            precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")
    te = arguments.te_only_args(tp2, H100, False, LLAMA8B, None, every)
    assert "--tp-comm-overlap" in te and te[-5:] == ["--cuda-graph-impl", "transformer_engine",
                                                     "--cuda-graph-modules", "attn", "mlp"]
    argv = (arguments.model_args(LLAMA8B, 8192) + arguments.layout_args(tp2, LLAMA8B, H100) + every.flags()
            + ["--transformer-impl", "transformer_engine"] + te)
    ns = megatron_parser.parse(argv, world_size=8, env={})   # FSDP wants CUDA_DEVICE_MAX_CONNECTIONS unset
    assert MegatronOptions.from_args(ns) == every
    # a script without the flags: Megatron's defaults, the TP overlap off too
    bare = arguments.model_args(LLAMA8B, 8192) + arguments.layout_args(tp2, LLAMA8B, H100)
    one_queue = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}   # TP without FSDP wants one kernel queue
    assert MegatronOptions.from_args(megatron_parser.parse(bare + ["--transformer-impl", "transformer_engine"],
                                                           world_size=8, env=one_queue)) == \
        MegatronOptions(tp_comm_overlap=False)
    # the whole iteration captured: Megatron asserts the NaN check off, which the flags carry
    whole = MegatronOptions(cuda_graph_impl="full_iteration", tp_comm_overlap=False)
    ns = megatron_parser.parse(bare + ["--transformer-impl", "transformer_engine"] + whole.te_flags(),
                               world_size=8, env=one_queue)
    assert MegatronOptions.from_args(ns) == whole
    # no TP overlap asked: none written, and the TP collectives cost more
    assert "--tp-comm-overlap" not in arguments.te_only_args(tp2, H100, False, LLAMA8B, None,
                                                             MegatronOptions(tp_comm_overlap=False))


def test_the_tp_overlap_and_cuda_graphs_are_costed_where_they_run():
    tp8 = Layout(tp=8, pp=1, dp=1, mbs=1, gbs=16, seq_length=8192, precision="bf16", sequence_parallel=True)
    on = predict(LLAMA8B, H100, tp8, 128256, _opts()).time
    off = predict(LLAMA8B, H100, tp8, 128256, _opts(tp_comm_overlap=False)).time
    assert off.tp_comm > 2 * on.tp_comm > 0
    # beyond one NVLink domain no overlap runs (render writes none), asked or not
    tp16 = dataclasses.replace(tp8, tp=16)
    assert predict(LLAMA8B, H100, tp16, 128256, _opts()).time.tp_comm == pytest.approx(
        predict(LLAMA8B, H100, tp16, 128256, _opts(tp_comm_overlap=False)).time.tp_comm)
    # graphs take the host's launch time of what they capture, nothing else
    layers = predict(LLAMA8B, H100, tp8, 128256, _opts(cuda_graph_impl="transformer_engine")).time
    half = predict(LLAMA8B, H100, tp8, 128256, _opts(cuda_graph_impl="transformer_engine",
                                                      cuda_graph_modules=("attn",))).time
    whole = predict(LLAMA8B, H100, tp8, 128256, _opts(cuda_graph_impl="full_iteration")).time
    assert whole.host == 0 < layers.host < half.host < on.host
    assert layers.total - layers.host == pytest.approx(on.total - on.host)


@pytest.mark.parametrize("options, field", [
    ({"cuda_graph_impl": "transformer_engine"}, "cuda_graph_impl"),           # without TE
    ({"cuda_graph_modules": ["attn"]}, "cuda_graph_modules"),                 # modules without graphs
    ({"precision_aware_optimizer": True}, "precision_aware_optimizer"),       # TE's Adam without TE
])
def test_cuda_graph_requests_that_cannot_run_are_bad_requests(options, field):
    from megatron_skill.errors import ToolError

    with pytest.raises(ToolError) as err:
        MegatronOptions.from_request(options).check_request("bf16", te=False)
    assert err.value.code == "bad_request" and err.value.where.endswith(field)

def test_adam_state_dtypes_without_the_precision_aware_optimizer_are_a_bad_request():
    from megatron_skill.errors import ToolError

    with pytest.raises(ToolError) as err:
        MegatronOptions.from_request({"exp_avg_sq_dtype": "bf16"}).check_request("bf16", te=True)
    assert err.value.code == "bad_request" and err.value.where == "/megatron_options/exp_avg_sq_dtype"
    MegatronOptions.from_request({"exp_avg_sq_dtype": "bf16", "precision_aware_optimizer": True}).check_request(
        "bf16", te=True)


def test_render_writes_them_from_a_plan_and_validate_reads_the_script_back_valid(tmp_path):
    require_modules("megatron.training")
    from megatron_skill.contract import call

    options = {"fsdp": True, "grad_reduce_in_bf16": True}
    plan = call("plan", {"model": "llama3-8b", "gpu": "h100-sxm", "num_gpus": 8, "precision": "fp8", "top": 1,
                         "megatron_options": options, "constraints": {"tp": [2]}})
    assert plan["ok"], plan
    out = call("render", {"plan": plan, "launcher": "torchrun", "output_dir": str(tmp_path)})
    assert out["ok"], out
    script = out["result"]["files"][0]["path"]
    text = open(script).read()
    assert "--use-megatron-fsdp" in text and "--grad-reduce-in-bf16" in text
    # one checkpoint format (Megatron-FSDP's), and no single kernel queue (Megatron-FSDP refuses it)
    assert text.count("--ckpt-format") == 1 and "fsdp_dtensor" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" not in text
    checked = call("validate", {"script": script})
    assert checked["ok"] and checked["result"]["valid"], checked["result"].get("errors")


def test_fp8_weights_are_gathered_in_fp8_and_fsdps_gradients_are_bf16_by_default():
    one_mb = dataclasses.replace(DP8, gbs=8)   # one micro-batch: the gather outlasts its window
    bf16 = predict(LLAMA8B, H100, one_mb, 128256, _opts()).time.dp_comm_exposed
    fp8 = predict(LLAMA8B, H100, one_mb, 128256, _opts(fp8_param_gather=True)).time.dp_comm_exposed
    assert fp8 < bf16
    # Megatron-FSDP keeps its main gradients in the parameters' dtype unless told otherwise
    assert _opts(fsdp=True).memory(DP8).grad_bytes == 2 and _opts().memory(DP8).grad_bytes == 4


def test_a_request_no_layout_can_run_is_a_bad_request_not_infeasible():
    from megatron_skill.contract import call

    for options, extra, where in (({"fp8_param_gather": True}, {}, "/megatron_options/fp8_param_gather"),
                                  ({"fsdp": True}, {"transformer_engine": False}, "/megatron_options/fsdp")):
        env = call("plan", {"model": "llama3-8b", "num_gpus": 8, "megatron_options": options, **extra})
        assert not env["ok"] and env["error"]["code"] == "bad_request" and env["error"]["where"] == where, env


def test_validate_reads_fsdps_gradient_dtype_as_megatron_turns_it():
    require_modules("megatron.training")
    from megatron_skill.adapter import arguments
    from megatron_skill.adapter import parser as megatron_parser

    base = (arguments.model_args(LLAMA8B, 8192) + arguments.layout_args(DP8, LLAMA8B, H100)
            + MegatronOptions(fsdp=True).flags() + ["--transformer-impl", "transformer_engine"])
    for dtype, bf16 in ((None, True), ("bf16", True), ("fp32", False)):
        argv = base + (["--megatron-fsdp-main-grads-dtype", dtype] if dtype else [])
        ns = megatron_parser.parse(argv, world_size=8, env={})
        assert MegatronOptions.from_args(ns).bf16_grads is bf16, (dtype, ns.megatron_fsdp_main_grads_dtype)


def test_render_writes_cuda_graphs_on_the_te_branch_with_the_environment_megatron_asserts():
    require_modules("megatron.training")
    from megatron_skill.contract import call

    res = call("render", {"model": "llama3-8b", "num_gpus": 8, "launcher": "torchrun", "precision": "fp8",
                          "layout": {"tp": 2, "pp": 1, "mbs": 1}, "training": {"mock_data": True}, "dry_run": True,
                          "megatron_options": {"cuda_graph_impl": "transformer_engine",
                                               "cuda_graph_modules": ["attn", "mlp"]}})
    assert res["ok"], res
    script = res["result"]["files"][0]["content"]
    te_branch = next(line for line in script.splitlines() if "--transformer-impl transformer_engine" in line)
    assert "--tp-comm-overlap --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp" in te_branch
    assert "--cuda-graph-impl" not in " ".join(res["result"]["megatron_args"])   # not on the local branch
    # TE's graphs under the script's expandable segments: Megatron asserts NCCL's graph registration off
    assert "export NCCL_GRAPH_REGISTER=${NCCL_GRAPH_REGISTER:-0}" in script
    off = call("render", {"model": "llama3-8b", "num_gpus": 8, "launcher": "torchrun",
                          "layout": {"tp": 2, "pp": 1, "mbs": 1}, "training": {"mock_data": True}, "dry_run": True,
                          "megatron_options": {"tp_comm_overlap": False}})
    assert "--tp-comm-overlap" not in off["result"]["files"][0]["content"]


def test_activation_offload_frees_the_offloaded_layers_and_runs_where_megatron_allows_it():
    """--cpu-offloading-num-layers: the first N layers' saved tensors wait on the host (the layers
    kept include the one running: TE 2.10 on; TE 2.9 kept one more through the last layer only,
    before the logits exist); Megatron's TransformerConfig refuses it with PP > 1, recompute,
    per-layer CUDA graphs or N not below the layers; its copies cost time only where a
    micro-batch's compute does not hide them (a slow host link, little compute)."""
    require_modules("megatron.training")
    from megatron_skill.adapter import arguments
    from megatron_skill.adapter import parser as megatron_parser

    bf16 = dataclasses.replace(DP8, precision="bf16")
    base, off = _first(bf16), _first(bf16, activation_offload_layers=16)
    one_layer = base.activations / LLAMA8B.num_layers
    assert off.activations == pytest.approx(base.activations - 16 * one_layer, rel=0.02)
    # the peak: the kept layers with the logits, or with one more layer where it outweighs them
    # (a vocabulary of 8,192: logits smaller than a layer)
    for model, vocab in ((LLAMA8B, 128256), (dataclasses.replace(LLAMA8B, vocab_size=8192), 8192)):
        opts = _opts(activation_offload_layers=16).memory(bf16)
        kept = memory_report(model, bf16, vocab, opts)["last_stage"]
        layer = memory_report(model, bf16, vocab, _opts().memory(bf16))["last_stage"].activations / model.num_layers
        peak = kept.activations + kept.logits + kept.transient
        assert peak == pytest.approx(kept.activations + max(kept.logits, layer), rel=0.02)
        assert (kept.transient > 0) == (layer > kept.logits)
    offload = MegatronOptions(activation_offload_layers=16)
    assert check_layout(bf16, LLAMA8B, H100, 8, True, megatron=offload) is None
    for broken in (dataclasses.replace(bf16, pp=2, dp=4), dataclasses.replace(bf16, recompute="selective")):
        assert check_layout(broken, LLAMA8B, H100, 8, True, megatron=offload) == "activation_offload"
    assert check_layout(bf16, LLAMA8B, H100, 8, True, megatron=MegatronOptions(activation_offload_layers=32)) \
        == "activation_offload"
    assert check_layout(bf16, LLAMA8B, H100, 8, False, megatron=offload) == "activation_offload"
    # time: hidden behind an 8B micro-batch over PCIe here; exposed on a host link a thousand times slower
    assert predict(LLAMA8B, H100, bf16, 128256, _opts(activation_offload_layers=16)).time.offload == 0.0
    slow_link = dataclasses.replace(H100, host_link_gbps=0.064)
    assert predict(LLAMA8B, slow_link, bf16, 128256, _opts(activation_offload_layers=16)).time.offload > 1.0
    # Megatron's parser takes the flag, and validate reads the same option back
    argv = (arguments.model_args(LLAMA8B, 8192) + arguments.layout_args(bf16, LLAMA8B, H100) + offload.flags()
            + ["--transformer-impl", "transformer_engine"] + offload.te_flags())
    ns = megatron_parser.parse(argv, world_size=8, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert MegatronOptions.from_args(ns).activation_offload_layers == 16
