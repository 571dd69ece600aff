"""Unit tests that guard what the other tests let slip: each one fails on a mutant of
dev/mutants.py (the mutant's id is in the test's docstring), and each asserts the behaviour the
code stands for, from the outside: Megatron's own rules and schedules, bash's own expansion of the
same words, the answers the planner and on-event give."""
import ast
import collections
import json
import os
import shutil
import subprocess
import textwrap

import pytest
from conftest import ROOT, require_modules

from megatron_skill import contract
from megatron_skill.adapter import shell
from megatron_skill.core.catalog import get_gpu, get_model
from megatron_skill.core.flops import padded_vocab_size
from megatron_skill.core.layout import Layout, broken_rules
from megatron_skill.core.memory import GIB, inflight_chunks, layer_activation_bytes, memory_report, peak, stage_memory
from megatron_skill.core.model import build_spec
from megatron_skill.core.options import RuntimeOptions
from megatron_skill.core.planner import search
from megatron_skill.events import event as ev
from megatron_skill.events import ledger

H100 = get_gpu("h100-sxm")
MIXTRAL = get_model("mixtral-8x7b")     # 8 experts
LLAMA8B = get_model("llama3-8b")
DENSE = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16,
         "num_query_groups": 4, "vocab_size": 32000}


# ---- the rule book ---------------------------------------------------------------------------
def test_experts_fold_across_the_context_parallel_ranks_too():
    """rules-expert-folding-without-cp: Megatron's MoE parallel folding lays the expert groups
    (EP x expert-TP) over all TP x CP x DP ranks of a stage, context parallel ones included."""
    folded = Layout(tp=2, cp=2, dp=2, ep=8, mbs=1, gbs=64, seq_length=8192, sequence_parallel=True)
    assert "expert_folding" not in broken_rules(folded, MIXTRAL, H100, folded.world_size)
    unfolded = folded.but(cp=1)   # 4 ranks cannot hold 8 expert groups
    assert "expert_folding" in broken_rules(unfolded, MIXTRAL, H100, unfolded.world_size)


def test_the_global_batch_is_whole_micro_batches_on_every_data_parallel_rank():
    """rules-batch-without-micro-batch: a step is num_microbatches x micro-batch x DP samples."""
    lay = Layout(tp=2, dp=2, mbs=4, gbs=12, seq_length=8192, sequence_parallel=True)
    assert "gbs_divisible" in broken_rules(lay, LLAMA8B, H100, lay.world_size)   # 12 = 1.5 x 4 x 2
    assert "gbs_divisible" not in broken_rules(lay.but(gbs=16), LLAMA8B, H100, lay.world_size)


# ---- the memory model ------------------------------------------------------------------------
def test_a_qk_norm_model_keeps_the_query_norms_output():
    """memory-qk-norm-term: a QK-layernorm model's attention keeps the query norm's output (bf16,
    one value per query head dimension and token) on top of what the same model keeps without it
    (tests/test_memory_model.py measures it on a real Megatron-Core layer)."""
    plain = build_spec("plain", DENSE)
    qk = build_spec("qk", {**DENSE, "qk_layernorm": True})
    lay = Layout(seq_length=2048, gbs=8)
    query = plain.num_attention_heads * plain.head_dim
    assert layer_activation_bytes(qk, lay, moe=False) - layer_activation_bytes(plain, lay, moe=False) == 2 * query
    padded = padded_vocab_size(plain.vocab_size, 1)
    assert peak(memory_report(qk, lay, padded)) > peak(memory_report(plain, lay, padded))


def test_sequence_parallel_shards_what_tensor_parallel_leaves_whole():
    """memory-sp-always: without sequence parallelism the norms and the residual stream are whole
    on every TP rank; with it they are split over TP, so a layer keeps less."""
    model = build_spec("dense", DENSE)
    with_sp = Layout(tp=2, seq_length=2048, gbs=8, sequence_parallel=True)
    without = with_sp.but(sequence_parallel=False)
    assert layer_activation_bytes(model, with_sp, moe=False) < layer_activation_bytes(model, without, moe=False)


def test_in_flight_micro_batches_follow_megatrons_schedules():
    """memory-interleaved-warmup: the forward passes a pipeline rank holds at once are its
    warm-up micro-batches plus the one in steady state, as Megatron's own schedule counts them
    (get_pp_rank_microbatches: 1F1B, and the interleaved schedule's 2 (PP - rank - 1) + (VP - 1) PP)."""
    require_modules("megatron.core")
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    class Stage:   # a pipeline rank as Megatron's schedule reads it: the group's size and this rank
        def __init__(self, pp: int, rank: int, vp: int):
            self.pp_group = type("Group", (), {"size": lambda _: pp, "rank": lambda _: rank})()
            self.virtual_pipeline_model_parallel_size = vp if vp > 1 else None

    for pp, vp, micro_batches in [(4, 1, 8), (4, 2, 8), (8, 3, 16), (4, 4, 2), (2, 2, 2)]:
        lay = Layout(pp=pp, vp=vp, dp=1, mbs=1, gbs=micro_batches, seq_length=2048)
        for rank in range(pp):
            total, _, warmup, _ = get_pp_rank_microbatches(micro_batches, vp, pp, p2p_communicator=Stage(pp, rank, vp))
            assert inflight_chunks(lay, rank) == min(warmup + 1, total), (pp, vp, micro_batches, rank)


def test_the_distributed_optimizer_shards_over_context_parallel_ranks_too():
    """memory-optimizer-shard-without-cp: Megatron's distributed optimizer shards its state over
    the data-parallel group with the context-parallel ranks in it: CP 2 x DP 2 keeps what DP 4 keeps,
    a quarter of one rank's whole state."""
    model = build_spec("dense", DENSE)
    padded = padded_vocab_size(model.vocab_size, 1)
    cp2_dp2 = Layout(cp=2, dp=2, seq_length=4096, gbs=8, distributed_optimizer=True)
    optimizer = {name: stage_memory(model, lay, 0, padded).optimizer
                 for name, lay in {"cp2_dp2": cp2_dp2, "dp4": cp2_dp2.but(cp=1, dp=4),
                                   "alone": cp2_dp2.but(cp=1, dp=1)}.items()}
    assert optimizer["cp2_dp2"] == pytest.approx(optimizer["dp4"])
    assert optimizer["cp2_dp2"] == pytest.approx(optimizer["alone"] / 4)


# ---- the planner's search --------------------------------------------------------------------
def test_the_search_takes_the_lightest_recompute_that_fits():
    """planner-heaviest-recompute: where no recompute does not fit and selective recompute does,
    the search costs selective recompute, not full (which fits too but only loses time)."""
    model, seq, gbs = get_model("llama3.2-1b"), 8192, 8
    opts = RuntimeOptions.from_request(None)
    lay = Layout(seq_length=seq, gbs=gbs, dp=1, mbs=1, distributed_optimizer=True)
    padded = padded_vocab_size(model.vocab_size, 1)
    need = {r: peak(memory_report(model, lay.but(recompute=r), padded, opts.memory(lay.but(recompute=r))))
            for r in ("none", "selective")}
    assert need["selective"] < need["none"]
    headroom_gib = (H100.memory_bytes - (need["none"] + need["selective"]) / 2) / GIB   # room between the two
    fixed = {"tp": 1, "pp": 1, "cp": 1, "vp": 1, "ep": 1, "etp": 1, "mbs": 1}
    found = search(model, H100, 1, seq, gbs, ["bf16"], constraints=fixed, headroom_gib=headroom_gib, opts=opts)
    assert [c.layout.recompute for c in found.candidates] == ["selective"]
    assert found.rejected["out_of_memory"]["count"] >= 1 and found.rejected["dominated"]["count"] >= 1


# ---- the script reader: the same words as bash expands them ----------------------------------
def _reader_and_bash(body: str, words: str, env: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """The launch's arguments as the reader reads `body` then `python pretrain_gpt.py WORDS`, and
    the same words as bash itself expands them after running body."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed here")
    body = textwrap.dedent(body)
    launches = [la.args for p in shell.read(f"{body}\npython pretrain_gpt.py {words}\n", env=env).paths
                for la in p.launches]
    assert len(launches) == 1, launches
    out = subprocess.run([bash, "-c", f"{body}\nprintf '%s\\0' {words}"], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ.get("PATH", ""), **(env or {})}).stdout
    return launches[0], out.split("\0")[:-1]


def test_the_reader_expands_defaults_as_bash_does():
    """shell-colon-default: ${V:-w} takes w when V is unset or empty, ${V-w} only when unset;
    ${V:+w} and ${V:=w} likewise."""
    read, bash = _reader_and_bash("""
        EMPTY=
        SET=value
        """, '--a "${EMPTY:-fallback}" --b "${EMPTY-kept}" --c "${UNSET-given}" --d "${EMPTY:+alt}" '
             '--e "${SET:+alt}" --f "${EMPTY:=filled}" --g "$EMPTY"')
    assert read == bash == ["--a", "fallback", "--b", "", "--c", "given", "--d", "", "--e", "alt", "--f", "filled",
                            "--g", "filled"]


def test_the_reader_strips_prefixes_and_suffixes_as_bash_does():
    """shell-strip-longest: ${V#p} cuts the shortest match of p from the start, ${V##p} the longest;
    % and %% from the end."""
    read, bash = _reader_and_bash("P=runs/a/ckpt.tar.gz", '--s "${P#*/}" --l "${P##*/}" --e "${P%.*}" '
                                                         '--t "${P%%.*}"')
    assert read == bash == ["--s", "a/ckpt.tar.gz", "--l", "ckpt.tar.gz", "--e", "runs/a/ckpt.tar",
                            "--t", "runs/a/ckpt"]


def test_the_reader_appends_to_strings_and_counts_as_bash_does():
    """shell-append-replaces, shell-decrement: V+=text appends to a string; $(( N-- )) and
    $(( N++ )) count down and up."""
    read, bash = _reader_and_bash("""
        NAME=llama
        NAME+=-8b
        N=4
        : $(( N-- )) $(( N-- ))
        M=1
        : $(( M++ ))
        """, '--name "$NAME" --n "$N" --m "$M"')
    assert read == bash == ["--name", "llama-8b", "--n", "2", "--m", "2"]


# ---- event deduplication ---------------------------------------------------------------------
@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ev.SECRET_ENV, "a-secret-for-the-guards")
    return b"a-secret-for-the-guards"


def test_an_event_delivered_twice_is_one_report(tmp_path, secret):
    """events-seen-by-type: a webhook delivered twice (a retry) is known by its id: the second
    delivery adds no report to the incident and is answered from the first."""
    runs, run_id = tmp_path / "runs", "r0123456789abcdef"
    (runs / run_id / "logs").mkdir(parents=True)
    (runs / run_id / "state.json").write_text(json.dumps({"status": "failed"}))
    failed = ev.sign(ev.new("job.failed", run_id, {"job_id": "4242", "scheduler": "slurm", "host": "node7"}, "job",
                            details={"exit_code": 1, "failure": "nccl_timeout"}), secret)
    answers = [contract.call("on-event", {"event": failed, "runs_root": str(runs)})["result"] for _ in range(2)]
    assert answers[0]["verdict"] == "handled" and "first_seen" in answers[1]["facts"]
    record = json.loads((ledger.folder(runs, run_id) / "ledger.json").read_text())
    assert [r["event_id"] for r in record["incidents"][answers[0]["incident"]]["reports"]] == [failed["event_id"]]
    assert list(record["events"]) == [failed["event_id"]]


# ---- the list of mutants itself ----------------------------------------------------------------
def _mutants() -> list[dict]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants", ROOT / "dev" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTANTS


def test_every_mutant_still_applies_and_names_tests_that_exist():
    """A change to the code a mutant edits must bring the mutant along (dev/mutants.py would call it
    stale), and every test a mutant names must exist, or the mutant would be judged by nothing."""
    mutants = _mutants()
    assert len({m["id"] for m in mutants}) == len(mutants)
    for m in mutants:
        text = (ROOT / m["file"]).read_text()
        assert text.count(m["original"]) == 1, f"{m['id']}: its original text is in {m['file']} " \
                                               f"{text.count(m['original'])} times; write the mutant again"
        assert m["replacement"] != m["original"] and m["tests"], m["id"]
        for test in m["tests"]:
            path, _, name = test.partition("::")
            defined = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{m['id']} names {test}, which does not exist"
    areas = collections.Counter(m["area"] for m in mutants)
    assert set(areas) == {"rule book", "memory model", "planner search", "script reader", "event deduplication"}
    assert min(areas.values()) >= 2, areas
