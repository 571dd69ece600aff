"""The search: every layout Megatron accepts for a model on a cluster, costed and ranked.

Order of the loops follows the cost of a wrong choice: TP and CP (inside the NVLink
domain), PP and its split, virtual stages, EP, then micro-batch.  Each layout the rules
accept gets a speed floor first (timing.step_floor: its layers alone, a few look-ups); the
layouts are then costed in full (memory with the lightest recompute that fits, then the
step) fastest floor first, until no layout left can reach the plans shown: branch and bound,
so the ranking's head is the one an exhaustive search gives, at a fifth of its cost on the
large MoE searches.  Variants that can only lose are not costed: with the same communication
volume, turning the distributed optimizer or sequence parallelism off only adds memory, and
more recompute than the least that fits only adds time ('dominated').
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import heapq
import json
import math
from typing import Any, Iterable

from .catalog import CATALOG_DIR, GPUSpec
from .flops import padded_vocab_size, training_flops
from .layout import RULES, Layout, check_layout, context_parallel_rules, expert_rules, moe_rules, precision_rules, tp_rules
from .memory import GIB, PLAN_MARGIN_GIB, memory_report, peak
from .model import ModelConfig
from .options import RuntimeOptions
from .timing import calibration, step_floor, step_time

RULES_EXTRA = {
    "dominated": "costed no further: another variant of the same layout is as fast with less memory "
                 "(distributed optimizer or sequence parallel off), or a lighter recompute already fits",
    "constraint": "excluded by the request's constraints",
    "bounded": "not costed: even its speed floor (the busiest rank's layers alone, no recompute, loss, communication "
               "or optimizer) is slower than the layouts a plan can show",
}


@dataclasses.dataclass
class Candidate:
    layout: Layout
    memory: dict[str, Any]
    time: Any
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_gib: float
    gpu_gib: float = math.inf     # the GPU's memory (catalog)


@dataclasses.dataclass
class SearchResult:
    candidates: list[Candidate]
    rejected: dict[str, dict[str, Any]]
    evaluated: int
    # layouts the rules accepted or refused: the search's size, whatever the bound left uncosted
    # (plan's nearby searches spend a budget of it)
    considered: int


@functools.lru_cache(maxsize=1)
def search_bounds() -> dict[str, Any]:
    return json.loads((CATALOG_DIR / "calibration.json").read_text())["search"]


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Rejections:
    def __init__(self) -> None:
        self.table: dict[str, dict[str, Any]] = {}

    def add(self, rule: str, example, n: int = 1) -> None:
        """Count n layouts refused by rule; example is a label, or a function making one (called
        only while the rule has fewer than three examples: the search refuses thousands)."""
        entry = self.table.setdefault(rule, {"count": 0, "rule": RULES[rule].message if rule in RULES else RULES_EXTRA[rule],
                                             "examples": []})
        entry["count"] += n
        if len(entry["examples"]) < 3:
            example = example() if callable(example) else example
            if example not in entry["examples"]:
                entry["examples"].append(example)


# Predicted throughputs closer than this are a tie: the step-time model is good to a few per
# cent, so of tied layouts the one with the lower peak memory goes first (references/
# benchmarks.md has the measurement that showed a near tie going the other way).
TIE = 0.01
RANKED_BY_TIES = 64   # the head of the list, where the order is read; the rest by throughput
KEPT = 100            # the most plans a request may ask for (schemas/plan.request.json, top): the
                      # search costs layouts until none left can reach this many


def leaves_margin(peak_gib: float, gpu_gib: float) -> bool:
    """Whether a predicted peak leaves the GPU the memory margin (memory.PLAN_MARGIN_GIB) free."""
    return gpu_gib - peak_gib >= PLAN_MARGIN_GIB


def tight(c: Candidate, peak=lambda c: c.peak_gib) -> bool:
    """Whether a plan leaves less than the margin of its GPU's memory free (never for a row
    that names no GPU)."""
    return not leaves_margin(peak(c), getattr(c, "gpu_gib", math.inf))


def rank(candidates: list, speed=lambda c: c.tokens_per_s, peak=lambda c: c.peak_gib) -> list:
    """Plans that leave the memory margin free first, then those that do not (they fit the
    model, with less to spare than a measured run needed); within each, fastest first, and
    among layouts within TIE of the fastest left, the leanest in memory.  speed and peak read a
    candidate (Candidates by default; the tables of measured results rank their predictions with
    the same rule)."""
    roomy = [c for c in candidates if not tight(c, peak)]
    return _by_speed(roomy, speed, peak) + _by_speed([c for c in candidates if tight(c, peak)], speed, peak)


def _by_speed(candidates: list, speed, peak) -> list:
    left = sorted(candidates, key=lambda c: (-speed(c), peak(c)))
    out: list = []
    while left and len(out) < RANKED_BY_TIES:
        floor = (1 - TIE) * speed(left[0])
        tied = 1  # left is fastest first: the tied ones are a prefix of it
        while tied < len(left) and speed(left[tied]) >= floor:
            tied += 1
        out.append(left.pop(min(range(tied), key=lambda i: peak(left[i]))))
    return out + left


def _allowed(constraints: dict, key: str, values: Iterable) -> list:
    fixed = constraints.get(key)
    if fixed is None:
        return list(values)
    fixed = fixed if isinstance(fixed, list) else [fixed]
    return [v for v in fixed]


_SEARCHES: "collections.OrderedDict[str, SearchResult]" = collections.OrderedDict()


def forget() -> None:
    """Drop every remembered search and cached cost (a benchmark's fresh start)."""
    from . import memory, timing

    _SEARCHES.clear()
    timing.clear_caches()
    for cached in (memory.param_split, memory.moe_layers_among, memory._layer_activation_bytes, memory._layer_acts,
                   memory._state_bytes, memory._chunk_layers, memory._rank_layers):
        cached.cache_clear()
_SEARCHES_KEPT = 32


def search(model: ModelConfig, gpu: GPUSpec, n_gpus: int, seq_length: int, gbs: int,
           precisions: list[str], constraints: dict[str, Any] | None = None,
           headroom_gib: float = 0.0, opts: RuntimeOptions | None = None) -> SearchResult:
    """Every layout that fits, costed for the runtime paths ``opts`` says the run takes (TE's
    layers, or the local ones with the skill's fused paths).

    The search is a pure function of its inputs and the calibration: the same search in one
    process (plan, then render, then validate of one request) is done once and copied."""
    opts = opts or RuntimeOptions.from_request(None)
    key = json.dumps([dataclasses.asdict(model), dataclasses.asdict(gpu), n_gpus, seq_length, gbs, list(precisions),
                      constraints, headroom_gib, dataclasses.asdict(opts), calibration(gpu.key), KEPT], sort_keys=True,
                     default=str)
    if key not in _SEARCHES:
        _SEARCHES[key] = _search(model, gpu, n_gpus, seq_length, gbs, precisions, constraints, headroom_gib, opts)
        if len(_SEARCHES) > _SEARCHES_KEPT:
            _SEARCHES.popitem(last=False)
    _SEARCHES.move_to_end(key)
    found = _SEARCHES[key]  # candidates are never changed after costing: a new list of the same ones
    return SearchResult(candidates=list(found.candidates), rejected=copy.deepcopy(found.rejected),
                        evaluated=found.evaluated, considered=found.considered)


def _search(model: ModelConfig, gpu: GPUSpec, n_gpus: int, seq_length: int, gbs: int,
            precisions: list[str], constraints: dict[str, Any] | None, headroom_gib: float,
            opts: RuntimeOptions) -> SearchResult:
    c = constraints or {}
    rej = _Rejections()
    out: list[Candidate] = []
    todo: list = []   # (speed floor, order found, layout): every layout the rules accept
    recomputes = _allowed(c, "recompute", ["none", "selective", "full"])
    capacity = gpu.memory_bytes - headroom_gib * GIB
    max_tp = min(gpu.nvlink_domain, n_gpus, 64)
    tps = _allowed(c, "tp", _pow2_upto(max(n_gpus, 1)))
    # context parallel while each rank keeps enough of a sequence (a search bound, catalog/calibration.json)
    cp_floor = search_bounds()["cp_min_tokens_per_rank"]
    cps = _allowed(c, "cp", [cp for cp in _pow2_upto(min(n_gpus, 64)) if cp == 1 or seq_length // cp >= cp_floor])
    mbss = _allowed(c, "mbs", _pow2_upto(16))
    for precision in precisions:
        for tp in tps:
            base = Layout(tp=tp, seq_length=seq_length, gbs=gbs, precision=precision,
                          sequence_parallel=tp > 1)
            if n_gpus % tp:
                continue
            # the rule book's TP and precision rules, before anything else is chosen
            rule = "tp_within_nvlink" if tp > max_tp else next(tp_rules(base, model, gpu), None)
            rule = rule or next(precision_rules(base, gpu), None)
            if rule:
                rej.add(rule, f"FP8 on {gpu.key}" if rule == "fp8_arch" else f"TP{tp}")
                continue
            for cp in cps:
                if n_gpus % (tp * cp):
                    continue
                rule = next(context_parallel_rules(base.but(cp=cp), opts.te), None)
                if rule:
                    rej.add(rule, f"CP{cp} seq{seq_length}" if rule == "cp_sequence"
                            else f"CP{cp} without Transformer Engine")
                    continue
                rest = n_gpus // (tp * cp)
                for pp in _allowed(c, "pp", _divisors(rest)):
                    if rest % pp or pp > model.num_layers:
                        continue
                    dp = rest // pp
                    splits = pipeline_splits(model.num_layers, pp)
                    if not splits:
                        rej.add("pp_layers", f"PP{pp} for {model.num_layers} layers")
                    for split in splits:
                        _search_stage(model, gpu, n_gpus, base.but(cp=cp, pp=pp, dp=dp, **split),
                                      c, mbss, rej, todo, opts)
    considered = len(todo) + sum(r["count"] for r in rej.table.values())
    _cost_in_order(model, gpu, todo, recomputes, capacity, rej, out, opts)
    return SearchResult(candidates=out, rejected=rej.table, evaluated=len(out), considered=considered)


def pipeline_splits(num_layers: int, pp: int) -> list[dict[str, Any]]:
    """How Megatron can cut num_layers over PP ranks, as Layout fields: evenly; with the
    embedding and the loss counted as layers; or, when neither divides, unevenly, the middle
    ranks taking L // PP or one more each and the first and last rank sharing the rest, the
    first (which holds the embedding) the smaller half."""
    if num_layers % pp == 0:
        return [{"pipeline_split": "even"}]
    if (num_layers + 2) % pp == 0:
        return [{"pipeline_split": "embedding_loss"}]
    out = []
    for per_middle in sorted({num_layers // pp, num_layers // pp + 1}):
        rest = num_layers - per_middle * (pp - 2)
        first = rest // 2
        split = {"pipeline_split": "uneven", "first_stage_layers": first, "last_stage_layers": rest - first}
        if pp >= 2 and first >= 1 and rest - first <= 2 * max(per_middle, 1) and split not in out:
            out.append(split)
    return out


def _drop(rej: _Rejections, rule: str, values: list, keep: list, combinations: int, label) -> None:
    """Count the layouts a rule refuses for each value of one size not kept, by the combinations of
    the other sizes each would have formed."""
    dropped = [v for v in values if v not in keep]
    if dropped and combinations:
        rej.add(rule, lambda: label(dropped[0]), len(dropped) * combinations)


def _search_stage(model: ModelConfig, gpu: GPUSpec, n_gpus: int, lay: Layout, c: dict, mbss: list[int],
                  rej: _Rejections, todo: list, opts: RuntimeOptions) -> None:
    """The layouts of one pipeline split that Megatron's rules accept, each with its speed floor
    (step_floor), into todo; _cost_in_order costs them."""
    # Virtual stages the layout's own split allows (Layout.chunk_sizes: whole chunks on every rank).
    vps = [1] if lay.pp == 1 else [v for v in range(1, 17)
                                   if lay.but(vp=v).chunk_sizes(model.num_layers) is not None]
    vps = _allowed(c, "vp", vps)
    if model.is_moe:
        eps = [e for e in _divisors(model.num_experts)]
        etps = [1] + ([lay.tp] if lay.tp > 1 else [])
    else:
        eps, etps = [1], [1]
    eps, etps = _allowed(c, "ep", eps), _allowed(c, "etp", etps)
    # A request's own lists of values are not pre-filtered as the search's are: a value no layout of
    # this split can take goes here, once, not combination by combination (64 values of four sizes
    # made a plan request run for minutes)
    if "vp" in c:
        keep = [v for v in vps if v == 1 or (lay.pp > 1 and lay.but(vp=v).chunk_sizes(model.num_layers) is not None)]
        _drop(rej, "vp_needs_pp" if lay.pp == 1 else "vp_layers", vps, keep, len(eps) * len(etps) * len(mbss),
              lambda v: f"VP{v} with PP{lay.pp} for {model.num_layers} layers")
        vps = keep
    if "ep" in c and model.is_moe:
        keep = [e for e in eps if model.num_experts % e == 0]
        _drop(rej, "ep_experts", eps, keep, len(vps) * len(etps) * len(mbss),
              lambda e: f"EP{e} for {model.num_experts} experts")
        eps = keep
    if "mbs" in c:
        keep = [m for m in mbss if lay.gbs % (m * lay.dp) == 0]
        _drop(rej, "gbs_divisible", mbss, keep, len(vps) * len(eps) * len(etps),
              lambda m: f"mbs{m} x DP{lay.dp} for gbs {lay.gbs}")
        mbss = keep
    vps = [vp for vp in vps if vp == 1 or lay.pp > 1]
    if not vps:
        return
    sp = lay.tp > 1 and not (c.get("sequence_parallel") is False or (model.qk_layernorm and not opts.te))
    distopt = c.get("distributed_optimizer", True)
    for ep in eps:
        for etp in etps:
            # the expert rules read no virtual stage or micro-batch: checked once for all of them
            rule = next(expert_rules(lay.but(ep=ep, etp=etp), model), None)
            if rule:
                rej.add(rule, lambda ep=ep, etp=etp: f"EP{ep} ETP{etp} with TP{lay.tp} CP{lay.cp} DP{lay.dp}",
                        len(vps))
                continue
            for vp in vps:
                for mbs in mbss:
                    cand = lay.but(vp=vp, ep=ep, etp=etp, mbs=mbs, distributed_optimizer=distopt,
                                   sequence_parallel=sp)
                    rule = check_layout(cand, model, gpu, n_gpus, opts.te, opts.moe, opts.megatron)
                    if rule:
                        rej.add(rule, cand.label)
                        continue
                    floor = step_floor(model, cand, gpu, opts.te, opts.fp8_local(cand), opts.moe, opts.megatron,
                                       opts.attention_kernel, opts.fp8_scaling == "delayed")
                    todo.append((cand.gbs * cand.seq_length / floor, len(todo), cand))


def _cost_in_order(model: ModelConfig, gpu: GPUSpec, todo: list, recomputes: list[str], capacity: float,
                   rej: _Rejections, out: list[Candidate], opts: RuntimeOptions) -> None:
    """Cost the layouts fastest floor first (branch and bound): memory with the lightest recompute
    that fits, then the step. Once KEPT layouts are costed, a layout whose speed floor is more than
    TIE below the KEPT-th fastest of them can reach no place a plan shows (rank: its first
    RANKED_BY_TIES places are each within TIE of the fastest left, the rest by speed), and neither
    can any after it: they are counted as 'bounded', not costed.  Only plans that leave the memory
    margin free count among the KEPT: the others rank after all of those."""
    todo.sort(key=lambda t: (-t[0], t[1]))
    kept: list[float] = []       # min-heap of the KEPT fastest costed speeds
    # a layout without its micro-batch -> the smallest micro-batch known not to fit (memory grows
    # with the micro-batch); the floor's order meets the larger ones first, so the first of a
    # family met is checked at one micro-batch under the heaviest recompute: an infeasible
    # family then costs one memory report, not one per micro-batch
    smallest_unfit: dict[Layout, float] = {}
    for i, (bound, _, cand) in enumerate(todo):
        if len(kept) >= KEPT and bound < (1 - TIE) * kept[0]:
            rej.add("bounded", cand.label, len(todo) - i)
            return
        family = cand.but(mbs=0)
        if family not in smallest_unfit:
            smallest_unfit[family] = math.inf
            if cand.mbs > 1 and not _fits_at_all(model, cand.but(mbs=1), recomputes, capacity, opts):
                smallest_unfit[family] = 1
        if cand.mbs >= smallest_unfit[family]:
            rej.add("out_of_memory", lambda c=cand: f"{c.label()} (a smaller micro-batch of it does not fit)")
            continue
        outcome = _try_recompute(model, gpu, cand, recomputes, capacity, rej, out, opts)
        if outcome != "costed":
            if outcome == "unfit":   # a rule's refusal says nothing of the larger micro-batches' memory
                smallest_unfit[family] = min(cand.mbs, smallest_unfit[family])
            continue
        if tight(out[-1]):       # (a roomier variant of it, where there is one, came last)
            continue
        heapq.heappush(kept, out[-1].tokens_per_s)
        if len(kept) > KEPT:
            heapq.heappop(kept)


def _fits_at_all(model: ModelConfig, lay: Layout, allowed: list[str], capacity: float, opts: RuntimeOptions) -> bool:
    """Whether this layout fits under the heaviest recompute allowed (memory falls as recompute grows)."""
    heaviest = _recompute_options(model, lay, allowed)[-1:]
    if not heaviest:
        return False
    report = memory_report(model, heaviest[0], padded_vocab_size(model.vocab_size, lay.tp), opts.memory(heaviest[0]))
    return peak(report) <= capacity


def _recompute_options(model: ModelConfig, lay: Layout, allowed: list[str]) -> list[Layout]:
    opts = []
    if "none" in allowed:
        opts.append(lay.but(recompute="none"))
    if "selective" in allowed:
        opts.append(lay.but(recompute="selective"))
    if "full" in allowed:
        per_chunk = max(1, min(lay.chunk_sizes(model.num_layers) or [1]))
        for n in sorted({max(1, per_chunk // 2), per_chunk}):
            opts.append(lay.but(recompute="full", recompute_layers=n))
    return opts


def _try_recompute(model, gpu, lay, allowed, capacity, rej, out, opts: RuntimeOptions) -> str:
    """Cost the lightest recompute that fits (the others only lose time, or do not fit):
    'costed'; 'unfit' when none fits in memory; 'refused' when the rules refuse every recompute
    allowed (an MoE rule), which says nothing of memory. Memory falls as recompute grows: the
    lightest is tried first (it fits most often), then the heaviest (when it does not fit,
    nothing does), then those between."""
    padded = padded_vocab_size(model.vocab_size, lay.tp)
    options = []
    for option in _recompute_options(model, lay, allowed):
        # the MoE options' rules that depend on the recompute (the all-to-all overlap refuses some)
        rule = next(moe_rules(option, model, opts.moe, opts.te), None)
        if rule:
            rej.add(rule, option.label)
        else:
            options.append(option)
    if not options:
        return "refused"
    reports: dict[int, dict] = {}

    def fits(i: int) -> bool:
        reports[i] = memory_report(model, options[i], padded, opts.memory(options[i]))
        return peak(reports[i]) <= capacity

    order = [0] + ([len(options) - 1] if len(options) > 1 else []) + list(range(1, len(options) - 1))
    chosen = None
    for i in order:
        if fits(i):
            if i == len(options) - 1 and len(options) > 2:
                continue   # the heaviest fits: the lightest between that fits is the one
            chosen = i
            break
        if i == len(options) - 1:
            break          # not even the heaviest fits
    if chosen is None and len(options) - 1 in reports and peak(reports[len(options) - 1]) <= capacity:
        chosen = len(options) - 1
    for i, report in reports.items():
        if peak(report) > capacity:
            rej.add("out_of_memory", lambda o=options[i], r=report: f"{o.label()}: {peak(r) / GIB:.0f} GiB")
    if chosen is None:
        if len(options) - 1 in reports:   # the ones between cannot fit either
            rej.add("out_of_memory", lambda: f"{lay.label()} with lighter recompute", max(0, len(options) - len(reports)))
        return "unfit"
    out.append(predict(model, gpu, options[chosen], padded, opts, reports[chosen]))
    last = chosen
    if not leaves_margin(peak(reports[chosen]) / GIB, gpu.memory_gib):
        # it ranks after every plan that leaves the margin (rank): the lightest heavier recompute
        # that leaves it is costed too, so that this layout has a plan among those
        for i in range(chosen + 1, len(options)):
            if i not in reports:
                reports[i] = memory_report(model, options[i], padded, opts.memory(options[i]))
            if leaves_margin(peak(reports[i]) / GIB, gpu.memory_gib):
                out.append(predict(model, gpu, options[i], padded, opts, reports[i]))
                last = i
                break
    if len(options) - last - 1:
        rej.add("dominated", lambda: f"{options[-1].label()} (heavier recompute than needed)", len(options) - last - 1)
    return "costed"


def predict(model: ModelConfig, gpu: GPUSpec, lay: Layout, padded: int, opts: RuntimeOptions | None = None,
         mem=None) -> Candidate:
    """The predicted memory, step time and throughput of one layout under the runtime paths opts
    says the run takes (TE's layers by default)."""
    opts = opts or RuntimeOptions.from_request(None)
    mem = mem or memory_report(model, lay, padded, opts.memory(lay))
    t = step_time(model, lay, gpu, padded, opts.te, fused_head=opts.fused_head, fp8_linear=opts.fp8_local(lay),
                  fused_wgrad=opts.fused_wgrad, moe=opts.moe, megatron=opts.megatron, attention=opts.attention_kernel,
                  fp8_delayed=opts.fp8_scaling == "delayed")
    step = t.total
    tokens = lay.gbs * lay.seq_length
    model_flops = training_flops(model, lay.seq_length, lay.gbs, padded)
    tflops = model_flops / step / lay.world_size / 1e12
    return Candidate(layout=lay, memory=mem, time=t, tokens_per_s=tokens / step,
                     tflops_per_gpu=tflops, mfu=tflops / gpu.bf16_dense_tflops,
                     peak_gib=peak(mem) / GIB, gpu_gib=gpu.memory_gib)


def error_pct(predicted: float, measured: float) -> float:
    """How far a prediction is from its measurement, in per cent of the measurement."""
    return round((predicted - measured) / measured * 100, 1)
