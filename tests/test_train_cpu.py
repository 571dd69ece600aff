"""train on CPU asks the rule book: a layout the CPU loop cannot run (context, expert or virtual
pipeline parallelism, sequence parallelism, an MoE model at TP > 1) is refused with the rule's
words before anything runs, and the request's runtime options are run or refused, never dropped."""
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_skill.contract import call
from megatron_skill.core.layout import RULES

TINY_MOE = {"name": "tiny-moe", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
            "num_query_groups": 2, "kv_channels": 16, "vocab_size": 256, "num_experts": 4, "moe_router_topk": 2,
            "moe_ffn_hidden_size": 64}


def _dry(tmp_path, **over) -> dict:
    req = {"model": "tiny-gpt", "backend": "cpu", "num_gpus": 2, "runs_root": str(tmp_path), "dry_run": True,
           "seq_length": 64, **over}
    return call("train", req)


@pytest.mark.parametrize("layout, rule", [
    ({"cp": 2}, "cp_needs_te"),
    ({"pp": 2, "vp": 2}, "cpu_loop_vp"),
    ({"ep": 2}, "cpu_loop_ep"),
    ({"pp": 2, "pipeline_split": "embedding_loss"}, "cpu_loop_pipeline_split"),
    ({"tp": 2, "sequence_parallel": True}, "cpu_loop_sequence_parallel"),
    ({"recompute": "selective"}, "cpu_loop_recompute"),
    ({"distributed_optimizer": True}, "cpu_loop_distributed_optimizer"),
    ({"tp": 3}, "world_size"),
    ({"tp": 2, "dp": 2}, "world_size"),
])
def test_a_layout_the_cpu_loop_cannot_run_is_refused_by_its_rule(tmp_path, layout, rule):
    out = _dry(tmp_path, layout=layout)
    assert not out["ok"] and out["error"]["code"] == "infeasible", out
    assert f"'{rule}'" in out["error"]["message"] and RULES[rule].message in out["error"]["message"]
    assert out["error"]["where"] == "/layout" and not (tmp_path / out["request_id"]).exists()


def test_an_moe_model_at_tp2_is_refused_up_front_not_at_its_first_forward(tmp_path):
    out = _dry(tmp_path, model=TINY_MOE, layout={"tp": 2})
    assert not out["ok"] and "'cpu_loop_moe_tp'" in out["error"]["message"], out
    assert _dry(tmp_path, model=TINY_MOE)["ok"]   # TP 1: two data-parallel ranks


def test_the_layout_the_loop_runs_is_the_answers(tmp_path):
    out = _dry(tmp_path, layout={"tp": 2, "mbs": 2}, global_batch_size=4)
    assert out["ok"], out
    lay = out["result"]["layout"]
    assert (lay["tp"], lay["pp"], lay["cp"], lay["dp"], lay["mbs"], lay["gbs"]) == (2, 1, 1, 1, 2, 4)
    assert not lay["sequence_parallel"] and not lay["distributed_optimizer"]


def test_runtime_options_reach_the_loop_or_are_refused(tmp_path):
    plain = _dry(tmp_path)
    assert plain["ok"] and not any(v for k, v in plain["result"]["runtime"].items()
                                   if k not in ("sdpa_backend", "fused_wgrad_accumulation", "fp8_scaling")), plain
    assert plain["result"]["runtime"]["fp8_scaling"] == "current"
    asked = _dry(tmp_path, runtime={"compiled_rope": False, "sdpa_backend": "math"})
    assert asked["ok"], asked
    run = asked["result"]["runtime"]
    assert run["linear_cross_entropy"] and run["native_gqa"] and run["fused_adam"] and not run["compiled_rope"]
    assert run["sdpa_backend"] == "math"
    refused = _dry(tmp_path, runtime={"sdpa_backend": "cudnn"})
    assert not refused["ok"] and refused["error"]["where"] == "/runtime/sdpa_backend", refused


def test_the_loops_config_carries_the_runtime_options(tmp_path):
    from megatron_skill.contract import validate_request
    from megatron_skill.runtime.cpu_run import plan_cpu_run

    req = validate_request("train", {"model": "tiny-gpt", "num_gpus": 1, "seq_length": 64,
                                     "training": {"train_iters": 2},
                                     "runtime": {"native_gqa": False, "fp8_linear": True, "sdpa_backend": "flash",
                                                 "fp8_scaling": "delayed"}})
    plan = plan_cpu_run(req, tmp_path, "x")
    plan["write"]()
    cfg = json.loads((tmp_path / "cpu_run.json").read_text())
    assert cfg["fused_head"] and cfg["fp8_linear"] and cfg["fused_adam"] and not cfg["native_gqa"]
    assert cfg["fp8_scaling"] == "delayed"
    assert cfg["sdpa_backend"] == "flash"


# The CPU loop with the fused head counted: each call of its hook leaves a mark in a file.
COUNTED_LOOP = """
import sys
from megatron_skill.runtime import cpu_loop, fused_head

real = fused_head.output_processor

def counted(**kwargs):
    with open(sys.argv[2], "a") as marks:
        marks.write("x")
    return real(**kwargs)

fused_head.output_processor = counted
cpu_loop.main(sys.argv[1])
"""


@pytest.mark.slow
def test_the_fused_head_runs_on_the_last_pipeline_stage_and_trains_like_the_plain_one(tmp_path):
    """Two pipeline stages, the fused output layer + loss on the last (256-token micro-batches in
    32-token chunks, so that it runs: core.memory.fused_head_runs): the same losses as
    Megatron's own output layer, from the same seed."""
    from megatron_skill.adapter.log import parse

    loop = tmp_path / "counted_loop.py"
    loop.write_text(COUNTED_LOOP)
    losses = {}
    for name, extra in (("plain", {}), ("fused", {"fused_head": True, "fused_head_chunk": 32})):
        cfg = {"model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
                         "num_query_groups": 2, "kv_channels": 16, "vocab_size": 256},
               "tp": 1, "pp": 2, "seq_length": 256, "padded_vocab_size": 256, "vocab_size": 256, "seed": 1234,
               "lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 1, "weight_decay": 0.1, "train_iters": 3,
               "global_batch_size": 2, "micro_batch_size": 1, "log_interval": 1, "save_interval": None,
               "save": str(tmp_path / name / "ckpt"), "data_cache": str(tmp_path / name / "cache"), **extra}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(loop), str(path), str(tmp_path / f"{name}.marks")], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tools")})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[name] = {r["iteration"]: r["loss"] for r in parse(proc.stdout.splitlines())["iterations"]}
    # the last stage's hook ran for each of its 2 micro-batches a step, 3 steps; never without fused_head
    assert (tmp_path / "fused.marks").read_text() == "x" * 6 and not (tmp_path / "plain.marks").exists()
    assert sorted(losses["fused"]) == [1, 2, 3]
    for it in (1, 2, 3):
        assert losses["fused"][it] == pytest.approx(losses["plain"][it], rel=2e-4)
