"""Uneven pipelines: the planner's layer split is Megatron-Core's own, and a model whose layers do
not divide by PP (DeepSeek-V3's 61 at PP16) is planned, rendered and accepted by Megatron; Megatron's
layout string (--pipeline-model-parallel-layout) is read as Megatron reads it, refused where it
refuses it, rendered and read back."""
import pytest
from conftest import require_modules

from megatron_skill.contract import call
from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.layout import Layout, check_layout, pipeline_layout_chunks
from megatron_skill.core.model import build_spec
from megatron_skill.core.planner import pipeline_splits

SPLITS = [  # (layers, PP, VP, Layout fields)
    (61, 16, 1, {"pipeline_split": "uneven", "first_stage_layers": 2, "last_stage_layers": 3}),
    (61, 4, 1, {"pipeline_split": "uneven", "first_stage_layers": 13, "last_stage_layers": 16}),
    (30, 8, 1, {"pipeline_split": "embedding_loss"}),
    (62, 4, 1, {"pipeline_split": "embedding_loss"}),
    (32, 4, 2, {"pipeline_split": "even"}),
    (58, 8, 2, {"pipeline_split": "uneven", "first_stage_layers": 6, "last_stage_layers": 4}),
    (61, 2, 1, {"pipeline_split": "uneven", "first_stage_layers": 30, "last_stage_layers": 31}),
]


@pytest.mark.parametrize("layers,pp,vp,fields", SPLITS)
def test_layers_per_chunk_are_megatrons(layers, pp, vp, fields):
    require_modules("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    lay = Layout(pp=pp, vp=vp, **fields)
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=lay.first_stage_layers or None,
        num_layers_in_last_pipeline_stage=lay.last_stage_layers or None,
        account_for_embedding_in_pipeline_split=lay.pipeline_split == "embedding_loss",
        account_for_loss_in_pipeline_split=lay.pipeline_split == "embedding_loss")
    theirs = [get_num_layers_to_build(cfg, vp_stage=c // pp if vp > 1 else None, pp_rank=c % pp)
              for c in range(pp * vp)]
    assert lay.chunk_sizes(layers) == theirs and sum(theirs) == layers


def test_the_planner_proposes_uneven_splits_only_where_needed():
    assert pipeline_splits(64, 8) == [{"pipeline_split": "even"}]
    assert pipeline_splits(61, 16)[0] == {"pipeline_split": "uneven", "first_stage_layers": 2,
                                          "last_stage_layers": 3}
    for split in pipeline_splits(61, 16) + pipeline_splits(95, 8):
        counts = Layout(pp=16 if split["first_stage_layers"] < 10 else 8, **split)
        assert counts.rank_layer_counts(61 if counts.pp == 16 else 95) is not None


def test_deepseek_v3_pipelined_at_pp16_ep64_on_1024_h100s(tmp_path):
    req = {"model": "deepseek-v3", "gpu": "h100-sxm", "num_gpus": 1024, "seq_length": 4096,
           "global_batch_size": 8192, "precision": "fp8"}
    plan = call("plan", {**req, "constraints": {"tp": 1, "pp": 16, "ep": 64, "cp": 1}, "top": 1})
    assert plan["ok"], plan
    best = plan["result"]["plans"][0]
    assert best["layout"]["pipeline_split"] == "uneven" and best["layout"]["pp"] == 16
    mem = best["memory"]
    assert {"first_stage", "middle_stage", "last_stage"} <= set(mem)
    assert mem["first_stage"]["layers"] + 14 * mem["middle_stage"]["layers"] + mem["last_stage"]["layers"] == 61
    # Rendered with the same layout and checked by Megatron's parser and validate_args at 1,024 ranks.
    lay = {k: best["layout"][k] for k in ("tp", "pp", "ep", "cp", "mbs", "recompute", "recompute_layers",
                                          "pipeline_split", "first_stage_layers", "last_stage_layers")}
    env = call("render", {**req, "layout": lay, "launcher": "slurm", "output_dir": str(tmp_path)})
    assert env["ok"], env
    args = env["result"]["megatron_args"]
    assert args[args.index("--decoder-first-pipeline-num-layers") + 1] == str(lay["first_stage_layers"])
    require_modules("megatron.core")
    from megatron_skill.adapter import parser as megatron_parser
    megatron_parser.parse(args, world_size=1024)
    # validate reads the split back from the flags: no pp_layers error.
    found = call("validate", {"args": args, "num_gpus": 1024, "gpu": "h100-sxm"})["result"]
    assert not [e for e in found["errors"] if e["code"] in ("pp_layers", "pp_uneven")], found["errors"]


def test_an_uneven_split_that_does_not_add_up_is_refused(tmp_path):
    env = call("render", {"model": "deepseek-v3", "gpu": "h100-sxm", "num_gpus": 1024, "dry_run": True,
                          "launcher": "slurm", "output_dir": str(tmp_path),
                          "layout": {"tp": 1, "pp": 16, "ep": 64, "pipeline_split": "uneven",
                                     "first_stage_layers": 3, "last_stage_layers": 3}})
    assert env["error"]["code"] == "infeasible" and "pp_uneven" in env["error"]["message"]


# ---- Megatron's layout string (--pipeline-model-parallel-layout) ------------------------------
LAYOUTS = [  # (layers, PP, layout string, MTP layers)
    (61, 8, "Et|(tt|)*30mL", 1),          # DeepSeek-V3 at PP8 VP4, Megatron-Bridge's H100 shape
    (61, 16, "Et*4|(t*4|)*14tmL", 1),     # DeepSeek-V3 at PP16
    (8, 2, "Ett|tt|tt|ttL", 0),           # even, VP2
    (10, 2, "E|t*4|t*5|tL", 0),           # an empty first chunk beside the embedding
]


@pytest.mark.parametrize("layers,pp,text,mtp", LAYOUTS)
def test_layout_string_chunks_are_megatrons(layers, pp, text, mtp):
    require_modules("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout(text, pp)
    theirs.validate_layer_layout(layers, mtp or None)
    vp = theirs.virtual_pipeline_model_parallel_size
    lay = Layout(pp=pp, vp=vp, pipeline_split="layout", pipeline_layout=text)
    mine = lay.chunk_sizes(layers)
    # Megatron's own parse, rank by virtual stage (its getters need a parallel state to read vp_stage)
    assert mine == [theirs.layout[c % pp][c // pp].count(LayerType.decoder) for c in range(pp * vp)]
    assert sum(mine) == layers


def test_layout_strings_megatron_refuses_break_the_rule_book():
    v3 = get_model("deepseek-v3")
    base = Layout(tp=2, pp=8, vp=4, ep=64, dp=64, mbs=1, gbs=8192, seq_length=4096, sequence_parallel=True,
                  pipeline_split="layout", pipeline_layout="Et|(tt|)*30mL")
    h100 = get_gpu("h100-sxm")
    assert check_layout(base, v3, h100, 1024) is None
    for bad in ("Et|(tt|)*29mL", "t|(tt|)*30mEL", "Et|(tt|)*30L", "Etm|(tt|)*30tL", "Et|(tt|)*30mL|", "t*999999999",
                "Ex|L"):
        assert check_layout(base.but(pipeline_layout=bad), v3, h100, 1024) == "pp_layout", bad
    assert pipeline_layout_chunks("t*999999999") is None     # refused before it is expanded


def test_a_layout_string_is_rendered_and_read_back(tmp_path):
    # NVIDIA's run of this layout, with the memory options its recipe set (published_runs.json)
    req = {"model": "deepseek-v3", "gpu": "h100-sxm", "num_gpus": 1024, "seq_length": 4096, "global_batch_size": 8192,
           "precision": "fp8", "launcher": "slurm", "output_dir": str(tmp_path),
           "megatron_options": {"grad_reduce_in_bf16": True, "fp8_param_gather": True, "cross_entropy_fusion": True},
           "layout": {"tp": 2, "pp": 8, "vp": 4, "ep": 64, "mbs": 1, "recompute": "selective",
                      "pipeline_split": "layout", "pipeline_layout": "Et|(tt|)*30mL"}}
    out = call("render", req)
    assert out["ok"], out
    args = out["result"]["megatron_args"]
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Et|(tt|)*30mL"
    assert "--num-virtual-stages-per-pipeline-rank" not in args   # Megatron takes one or the other
    back = call("validate", {"script_text": open(out["result"]["files"][0]["path"]).read(), "gpu": "h100-sxm"})
    assert back["ok"] and back["result"]["valid"], back["result"]["errors"]
    lay = back["result"]["layout"]
    assert (lay["vp"], lay["pipeline_split"], lay["pipeline_layout"]) == (4, "layout", "Et|(tt|)*30mL")


def test_a_layout_string_with_stray_characters_is_refused_as_megatron_refuses_it():
    # right counts (2 chunks, 4 layers, E first, L last) but a parenthesis no repeat consumed
    require_modules("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    text = "E(tt|tt)L"
    with pytest.raises(AssertionError):   # Megatron: invalid layer character
        PipelineParallelLayerLayout(text, 2)
    four = build_spec("four", {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                               "vocab_size": 1000})
    lay = Layout(pp=2, dp=1, gbs=2, pipeline_split="layout", pipeline_layout=text)
    assert pipeline_layout_chunks(text) is None and lay.chunk_sizes(4) is None
    assert check_layout(lay, four, get_gpu("h100-sxm"), 2) == "pp_layout"
