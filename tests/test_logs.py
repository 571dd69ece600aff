"""The log reader and the logs tool, on a real H200 log and on broken ones."""
import json
from pathlib import Path

from megatron_skill.adapter import log as megatron_log
from megatron_skill.contract import call

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "logs" / "h200-kill-resume.log"
LINE = (" [2026-12-02 13:20:32.559828] iteration {it:8d}/      40 | consumed samples:          304 | elapsed time per "
        "iteration (ms): 238.3 | throughput per GPU (TFLOP/s/GPU): 49.1 | learning rate: 1.999406E-04 | global batch "
        "size:    16 | lm loss: {loss} | loss scale: 1.0 | grad norm: 15.736 | number of skipped iterations:   0 | "
        "number of nan iterations:   {nan} |")


def _line(it, loss=3.0, nan=0):
    return LINE.format(it=it, loss=f"{loss:E}" if isinstance(loss, float) else loss, nan=nan)


def test_real_h200_log_with_a_kill_and_a_resume():
    parsed = megatron_log.parse(FIXTURE.read_text().splitlines())
    s = megatron_log.summarize(parsed, seq_length=1024, peak_tflops=989)
    assert s["logged_iterations"] == 40 and s["last_iteration"] == 40
    # Iterations 21-26 ran twice (before the kill and after the resume): the later values win.
    assert dict(map(tuple, s["loss_curve"]))[21] == 2.289625
    assert s["first_loss"] > 10 > s["final_loss"]
    assert s["max_allocated_gib"] > 1 and 0 < s["mfu"] < 0.2 and s["tokens_per_s"] > 10000
    assert s["failures"] == [] and s["nan_iterations"] == 0


def test_truncated_interleaved_and_garbled_lines():
    good = [_line(i, 5.0 - i * 0.1) for i in range(1, 11)]
    cut = good[4][: len(good[4]) // 2]                     # a rank killed mid-line
    mixed = good[6][:80] + "[rank3]: W1202 some warning\n"   # another rank wrote into the line
    garbage = "\x00\x1b[31m iteration ||| lm loss: x |"
    lines = good[:4] + [cut] + [good[5], mixed, garbage] + good[7:]
    s = megatron_log.summarize(megatron_log.parse(lines), seq_length=4096)
    assert s["last_iteration"] == 10
    assert s["logged_iterations"] >= 8 and s["unreadable_lines"] >= 1


def test_failures_and_anomalies_get_hints(tmp_path):
    lines = [_line(i, 3.0) for i in range(1, 8)] + [_line(8, 9.5), _line(9, "nan", nan=1)]
    lines += ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
              "[rank3]:[E1202] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"]
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines))
    env = call("logs", {"log": str(log), "gpu": "h200", "seq_length": 4096})
    assert env["ok"], env
    r = env["result"]
    codes = {f["code"] for f in r["failures"]}
    assert {"out_of_memory", "nccl_timeout"} <= codes
    kinds = {a["kind"] for a in r["anomalies"]}
    assert {"loss_spike", "nan"} <= kinds
    assert any("plan" in h for h in r["hints"]) and len(r["hints"]) >= 4


def test_not_a_log(tmp_path, cli):
    p = tmp_path / "x.log"
    p.write_text("hello\n")
    rc, out, _ = cli("logs", "--log", str(p))
    assert rc == 7 and out["error"]["code"] == "invalid_script"
    rc, out, _ = cli("logs", "--log", str(tmp_path / "missing.log"))
    assert rc == 3


# ---- the log alone: its argument dump, where an OOM happened, divergence against noise ----
ARGUMENTS = """------------------------ arguments ------------------------
  global_batch_size ............................... 32
  micro_batch_size ................................ 4
  seq_length ...................................... 4096
  tensor_model_parallel_size ...................... 1
  world_size ...................................... 1
  transformer_impl ................................ local
-------------------- end of arguments ---------------------
"""
GRAD_LINE = (" [2026-12-04 10:00:00] iteration {it:8d}/    1000 | elapsed time per iteration (ms): 2000.0 | "
             "global batch size:    32 | lm loss: {loss:E} | grad norm: {norm:.3f} |")


def _schema_valid(envelope):
    import jsonschema

    from megatron_skill.contract import load_schema, schema_registry
    jsonschema.Draft202012Validator(load_schema("logs", "response"), registry=schema_registry()).validate(envelope)


def test_tokens_per_s_from_the_logs_own_argument_dump(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("[rank0]: " + ARGUMENTS.replace("\n", "\n[rank0]: ") + "\n"
                   + "\n".join(GRAD_LINE.format(it=i, loss=3.0 - i / 100, norm=1.0) for i in range(1, 11)) + "\n")
    env = call("logs", {"log": str(log)})
    _schema_valid(env)
    res = env["result"]
    assert res["arguments"]["seq_length"] == 4096 and res["arguments"]["transformer_impl"] == "local"
    assert res["tokens_per_s"] == 32 * 4096 / 2.0
    # A flag still overrides what the log says.
    assert call("logs", {"log": str(log), "seq_length": 2048})["result"]["tokens_per_s"] == 32 * 2048 / 2.0


def test_out_of_memory_advice_follows_the_traceback(tmp_path):
    frames = {
        "attention_scores": ['  File "megatron/core/transformer/dot_product_attention.py", line 160, in forward',
                              "    matmul_result = torch.baddbmm("],
        "logits": ['  File "megatron/core/models/common/language_module/language_module.py", line 90, in '
                   'compute_language_model_loss', "    loss = tensor_parallel.vocab_parallel_cross_entropy(logits)"],
    }
    for site, stack in frames.items():
        log = tmp_path / f"{site}.log"
        log.write_text("\n".join([_line(1), "Traceback (most recent call last):", *stack,
                                  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB."]) + "\n")
        res = call("logs", {"log": str(log)})["result"]
        oom = next(f for f in res["failures"] if f["code"] == "out_of_memory")
        assert oom["site"] == site, oom
        assert ("flash" if site == "attention_scores" else "cross-entropy") in oom["fix"]
    res = call("logs", {"log": str(tmp_path / "attention_scores.log")})["result"]
    assert any("SDPA" in h or "flash" in h for h in res["hints"])


def test_a_tiny_wobbling_loss_is_not_divergence_but_a_real_rise_is(tmp_path):
    import random

    rnd = random.Random(0)
    mock = [0.006 + rnd.uniform(-0.002, 0.004) for _ in range(1000)]  # memorised mock data
    rising = [3.0 - i / 100 for i in range(60)] + [2.4 + i / 10 for i in range(20)]
    for name, losses, diverging in (("mock", mock, False), ("rising", rising, True)):
        log = tmp_path / f"{name}.log"
        log.write_text("\n".join(GRAD_LINE.format(it=i + 1, loss=v, norm=1.0) for i, v in enumerate(losses)) + "\n")
        kinds = [a["kind"] for a in call("logs", {"log": str(log)})["result"]["anomalies"]]
        assert ("divergence" in kinds) is diverging, (name, kinds)


def test_grad_norm_spikes_are_reported(tmp_path):
    norms = [1.0] * 10 + [40.0] + [1.0] * 5
    log = tmp_path / "spike.log"
    log.write_text("\n".join(GRAD_LINE.format(it=i + 1, loss=2.0, norm=g) for i, g in enumerate(norms)) + "\n")
    res = call("logs", {"log": str(log)})["result"]
    spike = [a for a in res["anomalies"] if a["kind"] == "grad_norm_spike"]
    assert [a["iteration"] for a in spike] == [11] and any("grad-norm spike" in h for h in res["hints"])


def _dump(**args):
    """A Megatron argument dump, as pretrain prints it at start-up (every rank's copy prefixed)."""
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {k} {'.' * max(3, 40 - len(k))} {v}" for k, v in sorted(args.items())]
    return lines + ["-------------------- end of arguments ---------------------"]


ONE_B = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, group_query_attention=True,
             num_query_groups=8, kv_channels=64, seq_length=4096, max_position_embeddings=4096, swiglu=True,
             normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
             vocab_size=128256, padded_vocab_size=128256, micro_batch_size=8, global_batch_size=8, world_size=1,
             tensor_model_parallel_size=1, pipeline_model_parallel_size=1, transformer_impl="local",
             attention_dropout=0.0, add_bias_linear=False, log_interval=1)


def test_a_stock_local_attention_oom_is_traced_to_its_scores_and_planned_around(tmp_path):
    """Megatron's own entry with --transformer-impl local: the traceback ends in the unfused
    attention's baddbmm; the answer names that fix, predicts the log's own layout with the S x S
    scores counted (over the H200's memory, as the run found), and gives plan's layout that fits."""
    lines = [f"[rank0]: {x}" for x in _dump(**ONE_B)]
    lines += ["[rank0]: Traceback (most recent call last):",
              '[rank0]:   File "/opt/megatron/core/transformer/dot_product_attention.py", line 180, in forward',
              "[rank0]:     matmul_result = torch.baddbmm(",
              "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total "
              "capacity of 139.81 GiB of which 1.2 GiB is free."]
    log = tmp_path / "oom.log"
    log.write_text("\n".join(lines) + "\n")
    r = call("logs", {"log": str(log), "gpu": "h200"})["result"]
    oom = next(f for f in r["failures"] if f["code"] == "out_of_memory")
    assert oom["site"] == "attention_scores" and "SDPA" in oom["fix"] and oom["ranks"] == [0]
    pred = r["prediction"]
    assert pred["assumed"]["attention"].startswith("unfused") and pred["predicted_peak_gib"] > pred["gpu_gib"]
    assert pred["plan"]["peak_gib"] < pred["gpu_gib"] and r["state"] == "failed"
    assert any("fits" in h for h in r["hints"])


def test_tokens_per_second_and_layout_from_the_log_alone():
    """The skill's own H200 log: sequence length, batch and layout from its argument dump (no
    flags), the prediction for its layout beside what it measured, two starts (killed and
    resumed), finished."""
    r = call("logs", {"log": str(FIXTURE)})["result"]
    assert r["arguments"]["seq_length"] == 1024 and r["tokens_per_s"] > 10000
    assert r["starts"] == 2 and r["state"] == "finished" and r["last_logged"]["iteration"] == 40
    assert r["prediction"]["assumed"]["attention"].startswith("sdpa")
    assert abs(r["prediction"]["memory_error_pct"]) < 10


def test_ranks_srun_labels_and_nccl_watchdogs(tmp_path):
    lines = [f"{rank}: " + _line(i) for i in range(1, 6) for rank in (0,)]
    lines += [f"[rank{r}]:[E1202 10:00:00] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"
              for r in (5, 2, 7)]
    lines += ["[rank2]: Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels"]
    log = tmp_path / "nccl.log"
    log.write_text("\n".join(lines) + "\n")
    r = call("logs", {"log": str(log)})["result"]
    assert r["logged_iterations"] == 5
    nccl = next(f for f in r["failures"] if f["code"] == "nccl_timeout")
    assert nccl["ranks"] == [5, 2, 7] and r["state"] == "failed"


def test_a_job_that_stopped_writing_is_called_stalled(tmp_path):
    import os
    import time

    log = tmp_path / "train.log"
    log.write_text("\n".join(_line(i) for i in range(1, 6)) + "\n")
    assert call("logs", {"log": str(log)})["result"]["state"] == "stopped or running"
    hour_ago = time.time() - 3600
    os.utime(log, (hour_ago, hour_ago))
    r = call("logs", {"log": str(log)})["result"]
    assert r["state"] == "stalled"
    stalled = next(a for a in r["anomalies"] if a["kind"] == "stalled")
    assert stalled["iteration"] == 5 and stalled["silent_s"] >= 3600 and any("hang" in h for h in r["hints"])


def test_skipped_iterations_and_a_node_failure(tmp_path):
    lines = [_line(i) for i in range(1, 4)] + [_line(4).replace("skipped iterations:   0", "skipped iterations:   2")]
    lines += ["srun: error: node-17: task 3: Exited with exit code 1", "srun: error: Node failure on node-17"]
    log = tmp_path / "node.log"
    log.write_text("\n".join(lines) + "\n")
    r = call("logs", {"log": str(log)})["result"]
    assert [f["code"] for f in r["failures"]] == ["node_failure"]
    assert r["skipped_iterations"] == 2 and any("2 iteration(s) skipped" in h for h in r["hints"])


# ---- out of memory: the site from the traceback's frames, the fixes from the run's arguments ----
FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def _oom(res):
    return next(f for f in res["failures"] if f["code"] == "out_of_memory")


def test_an_unfused_attention_oom_at_micro_batch_8_gets_fixes_that_fit_the_run():
    """The scores of one layer (8 x 16 heads x 8192^2 in bf16) were being allocated: the fixes are
    attention without S x S scores and a smaller micro-batch; the run has the distributed
    optimizer already, so it is not suggested."""
    env = call("logs", {"log": str(FIXTURES / "oom-unfused-attention-mbs8.log"), "gpu": "h100-sxm"})
    assert env["ok"], env
    oom = _oom(env["result"])
    assert oom["site"] == "attention_scores" and "dot_product_attention.py:194" in oom["frame"], oom
    assert "flash" in oom["fixes"][0] and "about 16.0 GiB" in oom["fixes"][0]
    assert any("--micro-batch-size from 8" in f for f in oom["fixes"])
    assert "--use-distributed-optimizer" not in oom["fix"] and sorted(oom["ranks"]) == [0, 4]
    assert oom["run"]["micro_batch_size"] == 8 and oom["run"]["unfused_attention"]


def test_an_adam_step_oom_with_the_distributed_optimizer_at_dp1_is_not_told_to_shard():
    """torch's foreach Adam died in _foreach_sqrt; the distributed optimizer is on and DP is 1, where
    it shards nothing: the answer says so and offers what helps instead."""
    env = call("logs", {"log": str(FIXTURES / "oom-adam-foreach-distopt-dp1.log"), "gpu": "h100-sxm"})
    assert env["ok"], env   # the plan beside it finds no layout: a hint, not an internal error
    oom = _oom(env["result"])
    assert oom["site"] == "optimizer_step" and "_foreach_sqrt" in oom["frame"], oom
    assert "--use-distributed-optimizer" not in oom["fix"]
    assert "DP 1" in oom["fix"] and "fused Adam" in oom["fix"] and "--optimizer-cpu-offload" in oom["fix"]
    assert any("no layout" in h for h in env["result"]["hints"])


def test_a_one_gpu_oom_at_the_fused_heads_backward_gets_fixes_that_fit_one_gpu():
    """The planner's 3B FP8 layout of 2026-12-07 (one H100, the skill's FP8 layers and fused head,
    micro-batch 1, selective recompute) died allocating the output weight's 752 MiB placeholder in
    the head's backward.  The head keeps little of one sequence; what fills the GPU then is every
    layer's saved activations: full recompute, not a smaller micro-batch (it is 1), and TP only
    with more GPUs than the run's one; the plan beside it is an FP8 plan, as the run was."""
    env = call("logs", {"log": str(FIXTURES / "oom-fused-head-fp8-3b-h100-mbs1.log"), "gpu": "h100-sxm"})
    assert env["ok"], env
    oom = _oom(env["result"])
    assert oom["site"] == "logits" and "fused_head.py" in oom["frame"], oom
    fixes = oom["fixes"]
    assert fixes[0].startswith("--recompute-granularity full") and "micro-batch" not in " ".join(fixes)
    assert "more GPUs than this run's 1" in fixes[-1]
    plan = env["result"]["prediction"]["plan"]
    assert plan["label"].endswith("FP8") and plan["peak_gib"] <= 79.6 - 1.0


def test_a_skill_fp8_runs_memory_is_costed_as_the_plan_that_chose_it():
    """The same run as above: its argument dump prints --recompute-modules as a Python list and
    says FP8 only through --skill-fp8-linear.  The log's prediction is the planner's own figure
    for that FP8 layout (it was once a BF16 layout with a recompute set of single characters)."""
    env = call("logs", {"log": str(FIXTURES / "oom-fused-head-fp8-3b-h100-mbs1.log")})
    pred = env["result"]["prediction"]
    assert pred["layout"] == "TP1 PP1 DP1 mbs1 recompute-sel FP8", pred
    request = json.loads((ROOT / "benchmarks" / "requests" / "llama-3b-shape-bf16.json").read_text())
    plan = call("plan", {"model": request["model"], "gpu": "h100-sxm", "num_gpus": 1, "seq_length": 4096,
                         "global_batch_size": 16, "precision": "fp8", "transformer_engine": False, "top": 1,
                         "constraints": {"mbs": 1, "recompute": ["selective"]}})
    assert plan["ok"], plan
    assert pred["predicted_peak_gib"] == plan["result"]["plans"][0]["memory"]["peak_gib"]


def test_transformer_engines_lever_for_a_skill_fp8_run_names_tes_fp8_flags():
    """The lever is costed as TE's FP8 (the run was FP8): its fix must ask TE for FP8, which the
    skill's --skill-fp8-linear does not do under TE; and a run on Megatron's local layers with
    --fp8-format alone has no FP8 path (its layout is BF16)."""
    r = call("logs", {"log": str(FIXTURES / "oom-fused-head-fp8-3b-h100-mbs1.log"), "gpu": "h100-sxm"})["result"]
    te = [lv for lv in r["why_slow"]["levers"] + r["why_slow"]["not_levers"] if "Transformer Engine" in lv["lever"]]
    assert [lv for lv in te if "--fp8-format hybrid" in lv.get("fix", "")], te
    from megatron_skill.adapter import described
    local = {**ONE_B, "fp8": "hybrid"}
    assert described.precision(described.Args(local)) == "bf16"
    assert described.precision(described.Args({**local, "transformer_impl": "transformer_engine"})) == "fp8"
    skill = {**ONE_B, "skill_entry": True, "skill_fp8_linear": True}
    assert described.precision(described.Args(skill)) == "fp8"
    assert described.precision(described.Args({**skill, "tensor_model_parallel_size": 2})) == "fp8"   # as plan labels it


def test_transformer_engines_lever_keeps_the_fp8_the_arguments_ask_for(tmp_path):
    """Megatron's local layers ignore --fp8-format; TE's honour it: the TE lever of such a run is
    costed in FP8, faster than the same run's lever without --fp8-format."""
    def te_lever(**extra):
        log = tmp_path / f"run{len(extra)}.log"
        slow = [_line(i).replace("(ms): 238.3", "(ms): 5000.0") for i in range(1, 6)]
        args = {**ONE_B, "micro_batch_size": 2, "use_distributed_optimizer": True, **extra}
        log.write_text("\n".join(_dump(**args) + slow) + "\n")
        r = call("logs", {"log": str(log), "gpu": "h100-sxm"})["result"]
        return next(lv for lv in r["why_slow"]["levers"] if "Transformer Engine" in lv["lever"])
    assert te_lever(fp8="hybrid", fp8_recipe="tensorwise")["tokens_per_s"] > te_lever()["tokens_per_s"]


def test_megatrons_dump_of_lists_reads_as_lists():
    from megatron_skill.adapter.described import MAX_LITERAL, literal
    assert literal("['core_attn', 'layernorm']") == ["core_attn", "layernorm"]
    assert literal("(0.9, 0.95)") == (0.9, 0.95)
    assert literal("[unclosed") == "[unclosed" and literal("{1, 2}") == "{1, 2}"
    assert literal("[" * 10000) == "[" * 10000
    # keys that would print alike in the answer, and a literal longer than any flag's value
    assert literal("{1: 'a', '1': 'b'}") == "{1: 'a', '1': 'b'}"
    long = "[" + ",".join(["1"] * MAX_LITERAL) + "]"
    assert literal(long) == long


def test_a_damaged_dump_reads_as_unset_where_its_values_are_not_their_flags_type(tmp_path):
    """Values of the wrong type for their flag (hand-edited or garbled dumps) are set aside and
    said so; the rest of the answer is as for a clean dump, never an internal error."""
    bad = {"recompute_granularity": "[1]", "recompute_modules": "[['core_attn']]", "seq_length": "'long'",
           "moe_router_dtype": "['fp32']", "micro_batch_size": "[8]", "world_size": "'one'", "log_interval": "[1]"}
    lines = _dump(**{**ONE_B, **bad, "num_experts": 8, "moe_router_topk": 2})
    lines.append(_line(1))
    log = tmp_path / "damaged.log"
    log.write_text("\n".join(lines) + "\n")
    env = call("logs", {"log": str(log), "gpu": "h100-sxm"})
    assert env["ok"], env
    r = env["result"]
    assert set(r["arguments_ignored"]) == set(bad), r["arguments_ignored"]
    assert "integer" in r["arguments_ignored"]["seq_length"]
    assert r["prediction"]["layout"].startswith("TP1 PP1 DP1 mbs1"), r["prediction"]
    # nothing kept at all is still said; numbers in string flags and an infinite float are no damage
    only_bad = tmp_path / "only_bad.log"
    only_bad.write_text("\n".join(_dump(seq_length="abc", micro_batch_size="[1]") + [_line(1)]) + "\n")
    assert set(call("logs", {"log": str(only_bad)})["result"]["arguments_ignored"]) == {"seq_length", "micro_batch_size"}
    fine = tmp_path / "fine.log"
    fine.write_text("\n".join(_dump(**ONE_B, split=100, clip_grad="inf", wandb_project=2026) + [_line(1)]) + "\n")
    assert "arguments_ignored" not in call("logs", {"log": str(fine)})["result"]
    # literals are read for the names a flag knows only (a log may hold any number of others)
    from megatron_skill.adapter.described import typed_arguments
    assert typed_arguments({"not_a_flag": "[1]", "recompute_modules": "['mlp']"})[0] == \
        {"not_a_flag": "[1]", "recompute_modules": ["mlp"]}
    # a real dump of the skill's own run: nothing set aside
    clean = call("logs", {"log": str(FIXTURES / "oom-fused-head-fp8-3b-h100-mbs1.log")})["result"]
    assert "arguments_ignored" not in clean


def test_logits_fixes_tell_megatrons_loss_fusion_from_the_skills_head():
    """Megatron's --cross-entropy-loss-fusion still holds the whole bf16 logits: such a run is
    offered the skill's head, not told that its head keeps little; a run with nothing left to
    offer there still gets a fix."""
    from megatron_skill.adapter.log import RunFacts, _logits_fixes

    base = dict(mbs=1, gbs=16, dp=1, tp=1, pp=1, cp=1, seq=4096, heads=24, distributed_optimizer=True,
                recompute="selective", unfused_attention=False, sequence_parallel=False)
    megatron = _logits_fixes(RunFacts(**base, fused_cross_entropy=True, skill_head=False))
    assert "--skill-linear-cross-entropy" in megatron[0] and "--cross-entropy-loss-fusion" not in megatron[0]
    assert not any("saved activations" in f for f in megatron)
    skill = _logits_fixes(RunFacts(**base, fused_cross_entropy=False, skill_head=True))
    assert skill[0].startswith("--recompute-granularity full")
    spent = _logits_fixes(RunFacts(**{**base, "tp": 8, "recompute": "full"}, fused_cross_entropy=False, skill_head=True))
    assert spent and "PP" in spent[0]


def _frames(*places):
    out = ["[rank0]: Traceback (most recent call last):"]
    for path, func, code in places:
        out += [f'[rank0]:   File "/opt/pkgs/{path}", line 10, in {func}', f"[rank0]:     {code}"]
    return out + ["[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."]


TRAIN = ("megatron/training/training.py", "train_step", "losses_reduced = forward_backward_func(")
SITES = {
    # the innermost frame is a generic linear layer: the output layer above it names the site
    "logits": [TRAIN, ("megatron/core/models/gpt/gpt_model.py", "forward", "logits, _ = self.output_layer("),
               ("megatron/core/tensor_parallel/layers.py", "forward", "output_parallel = self._forward_impl(")],
    # a load reaches the optimizer's code: it is the load that failed
    "checkpoint_load": [("megatron/training/checkpointing.py", "load_checkpoint",
                         "optimizer.load_state_dict(state_dict['optimizer'])"),
                        ("megatron/core/optimizer/distrib_optimizer.py", "load_state_dict",
                         "self.load_parameter_state_from_dp_zero(")],
    "activations": [TRAIN, ("megatron/core/pipeline_parallel/schedules.py", "backward_step",
                            "custom_backward(output_tensor[0], output_tensor_grad[0])"),
                    ("torch/autograd/graph.py", "_engine_run_backward",
                     "return Variable._execution_engine.run_backward(")],
}


def test_the_site_comes_from_the_frames_of_the_last_traceback(tmp_path):
    """An earlier traceback (a warning's, inside the optimizer) does not decide the site of the
    out-of-memory error below it; a site named by an outer frame beats a generic inner one."""
    earlier = _frames(("torch/optim/adam.py", "step", "adam("))[:-1] + ["[rank0]: UserWarning: a passing notice"]
    for site, places in SITES.items():
        log = tmp_path / f"{site}.log"
        log.write_text("\n".join([f"[rank0]: {x}" for x in _dump(**ONE_B)] + earlier + _frames(*places)) + "\n")
        oom = _oom(call("logs", {"log": str(log)})["result"])
        assert oom["site"] == site, (site, oom)
        assert oom["fixes"] and "--use-distributed-optimizer" not in oom["fix"]


def test_sharding_is_suggested_only_where_it_shards(tmp_path):
    step = _frames(TRAIN[:2] + ("optimizer.step()",), ("torch/optim/adam.py", "_multi_tensor_adam",
                                                       "torch._foreach_add_(device_exp_avgs, device_grads)"))
    for dp, distopt, suggested in ((4, False, True), (1, False, False), (4, True, False)):
        args = {**ONE_B, "world_size": dp, "data_parallel_size": dp, "use_distributed_optimizer": distopt}
        log = tmp_path / f"dp{dp}-{distopt}.log"
        log.write_text("\n".join(_dump(**args) + step) + "\n")
        oom = _oom(call("logs", {"log": str(log)})["result"])
        assert oom["site"] == "optimizer_step"
        assert ("--use-distributed-optimizer" in oom["fix"]) is suggested, (dp, distopt, oom["fix"])
        assert ("DP 1" in oom["fix"]) is (dp == 1)


def test_a_zero_millisecond_iteration_has_no_rate_and_raises_nothing(tmp_path):
    lines = [_line(i).replace("elapsed time per iteration (ms): ", "elapsed time per iteration (ms): 0.0 | x: ", 1)
             for i in range(1, 6)]
    s = megatron_log.summarize(megatron_log.parse(lines), seq_length=4096)
    assert s["iter_ms_median"] == 0.0 and "tokens_per_s" not in s
    log = tmp_path / "zero.log"
    log.write_text("\n".join(lines) + "\n")
    assert call("logs", {"log": str(log)})["ok"]


STOCK = Path(__file__).parent / "fixtures" / "logs" / "stock-3b-h200-local-unfused.log"


def test_why_slow_on_a_stock_local_run():
    """A stock run of the 3B shape on one H200 at about 9.1k tokens/s: local layers, unfused
    attention, no fusions. The planner's prediction for the same arguments sits beside the
    measured speed, and the levers come biggest first: the skill's fused paths, TE and fused
    attention far ahead, each lifting the run to the planner's 22-25k; micro-batch 2 does not fit
    beside the unfused scores."""
    r = call("logs", {"log": str(STOCK), "gpu": "h200"})["result"]
    slow = r["why_slow"]
    assert 9000 < slow["measured_tokens_per_s"] < 9200
    assert slow["as_run"]["attention"] == "unfused" and not slow["as_run"]["transformer_engine"]
    assert not any(slow["as_run"]["skill_paths"].values())
    assert slow["as_run"]["attention_extra_ms"] > 0 and "attributed" in slow
    levers = slow["levers"]
    gains = [lv["gain_pct"] for lv in levers]
    assert gains == sorted(gains, reverse=True) and len(levers) >= 3
    top3 = " | ".join(lv["lever"] for lv in levers[:3])
    assert "skill's fused paths" in top3 and "Transformer Engine" in top3 and "fused attention" in top3
    for lv in levers[:3]:
        assert 20000 < lv["tokens_per_s"] < 27000 and lv["gain_pct"] > 100, lv
    assert "--no-create-attention-mask-in-dataloader" in levers[0]["fix"]
    assert any("micro-batch 2" in n["lever"] and "139.8 GiB" in n["why"] for n in slow["not_levers"])
    assert any(h.startswith("slow: ") for h in r["hints"][:3])


def test_why_slow_needs_the_gpu_and_names_a_masked_sdpa_run(tmp_path):
    assert "skipped" in call("logs", {"log": str(STOCK)})["result"]["why_slow"]
    # the skill's entry with the dataloader's mask left on: SDPA over the whole square
    text = STOCK.read_text().replace("  create_attention_mask_in_dataloader ............. True",
                                     "  create_attention_mask_in_dataloader ............. True\n"
                                     "  skill_linear_cross_entropy ...................... True\n"
                                     "  skill_fused_adam ................................ True\n"
                                     "  skill_compiled_rope ............................. True\n"
                                     "  skill_native_gqa ................................ True")
    log = tmp_path / "masked.log"
    log.write_text(text.replace("gradient_accumulation_fusion .................... False",
                                "gradient_accumulation_fusion .................... True"))
    slow = call("logs", {"log": str(log), "gpu": "h200"})["result"]["why_slow"]
    assert slow["as_run"]["attention"] == "sdpa_masked"
    assert slow["levers"][0]["fix"] == "add --no-create-attention-mask-in-dataloader"
    assert not any("skill's fused paths" in lv["lever"] for lv in slow["levers"] + slow["not_levers"])


def test_a_log_holding_several_runs_is_read_as_its_last_run(tmp_path):
    """A launch that appends every start to one log (tee -a): a dump with another model, layout or
    batch starts another run, and the answer is the last run's: its state, speed, arguments and
    an OOM's fixes from its own arguments; the runs before it are listed. A resume (the same
    arguments again) continues the run it resumes."""
    ok, oom = (FIXTURES / "skill-1b-h100-mbs4.log").read_text(), (FIXTURES / "oom-unfused-attention-mbs8.log").read_text()
    (tmp_path / "ok-then-oom.log").write_text(ok + oom)
    (tmp_path / "oom-then-ok.log").write_text(oom + ok)
    r = call("logs", {"log": str(tmp_path / "ok-then-oom.log"), "gpu": "h100-sxm"})["result"]
    assert r["state"] == "failed" and r["arguments"]["micro_batch_size"] == 8
    assert [e["logged_iterations"] for e in r["earlier_runs"]] == [6] and not r["earlier_runs"][0]["failures"]
    assert "S x S" in r["failures"][0]["fix"] and "--micro-batch-size from 4" not in r["failures"][0]["fix"]
    r = call("logs", {"log": str(tmp_path / "oom-then-ok.log"), "gpu": "h100-sxm"})["result"]
    alone = call("logs", {"log": str(FIXTURES / "skill-1b-h100-mbs4.log"), "gpu": "h100-sxm"})["result"]
    assert r["state"] == "finished" and not r["failures"]
    assert r["tokens_per_s"] == alone["tokens_per_s"] and r["loss_curve"] == alone["loss_curve"]
    assert r["earlier_runs"][0]["failures"][0]["code"] == "out_of_memory"
    # a kill and a resume with the same arguments: one run of two starts
    resumed = call("logs", {"log": str(FIXTURE)})["result"]
    assert resumed["starts"] == 2 and "earlier_runs" not in resumed
    # a resume that trains longer and saves elsewhere is the same run
    longer = tmp_path / "longer.log"
    longer.write_text("\n".join(_dump(**ONE_B, train_iters=40, save="/a") + [_line(1), _line(2)]
                                + _dump(**ONE_B, train_iters=80, save="/b") + [_line(3)]) + "\n")
    again = call("logs", {"log": str(longer)})["result"]
    assert again["starts"] == 2 and again["logged_iterations"] == 3 and "earlier_runs" not in again
    # read while a restart starts: its dump half printed, or whole with nothing after it yet
    lines = FIXTURE.read_text().splitlines()
    second = [i for i, line in enumerate(lines) if "-- arguments --" in line][1]
    for cut in (second + 40, second + 900):
        (tmp_path / "starting.log").write_text("\n".join(lines[:cut]) + "\n")
        mid = call("logs", {"log": str(tmp_path / "starting.log")})["result"]
        assert mid["last_iteration"] == 26 and "earlier_runs" not in mid, cut   # killed after 26
    # a start killed inside its dump, then the resume; and an interleaved line in the resume's dump
    killed = lines[:second + 40] + lines[second:]
    garbled = [line + "[rank3]:W1202 UserWarning" if " num_layers ..." in line and i > second else line
               for i, line in enumerate(lines)]
    for text in (killed, garbled):
        (tmp_path / "odd.log").write_text("\n".join(text) + "\n")
        odd = call("logs", {"log": str(tmp_path / "odd.log")})["result"]
        assert odd["logged_iterations"] == resumed["logged_iterations"] and "earlier_runs" not in odd


def test_why_slow_costs_only_runs_megatron_could_have_started(tmp_path):
    """A damaged or edited dump with sizes no run has (10^8 layers, a 10^30 hidden size, TP that
    splits no head evenly) is not costed: the answer says which size and why, at once (10^8
    layers used to take minutes and gigabytes to cost), and the rest of the summary stands."""
    def why(**changed):
        log = tmp_path / "edited.log"
        log.write_text("\n".join(_dump(**{**ONE_B, **changed}) + [_line(1), _line(2)]) + "\n")
        r = call("logs", {"log": str(log), "gpu": "h100-sxm"})["result"]
        assert r["tokens_per_s"] > 0
        return r["why_slow"].get("skipped", "")
    assert why() == ""
    assert why(num_layers=10**8).startswith("num_layers: 100000000 is above the most of 4096")
    assert why(hidden_size=10**30).startswith("hidden_size: ")
    assert why(micro_batch_size=10**11).startswith("micro_batch_size: ")
    assert why(tensor_model_parallel_size=10**30).startswith("tensor_model_parallel_size: ")
    assert why(num_attention_heads=0).startswith("num_attention_heads: 0 is below the least of 1")
    assert why(micro_batch_size=0).startswith("micro_batch_size: 0 is below the least of 1")
    refused = why(tensor_model_parallel_size=3)
    assert refused.startswith("these arguments describe no run Megatron starts") and "divisible by TP" in refused
    assert "divisible by PP" in why(pipeline_model_parallel_size=3)
    # TP across nodes is the planner's preference, not Megatron's rule: still costed
    assert why(tensor_model_parallel_size=16, num_attention_heads=32, num_query_groups=16, world_size=16,
               global_batch_size=128) == ""


def test_why_slow_leaves_a_host_bound_gap_unexplained():
    """The real H200 log of a 134M-parameter model runs far below the planner's prediction (its
    kernels are too small to fill the GPU): at most four times the masked attention's count is
    put on it, the rest is said to be unexplained, and the gains stay in proportion."""
    slow = call("logs", {"log": str(FIXTURE), "gpu": "h200"})["result"]["why_slow"]
    assert slow["as_run"]["attention"] == "sdpa_masked"
    assert "x4.00 its count" in slow["attributed"] and "unexplained" in slow
    assert all(lv["tokens_per_s"] < 2 * slow["measured_tokens_per_s"] for lv in slow["levers"])


def test_why_slow_predicts_the_fixed_run_measured_on_the_gpu():
    """Real runs on one H100: Megatron-LM's stock pretrain_gpt.py on local layers at 13.7k tokens/s,
    then the same model and batch through the skill's entry (its fused paths, no explicit mask).
    The stock log's levers put the fused paths, TE and fused attention first, each above 3x; the
    fused paths' predicted tokens/s is within 15 % of what the fixed run measured, micro-batch 2
    is refused for memory beside the unfused scores, and the fixed run's own log is predicted
    within 15 % with nothing left to attribute."""
    logs = Path(__file__).parent / "fixtures" / "logs"
    stock = call("logs", {"log": str(logs / "stock-1b-h100-local-unfused.log"), "gpu": "h100-sxm"})["result"]
    fixed = call("logs", {"log": str(logs / "skill-1b-h100-mbs1.log"), "gpu": "h100-sxm"})["result"]
    slow = stock["why_slow"]
    assert 13000 < slow["measured_tokens_per_s"] < 14500 and slow["as_run"]["attention"] == "unfused"
    top3 = {lv["lever"].split(" (")[0].split(" instead")[0]: lv for lv in slow["levers"][:3]}
    assert set(top3) == {"Transformer Engine's layers", "the skill's fused paths for the local layers",
                         "fused attention"}, list(top3)
    assert all(lv["gain_pct"] > 200 for lv in top3.values())
    predicted = top3["the skill's fused paths for the local layers"]["tokens_per_s"]
    assert abs(predicted - fixed["tokens_per_s"]) / fixed["tokens_per_s"] < 0.15, (predicted, fixed["tokens_per_s"])
    assert any(n["lever"].startswith("micro-batch 2") and "GiB" in n["why"] for n in slow["not_levers"])
    own = fixed["why_slow"]
    assert own["as_run"]["attention"] == "sdpa" and "attributed" not in own and abs(own["prediction_error_pct"]) < 15
    assert not any("skill's fused paths" in lv["lever"] or "causal attention" in lv["lever"] for lv in own["levers"])


def test_the_memory_prediction_says_which_vocabulary(tmp_path):
    """The log's dump names a Llama2Tokenizer whose model file lies here: its pieces are the
    vocabulary the memory prediction used, not the assumed default."""
    sp = Path(__file__).parent / "fixtures" / "tokenizers" / "sentencepiece-300.model"
    text = STOCK.read_text().replace("  tokenizer_type .................................. NullTokenizer",
                                     "  tokenizer_type .................................. Llama2Tokenizer")
    text = text.replace("  tokenizer_model ................................. None",
                        f"  tokenizer_model ................................. {sp}")
    text = text.replace("  vocab_size ...................................... 128256",
                        "  vocab_size ...................................... None")
    log = tmp_path / "sp.log"
    log.write_text(text)
    vocab = call("logs", {"log": str(log)})["result"]["prediction"]["vocabulary"]
    assert vocab == {"size": 300, "source": f"Llama2Tokenizer: the 300 pieces of {sp}", "read": True}
    vocab = call("logs", {"log": str(STOCK)})["result"]["prediction"]["vocabulary"]
    assert vocab["size"] == 128256 and vocab["source"].startswith("--vocab-size 128256 (NullTokenizer")


def test_a_damaged_logs_speeds_that_are_no_numbers_are_left_out(tmp_path):
    """Iteration times so small that the rate overflows, or inf: no tokens/s is made up (JSON has no
    inf), the rest of the summary stands."""
    import re

    text = (FIXTURES / "skill-1b-h100-mbs1.log").read_text()
    for value in ("1e-320", "inf"):
        log = tmp_path / f"{value}.log"
        log.write_text(re.sub(r"elapsed time per iteration \(ms\): [0-9.]+",
                              f"elapsed time per iteration (ms): {value}", text))
        r = call("logs", {"log": str(log), "gpu": "h100-sxm"})
        assert r["ok"] and "tokens_per_s" not in r["result"], r
        assert r["result"]["final_loss"] and r["result"]["logged_iterations"]


# A crash of each kind a log ends in besides memory and NCCL: the traceback's own last line,
# or torchrun's summary, makes the run failed (never "stopped or running").
_TRACEBACK = ("[rank0]: Traceback (most recent call last):\n"
              '[rank0]:   File "/workspace/Megatron-LM/pretrain_gpt.py", line 300, in <module>\n'
              "[rank0]:     pretrain(train_valid_test_datasets_provider, model_provider)\n"
              '[rank0]:   File "/workspace/Megatron-LM/megatron/core/datasets/indexed_dataset.py", line 412, in __init__\n'
              "[rank0]:     self.bin_reader = _MMapBinReader(self.path_prefix + '.bin')\n")
CRASHES = {
    "exception": _TRACEBACK + "[rank0]: FileNotFoundError: [Errno 2] No such file or directory: '/data/c.bin'\n",
    "kernel_fault": _TRACEBACK + "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered\n",
    "host_out_of_memory": _TRACEBACK + "[rank0]: RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. "
                                       "DefaultCPUAllocator: can't allocate memory: you tried to allocate 42 bytes\n",
    "worker_failed": "E1207 10:00:01 api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 77) of binary: python\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
}


def test_a_crash_of_any_kind_makes_the_run_failed_with_its_cause(tmp_path):
    for code, tail in CRASHES.items():
        log = tmp_path / f"{code}.log"
        log.write_text("\n".join(_line(i, 3.0) for i in range(1, 6)) + "\n" + tail)
        r = call("logs", {"log": str(log)})["result"]
        assert r["state"] == "failed", (code, r["state"])
        assert r["failures"][0]["code"] == code, (code, r["failures"])
    first = call("logs", {"log": str(tmp_path / "exception.log")})["result"]["failures"][0]
    assert "FileNotFoundError" in first["meaning"] and "indexed_dataset.py:412" in first["meaning"]
    assert "--data-path" in first["fix"] and first["ranks"] == [0]
    # a traceback already named by a known failure is that failure alone, not also an 'exception'
    oom = tmp_path / "oom.log"
    oom.write_text(_TRACEBACK + "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")
    assert [f["code"] for f in call("logs", {"log": str(oom)})["result"]["failures"]] == ["out_of_memory"]
    # an error word in a line far from any traceback (a data sample, a warning) is no crash
    calm = tmp_path / "calm.log"
    calm.write_text("\n".join(_line(i, 3.0) for i in range(1, 6)) + "\nValueError: in sample text\n")
    assert call("logs", {"log": str(calm)})["result"]["failures"] == []


def test_a_loss_that_jumps_and_stays_up_is_one_spike_and_the_rise_ends_at_its_last_finite_loss(tmp_path):
    lines = [_line(i, 3.0) for i in range(1, 21)] + [_line(i, 30.0) for i in range(21, 30)] + \
        [_line(30, "nan", nan=1)]
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines))
    anomalies = call("logs", {"log": str(log)})["result"]["anomalies"]
    assert [a["iteration"] for a in anomalies if a["kind"] == "loss_spike"] == [21]
    assert next(a for a in anomalies if a["kind"] == "divergence")["iteration"] == 29


def test_a_plot_is_a_new_png_or_a_clear_error_and_never_replaces_a_file(tmp_path, cli):
    import importlib.util
    log = tmp_path / "train.log"
    log.write_text("\n".join(_line(i, 3.0) for i in range(1, 6)))
    mine = tmp_path / "mine.png"
    mine.write_text("the user's own")
    rc, out, _ = cli("logs", "--log", str(log), "--plot", str(mine))
    assert rc == 6 and out["error"]["code"] == "conflict" and mine.read_text() == "the user's own"
    rc, out, _ = cli("logs", "--log", str(log), "--plot", str(tmp_path / "notes.txt"))
    assert rc == 2 and out["error"]["where"] == "/plot" and not (tmp_path / "notes.txt").exists()
    rc, out, _ = cli("logs", "--log", str(log), "--plot", str(tmp_path / "new" / "curve.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 5 and out["error"]["code"] == "environment" and not (tmp_path / "new").exists()
    else:
        assert rc == 0 and (tmp_path / "new" / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_an_exception_the_run_trained_on_after_is_no_failure(tmp_path):
    """A logger's lost connection mid-run (a traceback, then more iterations), and Python's
    "Exception ignored in" at the interpreter's exit: the run is not failed; an exception after
    the last iteration still is."""
    handled = ("Traceback (most recent call last):\n"
               '  File "/usr/lib/python3/site-packages/wandb/sdk/internal/sender.py", line 10, in send\n'
               "requests.exceptions.ConnectionError: Connection aborted.\n")
    ignored = ("Exception ignored in: <function Pool.__del__ at 0x7f>\nTraceback (most recent call last):\n"
               '  File "/usr/lib/python3.12/multiprocessing/pool.py", line 268, in __del__\n'
               "AttributeError: 'NoneType' object has no attribute 'put'\n")
    cases = {"mid_run": ("\n".join(_line(i, 3.0) for i in range(1, 4)) + "\n" + handled +
                         "\n".join(_line(i, 3.0) for i in range(4, 8)) + "\n", "stopped or running"),
             "at_exit": ("\n".join(_line(i, 3.0) for i in range(1, 6)) + "\n" + ignored, "stopped or running"),
             "fatal": ("\n".join(_line(i, 3.0) for i in range(1, 4)) + "\n" + handled +
                       "\n".join(_line(i, 3.0) for i in range(4, 8)) + "\n" + handled, "failed")}
    for name, (text, state) in cases.items():
        log = tmp_path / f"{name}.log"
        log.write_text(text)
        r = call("logs", {"log": str(log)})["result"]
        assert r["state"] == state, (name, r["state"], r["failures"])


def test_counts_of_each_interval_add_up_and_a_nan_is_dated_where_megatron_drops_the_loss(tmp_path):
    """Megatron's skipped and NaN counts are of one logging interval each (it resets them after
    printing): the run's count is their sum. A line whose interval had a NaN has no lm loss at
    all: the NaN is dated at that line, and final_loss says which iteration it is of."""
    skipping = [_line(i).replace("skipped iterations:   0", "skipped iterations:   2") for i in range(1, 11)]
    (tmp_path / "skip.log").write_text("\n".join(skipping) + "\n")
    assert call("logs", {"log": str(tmp_path / "skip.log")})["result"]["skipped_iterations"] == 20
    dropped = [_line(i, 3.0 - i * 0.01) for i in range(1, 6)]
    dropped += [_line(i).replace(" lm loss: 3.000000E+00 |", "").replace("nan iterations:   0", "nan iterations:   4")
                for i in range(6, 9)]
    (tmp_path / "nan.log").write_text("\n".join(dropped) + "\n")
    r = call("logs", {"log": str(tmp_path / "nan.log")})["result"]
    assert r["nan_iterations"] == 12 and r["final_loss_iteration"] == 5 and r["last_iteration"] == 8
    assert [a["iteration"] for a in r["anomalies"] if a["kind"] == "nan"] == [6]
    assert any("from iteration 6" in h for h in r["hints"])


def test_a_failure_the_same_run_resumed_after_is_its_history_not_its_state(tmp_path):
    """One log appended to by two starts of the same run (tee -a): the first ends in an NCCL
    timeout, the second resumes and finishes. The run is finished; the timeout is kept as what
    the run resumed after. A different run after a failure keeps the failure with that run."""
    first = _dump(**ONE_B, train_iters=6) + [_line(i) for i in (1, 2, 3)]
    first += ["[rank5]:[E1202] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"]
    second = _dump(**ONE_B, train_iters=6) + [_line(i) for i in (4, 5, 6)] + ["[after training is done]"]
    log = tmp_path / "resumed.log"
    log.write_text("\n".join(first + second) + "\n")
    r = call("logs", {"log": str(log)})["result"]
    assert r["state"] == "finished" and r["failures"] == [], r["failures"]
    assert [(f["code"], f["ranks"], f["after_iteration"]) for f in r["resumed_after"]] == [("nccl_timeout", [5], 3)]
    failing_again = tmp_path / "again.log"
    failing_again.write_text("\n".join(first + second[:-1] + [first[-1]]) + "\n")
    r = call("logs", {"log": str(failing_again)})["result"]
    assert r["state"] == "failed" and [f["code"] for f in r["failures"]] == ["nccl_timeout"]
    # a different run after both starts: it has no resumes of its own; the run before keeps its failure
    other = _dump(**{**ONE_B, "hidden_size": 4096}, train_iters=6) + [_line(i) for i in (1, 2)]
    log.write_text("\n".join(first + second + other) + "\n")
    r = call("logs", {"log": str(log)})["result"]
    assert "resumed_after" not in r and r["earlier_runs"][0]["failures"][0]["code"] == "nccl_timeout", r


def _traceback(rank, frames, error):
    """A rank's traceback as torchrun prefixes it: frames (path, line, function, code), then the error."""
    lines = [f"[rank{rank}]: Traceback (most recent call last):"]
    for path, line, func, code in frames:
        lines += [f'[rank{rank}]:   File "{path}", line {line}, in {func}', f"[rank{rank}]:     {code}"]
    return lines + [f"[rank{rank}]: {error}"]


OOM_ERROR = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 79.10 GiB"
IN_TRAINING = [("/m/megatron/training/training.py", 2400, "train", "train_step(...)")]
ATTENTION = IN_TRAINING + [("/m/megatron/core/transformer/dot_product_attention.py", 161, "forward",
                      "matmul_result = torch.baddbmm(")]
LOGITS = IN_TRAINING + [("/m/megatron/core/tensor_parallel/cross_entropy.py", 140, "forward",
                   "exp_logits = vocab_parallel_logits.exp()")]
SAVE = IN_TRAINING + [("/m/megatron/training/checkpointing.py", 480, "save_checkpoint", "state_dict = ..."),
                ("/m/megatron/core/optimizer/distrib_optimizer.py", 1100, "get_parameter_state_dp_zero", "recv")]
LOAD = [("/m/megatron/training/checkpointing.py", 1300, "load_checkpoint", "state_dict = ..."),
        ("/m/megatron/core/dist_checkpointing/strategies/torch.py", 900, "load", "checkpoint.load_state_dict(")]


def test_interleaved_ranks_each_get_the_oom_site_of_their_own_traceback(tmp_path):
    """Rank 0 dies in unfused attention and rank 7 (the last pipeline stage) in the cross-entropy;
    their lines interleave. Each OOM is reported with its own rank's frame, and the attention one
    keeps its fix."""
    a, b = _traceback(0, ATTENTION, OOM_ERROR), _traceback(7, LOGITS, OOM_ERROR.replace("GPU 0", "GPU 7"))
    mixed = [line for pair in zip(a, b) for line in pair]
    log = tmp_path / "two.log"
    log.write_text("\n".join(_dump(**{**ONE_B, "transformer_impl": "local"}) + [_line(1), _line(2)] + mixed) + "\n")
    ooms = [f for f in call("logs", {"log": str(log)})["result"]["failures"] if f["code"] == "out_of_memory"]
    assert {(f["ranks"][0], f["site"]) for f in ooms} == {(0, "attention_scores"), (7, "logits")}, ooms
    for f in ooms:
        assert ("dot_product_attention" if f["site"] == "attention_scores" else "cross_entropy") in f["frame"]


def test_an_oom_in_a_save_is_the_saves_and_fixes_of_a_checkpoint_leave_out_what_the_run_has(tmp_path):
    """A save that runs out of memory after training steps fitted is not a load; a load's fixes
    do not offer the checkpoint format or --no-load-optim the run already has."""
    log = tmp_path / "save.log"
    log.write_text("\n".join(_dump(**ONE_B, ckpt_format="torch") + [_line(1), _line(2)]
                             + _traceback(0, SAVE, OOM_ERROR)) + "\n")
    oom = _oom(call("logs", {"log": str(log)})["result"])
    assert oom["site"] == "checkpoint_save" and "torch_dist" in oom["fix"] and "the save" in oom["fix"], oom
    log.write_text("\n".join(_dump(**ONE_B, ckpt_format="torch_dist", no_load_optim=True)
                             + _traceback(0, LOAD, OOM_ERROR)) + "\n")
    oom = _oom(call("logs", {"log": str(log)})["result"])
    assert oom["site"] == "checkpoint_load" and "--ckpt-format" not in oom["fix"] and "--no-load-optim" not in oom["fix"]


def test_torchruns_summary_names_the_failed_ranks(tmp_path):
    summary = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
               "pretrain_gpt.py FAILED", "-" * 60, "Failures:"]
    for i, rank in enumerate((3, 11)):
        summary += [f"[{i + 1}]:", "  time      : 2026-12-07_12:30:01", "  host      : node002",
                    f"  rank      : {rank} (local_rank: {rank % 8})", "  exitcode  : 1 (pid: 500)"]
    log = tmp_path / "child.log"
    log.write_text("\n".join([_line(1), _line(2)] + summary) + "\n")
    failed = next(f for f in call("logs", {"log": str(log)})["result"]["failures"] if f["code"] == "worker_failed")
    assert failed["ranks"] == [3, 11], failed


def test_a_log_without_rank_prefixes_keeps_its_tracebacks_frames_whatever_rank_its_text_names(tmp_path):
    """Megatron's '[Rank 0] ... memory (MB)' line and an error that says 'on rank 1' are no rank
    prefixes: the traceback's own lines (unprefixed) still give the OOM its site."""
    frames = [line.split("]: ", 1)[1] for line in _traceback(0, LOGITS, OOM_ERROR + " (on rank 1)")]
    memory = "[Rank 0] (after 2 iterations) memory (MB) | allocated: 100.0 | max allocated: 200.0 | reserved: 300.0 " \
             "| max reserved: 300.0"
    log = tmp_path / "plain.log"
    log.write_text("\n".join([_line(1), _line(2), memory] + frames) + "\n")
    oom = _oom(call("logs", {"log": str(log)})["result"])
    assert oom["site"] == "logits" and "cross_entropy.py" in oom["frame"], oom


def test_counts_too_large_to_add_up_are_no_internal_error(tmp_path):
    huge = [_line(i).replace("skipped iterations:   0", "skipped iterations:   1e308") for i in range(1, 4)]
    (tmp_path / "huge.log").write_text("\n".join(huge) + "\n")
    env = call("logs", {"log": str(tmp_path / "huge.log")})
    assert env["ok"] and env["result"]["skipped_iterations"] >= 10 ** 300, env
