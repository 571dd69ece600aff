"""The planner against published multi-GPU runs (core/catalog/published_runs.json): the table in
references/results is what the planner says today (no drift), the H100's dense and MoE runs are
predicted within the goal, the Blackwell runs (assumed calibration) are checked, the fitted MoE
constants are the catalog's, and every plan's forecast carries the band and says where it goes
beyond the evidence."""
import json
import statistics
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_skill.contract import call
from megatron_skill.core import evidence

STORED = ROOT / "references" / "results" / "ci-2026-12-07" / "published-runs.md"


def test_the_stored_table_is_what_the_planner_says_now():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published_runs.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == STORED.read_text(), "regenerate: python benchmarks/published_runs.py > " + str(STORED)


def _counted():
    """The rows the goal counts: whole layouts, not a known miss (each says which path of its
    software the planner does not cost yet; test_known_misses_are_still_misses keeps them honest)."""
    return [r for r in evidence.checked() if r.get("layout_complete", True) and not r.get("known_miss")]


def test_known_misses_are_still_misses():
    """A row marked known_miss is off the goal (beyond 20 %, or refused for memory): once the
    planner costs its path, the mark must go (and the row counts again)."""
    misses = [r for r in evidence.checked() if r.get("known_miss")]
    assert misses and all(abs(r["error_pct"]) > 20 or not r["fits"] for r in misses), \
        [(r["model"], r["gpu"], r["source"], r["error_pct"], r["fits"]) for r in misses]


def _within_goal(errors):
    """The goal on Hopper: median within 8 %, every run within 20 %."""
    return statistics.median(errors) <= 8 and max(errors) <= 20


def test_h100_runs_dense_and_moe_within_eight_per_cent_median_and_twenty_at_most():
    # runs whose publisher left part of the layout unstated are shown but not counted; the
    # token-drop MoE rows count since the experts' overhead every MoE layer pays was fitted
    # (moe_us_per_token_expert, third session of 2026-12-06: the Qwen3-30B-A3B one was +25.9 %)
    # The goal is the Hopper rows' (dense and MoE together); dense alone holds it too. The MoE rows
    # each within 20 %, their median held at 10 %: with the options their presets set (EP overlap,
    # DeepEP, the 26.02.01 preset's layout; fourteenth session) the fitted MoE constants leave one
    # model's PP 2 rows over-predicted and its EP 16 HybridEP rows under (median 9.7 %, where the
    # rows as first recorded gave 7.9 %; a median-first fit reaches 3.7 % but a 21 % row)
    h100 = [r for r in _counted() if r["gpu"] == "h100-sxm"]
    dense = [abs(r["error_pct"]) for r in h100 if not r["moe"]]
    moe = [abs(r["error_pct"]) for r in h100 if r["moe"]]
    assert len(dense) >= 13 and len(moe) >= 13
    assert _within_goal(dense + moe) and _within_goal(dense), dense + moe
    assert max(moe) <= 20 and statistics.median(moe) <= 10, moe


def test_a100_runs_of_megatrons_own_layers_within_the_goal_with_nothing_fitted_to_them():
    """The A100 rows (Megatron-LM of 2021-22: its own layers, no Transformer Engine, the score
    matrix materialised, selective or every-layer recompute) are costed with the local path's
    factors measured on the H100, nothing fitted to them: median within 8 %, each within 20 %."""
    a100 = [r for r in evidence.checked() if r["gpu"].startswith("a100")]
    assert len(a100) >= 10 and all(r["transformer_engine"] is False for r in a100)
    assert {r["recompute"] for r in a100} == {"selective", "full"}
    assert _within_goal([abs(r["error_pct"]) for r in a100]), [(r["layout"], r["error_pct"]) for r in a100]


def test_a_rows_software_is_the_runtime_it_is_costed_with():
    """A row's transformer_engine, attention kernel, sequence parallel, recompute and optimizer
    reach the layout and options it is costed with; a full recompute takes every layer of a
    chunk (the 2021-22 runs' --checkpoint-activations)."""
    run = next(r for r in evidence.published_runs() if r["gpu"].startswith("a100") and r["recompute"] == "full"
               and r["vp"] == 3)
    model = evidence.get_model(run["model"])
    lay, opts = evidence.run_layout(run, model), evidence.run_options(run)
    assert (lay.sequence_parallel, lay.distributed_optimizer, lay.recompute) == (False, False, "full")
    assert lay.recompute_layers == model.num_layers // (lay.pp * lay.vp)
    assert opts.te is False and opts.attention_kernel.kind == "unfused" and opts.attention_kernel.dropout
    as_te = evidence.compare({**run, "transformer_engine": True, "attention_kernel": None})
    assert as_te["predicted"] != evidence.compare(run)["predicted"]


def test_runs_with_an_unstated_layout_part_stay_out_of_the_evidence():
    incomplete = [r for r in evidence.published_runs() if r.get("layout_complete") is False]
    assert incomplete and all(r["layout_note"] for r in incomplete)
    band = evidence.forecast(evidence.get_model("llama3.1-405b"), "h100-sxm",
                             evidence.run_layout(incomplete[0], evidence.get_model("llama3.1-405b")), "measured")
    errors = {round(r["error_pct"], 3) for r in evidence.checked() if r.get("layout_complete") is False}
    assert not errors & {round(e, 3) for e in band["error_band_pct"]}


def test_blackwell_runs_are_checked_and_stay_where_the_table_says():
    # Their calibration is assumed (no Blackwell GPU measured): the goal is not claimed for
    # them (references/benchmarks.md says why); this keeps them from drifting further.
    blackwell = [r for r in _counted() if r["gpu"] in ("b200", "gb200")]
    assert len(blackwell) >= 17 and any(r["moe"] for r in blackwell)
    errors = sorted(abs(r["error_pct"]) for r in blackwell)
    dense = [abs(r["error_pct"]) for r in blackwell if not r["moe"]]
    moe = sorted(abs(r["error_pct"]) for r in blackwell if r["moe"])
    # dense rows within 17 % (the largest: Llama 3 8B on 8 B200s in NeMo 25.02, held out, +16.4 %,
    # where Megatron-Bridge's 25.09 and 25.11 rows of the same layout are -0.8 % and +0.9 %); the MoE rows
    # with the share of the H100's MoE overhead that scales with HBM bandwidth
    # (moe_overhead_hbm_share) within 15 % (Qwen3-235B-A22B on 256 B200s with alltoall, 26.02 and
    # 26.04.01, held out: -13.5 %, -12.9 %); the rows with HybridEP of the 2025-26 releases are known
    # misses (-22 % to -74 %)
    assert statistics.median(errors) <= 10 and max(dense) <= 17, errors
    assert moe[-1] <= 15, moe


def test_the_moe_overhead_that_runs_at_the_memory_rate_scales_with_the_gpus_bandwidth():
    """The same MoE layout costs less expert overhead on a GPU with more HBM bandwidth, by the
    fitted share only: the host's part stays."""
    from megatron_skill.core.catalog import get_gpu
    from megatron_skill.core.moe import MoEOptions
    from megatron_skill.core.timing import _expert_overhead_time, calibration
    run = next(r for r in evidence.published_runs() if r["model"] == "qwen3-30b-a3b" and r["gpu"] == "b200")
    model = evidence.get_model(run["model"])
    lay = evidence.run_layout(run, model)
    cal = calibration("b200")
    h100, b200 = (_expert_overhead_time(model, lay, get_gpu(g), cal, 4096, MoEOptions()) for g in ("h100-sxm", "b200"))
    share = cal["moe_overhead_hbm_share"]
    assert 0 < share < 1
    assert b200 / h100 == pytest.approx(1 - share + share * 3350 / 8000)


@pytest.mark.slow   # the whole grid of the fit
def test_the_fitted_moe_constants_are_the_catalogs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published_runs.py"), "--fit"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fitted = json.loads(proc.stdout)["best"]
    catalog = json.loads((ROOT / "tools" / "megatron_skill" / "core" / "catalog" / "calibration.json").read_text())
    assert fitted == {k: catalog["default"][k] for k in fitted}, "re-fit: python benchmarks/published_runs.py --fit"


def test_every_run_names_its_source_and_software():
    for run in evidence.published_runs():
        assert run["source"] and run["software"] and (run.get("tokens_per_s_per_gpu") or run.get("tflops_per_gpu"))


def test_a_forecast_carries_its_band_and_what_lies_beyond_the_evidence():
    h100 = call("plan", {"model": "llama3-70b", "num_gpus": 64, "gpu": "h100-sxm", "precision": "fp8", "top": 1})
    f = h100["result"]["plans"][0]["forecast"]
    lo, hi = f["error_band_pct"]
    assert lo < 0 < hi and f["checked_runs"] >= 8 and "dense" in f["basis"]
    assert not any("GPUs: more than" in b for b in f["beyond_evidence"])
    far = call("plan", {"model": "llama3-8b", "num_gpus": 32768, "gpu": "b200", "top": 1})["result"]["plans"][0]
    beyond = " ".join(far["forecast"]["beyond_evidence"])
    assert "b200" in beyond and "32,768 GPUs" in beyond and "assumed" in beyond
    moe = call("plan", {"model": "mixtral-8x7b", "num_gpus": 64, "gpu": "h100-sxm", "top": 1})["result"]["plans"][0]
    assert "MoE" in moe["forecast"]["basis"]
    assert json.dumps(moe["forecast"])   # strict JSON


def test_a_forecasts_band_holds_the_published_figure_of_a_run_it_was_not_built_from():
    rows = [r for r in evidence.checked() if r.get("layout_complete", True)]
    inside = 0
    for r in rows:
        others = [o["error_pct"] for o in evidence.band_runs(r["moe"], evidence.get_gpu(r["gpu"]).arch, r)[0]]
        lo, hi = evidence.band(others)
        inside += lo <= r["error_pct"] <= hi
    assert inside >= 0.8 * len(rows), (inside, len(rows))


def test_no_layout_a_published_run_used_is_refused_for_memory():
    """Each complete row is a layout its publisher ran: the memory model refusing one is the
    model's defect. Llama 3.1 405B on 256 GB200s (TP4 PP16 VP4, three releases) was refused at
    190.2 GiB of 184 until TE's attention kept its own V instead of the whole QKV output
    (core/memory.py, attention_saved_bytes); it is 181.4 with TE's TP-overlap buffers counted."""
    rows = _counted()
    refused = [(r["model"], r["gpu"], r["layout"], round(r["peak_gib"], 1), r["source"])
               for r in rows if not r["fits"]]
    assert not refused, refused
    assert any(r["gpu"] == "gb200" and r["model"] == "llama3.1-405b" for r in rows)
