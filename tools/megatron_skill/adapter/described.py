"""What a Megatron argument namespace describes: the model, the layout, and the memory options
of the run, with Megatron's own defaults for what the arguments leave out.

The namespace comes from an argument vector (validate, through the flag manifest) or from the
argument dump at the head of a Megatron log (logs): the same reading serves both. Anything not
read from an argument is named in `assumed`.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any, Iterator

from .. import files
from ..contract import load_schema, validator
from ..core.attention_kernels import PLANNED, AttentionKernel
from ..core.layout import Layout, pipeline_layout_chunks
from ..core.megatron_options import MegatronOptions
from ..core.memory import MemoryOptions, unfused_score_bytes
from ..core.model import ModelConfig, build_spec
from ..core.moe import MoEOptions
from ..core.options import RuntimeOptions
from ..errors import ToolError
from . import flags as megatron_flags


class Args(dict):
    """A log's argument dump as a namespace: a name it does not hold reads as None."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


# What a log's dump holds that no flag sets (Megatron's validate_args derives them), by the type
# the readers here take; skill_entry is the log reader's own mark (adapter/log.py).
DERIVED = {"world_size": int, "virtual_pipeline_model_parallel_size": int, "skill_entry": bool}
_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}


def _kind(flag: dict) -> str:
    if flag["action"] in ("StoreTrueAction", "StoreFalseAction", "BooleanOptionalAction"):
        return "True or False"
    what = {"int": "an integer", "float": "a number"}.get(flag["type"], "a string")
    if flag.get("nargs") in ("+", "*") or isinstance(flag.get("nargs"), int):
        what += " or a list of them"
    return what


def _conforms(flag: dict, value: Any) -> bool:
    """Whether a dumped value is of the type the flag's parser makes (None: left unset). Only the
    type: Megatron's validate_args rewrites values past their flag's choices (dtype names into
    torch dtypes, one-element lists into their element), and its own converters' values (type
    custom) are taken as they are."""
    if value is None or flag["type"] == "custom":
        return True
    if flag["action"] in ("StoreTrueAction", "StoreFalseAction", "BooleanOptionalAction"):
        return isinstance(value, bool)
    # a string flag's value that looks like a number ("--split 100") was read as one; a flag of
    # named choices takes only names
    one = _KINDS.get(flag["type"], lambda v: isinstance(v, str) or "choices" not in flag and isinstance(v, (int, float)))
    if flag.get("nargs") in ("+", "*") or isinstance(flag.get("nargs"), int):
        return one(value) or isinstance(value, (list, tuple)) and all(one(v) for v in value)
    return one(value)


MAX_LITERAL = 4096   # characters: Megatron's longest list values (data paths aside) are far shorter


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether a value is what a JSON answer carries as it is (no sets, bytes or complex numbers;
    dict keys strings, so that no two keys print alike)."""
    if value is None or isinstance(value, (str, int, float)):   # bool is an int
        return True
    if depth > 20:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def literal(text: str) -> Any:
    """A list, tuple or dict value of Megatron's argument dump, which prints each as str() of the
    Python value (--recompute-modules: "['core_attn', 'layernorm']"); the text itself where it is
    no such literal, longer than any flag's value, or holds more than strings, numbers and
    string-keyed dicts. typed_arguments reads it for the names it knows (a log can hold any number
    of others)."""
    if text[:1] not in ("[", "(", "{") or len(text) > MAX_LITERAL:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if _plain(value) else text


def typed_arguments(dumped: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A log's argument dump with each value of a known flag checked against the type Megatron's
    parser makes of it (the manifest's: a switch, an integer, a number, a string, a list of them
    for a flag of several values): (the values kept, why each other one was set aside). Literals
    (lists, tuples, dicts) are read only for the names a flag or DERIVED knows. A damaged or
    hand-edited dump then reads as unset there (Megatron's default) instead of breaking what
    reads it."""
    by_dest = {f["dest"]: f for f in megatron_flags.load_manifest()["flags"].values()}
    kept: dict[str, Any] = {}
    ignored: dict[str, str] = {}
    for name, value in dumped.items():
        flag = by_dest.get(name)
        if isinstance(value, str) and (flag is not None or name in DERIVED):
            value = literal(value)
        if flag is not None and not _conforms(flag, value):
            ignored[name] = f"{str(value)[:80]!r} is not what its flag takes ({_kind(flag)}): read as unset"
        elif name in DERIVED and value is not None and not (
                isinstance(value, DERIVED[name]) and (DERIVED[name] is bool or not isinstance(value, bool))):
            ignored[name] = f"{str(value)[:80]!r} is not {DERIVED[name].__name__}: read as unset"
        else:
            kept[name] = value
    return kept, ignored


def parse_values(args: list[str]) -> argparse.Namespace:
    ns, _ = megatron_flags.manifest_parser().parse_known_args(args)
    # Megatron's validate_args: --encoder-seq-length and --encoder-num-layers stand for the sizes
    # an encoder-decoder script (T5) leaves unset
    if ns.seq_length is None:
        ns.seq_length = ns.encoder_seq_length
    if ns.num_layers is None:
        ns.num_layers = ns.encoder_num_layers
    return ns


DEFAULT_VOCAB = 128256   # Llama 3's, said as assumed where nothing the arguments name tells
LLAMA2_VOCAB = 32000   # the pieces of Llama 2's tokenizer.model (Meta's Llama 2 release)
GPT2_VOCAB = 50257
MAX_TOKENIZER_BYTES = 256 << 20   # a tokenizer file larger than this is not read


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def sentencepiece_pieces(data: bytes) -> int:
    """The number of pieces of a SentencePiece model file (its ModelProto's repeated field 1),
    read from the protobuf wire format without the sentencepiece package."""
    i, pieces = 0, 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = _varint(data, i)
            i += length
            pieces += field == 1
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(data):
            raise ValueError("truncated field")
    if not pieces:
        raise ValueError("no pieces")
    return pieces


def hf_tokenizer_size(tokenizer_json: dict) -> int:
    """len(tokenizer) of a Hugging Face tokenizer.json: the ids of its model's vocabulary and of
    its added tokens, each once (Megatron's HuggingFaceTokenizer takes len(tokenizer))."""
    vocab = (tokenizer_json.get("model") or {}).get("vocab")
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab))) if isinstance(vocab, list) \
        else set()
    ids |= {t["id"] for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict)
            and isinstance(t.get("id"), int)}
    if not ids:
        raise ValueError("no vocabulary")
    return len(ids)


def vocabulary(ns: Any) -> tuple[int, str, bool]:
    """(vocabulary size, where it comes from, whether it was read rather than assumed): from the
    tokenizer the arguments name, as Megatron's build_tokenizer would size it; the padded size a
    log reports; --vocab-size where the tokenizer takes it (NullTokenizer, TikTokenizer) or
    nothing else tells; the stated default only where nothing says."""
    import json

    kind = getattr(ns, "tokenizer_type", None)
    model = getattr(ns, "tokenizer_model", None)
    padded = getattr(ns, "padded_vocab_size", None)
    if isinstance(padded, int) and not isinstance(padded, bool) and padded > 0:   # in a log's dump
        return padded, "padded_vocab_size in the log's argument dump", True
    given = ns.vocab_size if isinstance(getattr(ns, "vocab_size", None), int) and ns.vocab_size > 0 else None
    if kind in ("NullTokenizer", "TikTokenizer") and given:
        return given, f"--vocab-size {given} ({kind} takes its size from it)", True
    missing = ""
    if kind is None and getattr(ns, "vocab_file", None) and getattr(ns, "merge_file", None):
        kind = "GPT2BPETokenizer"   # pretrain_gpt.py's default type (its args_defaults), which reads these files
    try:
        if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer") and model:
            path = Path(model)
            if path.is_file():
                n = sentencepiece_pieces(files.read_regular(path, MAX_TOKENIZER_BYTES))
                return n, f"{kind}: the {n} pieces of {model}", True
            missing = f"{kind}'s model file {model} is not here (it is read where the job runs)"
        elif kind == "HuggingFaceTokenizer" and model:
            folder = Path(model)
            tj = folder / "tokenizer.json" if folder.is_dir() else folder
            if tj.is_file() and tj.name.endswith(".json"):
                n = hf_tokenizer_size(json.loads(files.read_regular(tj, MAX_TOKENIZER_BYTES)))
                return n, f"HuggingFaceTokenizer: len(tokenizer) of {tj} ({n})", True
            cfg = folder / "config.json"
            if cfg.is_file():
                n = json.loads(files.read_regular(cfg, MAX_TOKENIZER_BYTES)).get("vocab_size")
                if isinstance(n, int) and n > 0:
                    return n, f"HuggingFaceTokenizer: vocab_size of {cfg} (no tokenizer.json beside it)", True
            missing = f"the Hugging Face tokenizer {model} is not a folder here (it is read where the job runs)"
        elif kind == "GPT2BPETokenizer":
            vocab_file = getattr(ns, "vocab_file", None)
            if vocab_file and Path(vocab_file).is_file():
                n = len(json.loads(files.read_regular(vocab_file, MAX_TOKENIZER_BYTES)))
                return n, f"GPT2BPETokenizer: the {n} entries of {vocab_file}", True
            return GPT2_VOCAB, f"{GPT2_VOCAB}, GPT-2's BPE vocabulary (GPT2BPETokenizer; its vocab file is not here)", \
                False
    except (OSError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        missing = f"the tokenizer file could not be read here ({type(e).__name__}: {e})"
    if given:
        return given, f"--vocab-size {given}" + (f" ({missing})" if missing else ""), True
    if kind == "Llama2Tokenizer":
        return LLAMA2_VOCAB, (f"{LLAMA2_VOCAB}, assumed: Llama 2's tokenizer.model, which Llama2Tokenizer is named "
                              f"for ({missing or 'no --tokenizer-model'}); add --vocab-size for another"), False
    why = missing or f"the run's tokenizer ({kind or 'unnamed'}) decides at run time"
    return DEFAULT_VOCAB, f"{DEFAULT_VOCAB}, assumed: {why}; add --vocab-size for an exact figure", False


def _vocab_size(ns: Any, assumed: dict[str, str]) -> int:
    """The vocabulary the run will have (vocabulary); named in `assumed` where not read."""
    n, source, read = vocabulary(ns)
    if not read:
        assumed["vocab_size"] = source
    return n


# The arguments without which there is no model to cost (the rest have Megatron's defaults).
MODEL_SIZE_ARGUMENTS = ("num_layers", "hidden_size", "num_attention_heads")


def model_from_args(ns: Any, assumed: dict[str, str]) -> tuple[ModelConfig | None, str | None]:
    """The model the arguments describe, read whole with Megatron's own defaults for what they
    leave out (GELU, LayerNorm, learned positions, biases on, tied embeddings)."""
    missing = [f"--{k.replace('_', '-')}" for k in MODEL_SIZE_ARGUMENTS if getattr(ns, k, None) is None]
    if missing:
        return None, "the arguments do not set " + ", ".join(missing)
    if ns.ffn_hidden_size is None:
        # Megatron's own default: 4h, or 8h/3 rounded to 64 for SwiGLU (arguments.py)
        ffn = int(4 * ns.hidden_size * 2 / 3 / 64) * 64 if ns.swiglu else 4 * ns.hidden_size
        assumed["ffn_hidden_size"] = f"{ffn}, Megatron's default for this hidden size"
    else:
        ffn = ns.ffn_hidden_size
    seq = ns.seq_length or ns.decoder_seq_length
    fields = {
        "num_layers": ns.num_layers, "hidden_size": ns.hidden_size, "ffn_hidden_size": ffn,
        "num_attention_heads": ns.num_attention_heads, "vocab_size": _vocab_size(ns, assumed),
        "num_query_groups": ns.num_query_groups if ns.group_query_attention else None,
        "kv_channels": ns.kv_channels,
        "max_position_embeddings": ns.max_position_embeddings or seq or 4096,
        "untie_embeddings_and_output_weights": bool(ns.untie_embeddings_and_output_weights),
        "activation": "swiglu" if ns.swiglu else ("squared_relu" if ns.squared_relu else "gelu"),
        "normalization": ns.normalization if ns.normalization in ("RMSNorm", "LayerNorm") else "LayerNorm",
        "position_embedding_type": "rope" if ns.position_embedding_type in ("rope", "yarn", "mrope")
        else "learned_absolute",
        "add_bias_linear": ns.add_bias_linear is not False,
        "add_qkv_bias": bool(ns.add_qkv_bias) or ns.add_bias_linear is not False,
        "qk_layernorm": bool(ns.qk_layernorm),
        "num_experts": ns.num_experts, "moe_router_topk": ns.moe_router_topk or 2,
        "moe_ffn_hidden_size": ns.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": ns.moe_shared_expert_intermediate_size,
        "multi_latent_attention": bool(ns.multi_latent_attention),
        "mtp_num_layers": ns.mtp_num_layers,
    }
    if ns.num_experts:   # the router as the script sets it (its rules depend on the score function:
        # core/model.py); a dense model's router flags are Megatron's to ignore
        fields.update(moe_router_score_function=ns.moe_router_score_function,
                      moe_router_pre_softmax=bool(ns.moe_router_pre_softmax),
                      moe_router_enable_expert_bias=bool(ns.moe_router_enable_expert_bias),
                      moe_router_topk_scaling_factor=ns.moe_router_topk_scaling_factor,
                      moe_router_num_groups=ns.moe_router_num_groups, moe_router_group_topk=ns.moe_router_group_topk)
    if ns.multi_latent_attention:
        fields.update(q_lora_rank=ns.q_lora_rank, kv_lora_rank=ns.kv_lora_rank, qk_head_dim=ns.qk_head_dim,
                      qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim, v_head_dim=ns.v_head_dim)
    if ns.moe_layer_freq not in (None, 1):
        fields["moe_layer_freq"] = ns.moe_layer_freq if isinstance(ns.moe_layer_freq, (int, list)) \
            else str(ns.moe_layer_freq)
    fields = {k: v for k, v in fields.items() if v is not None}
    why = beyond_plan_bounds(model=fields)
    if why:
        return None, why
    try:
        return build_spec("script", fields, where="script"), None
    except ToolError as e:
        return None, e.message


# The words of beyond_plan_bounds' answers: every one ends OUT_OF_RANGE; one for a size above the
# range (no GPU holds such a model or run) says ABOVE_RANGE, one below it (a 0, a short
# sequence) does not: Megatron may well start that run, or its own checks say why not.
OUT_OF_RANGE = "outside the range a plan covers"
ABOVE_RANGE = "above the most"
NEGATIVE = "negative: no run has such a size"


def no_run_has(why: str | None) -> bool:
    """Whether beyond_plan_bounds' answer is a size no run has (above the range, or negative): an
    error, where a size below the range (a 0, a short sequence) is a warning."""
    return bool(why) and (ABOVE_RANGE in why or NEGATIVE in why)


def beyond_plan_bounds(model: dict[str, Any] | None = None, lay: Layout | None = None) -> str | None:
    """Why sizes read from arguments lie outside what a plan request may ask (the bounds of
    schemas/plan.request.json), or None. The planner's costs are made for that range; a script or
    a damaged dump far beyond it (10^8 layers, a 10^30 hidden size) would take minutes to cost or
    give figures of no run, and no run Megatron starts is there."""
    request: dict[str, Any] = {"model": {k: v for k, v in (model or {}).items() if not isinstance(v, list)}
                               if model is not None else "the arguments' model"}
    steps = [request]
    if lay is not None:   # the parallel sizes first: the world size is their product
        steps.append({**request, "seq_length": lay.seq_length, "global_batch_size": lay.gbs,
                      "constraints": {"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "cp": lay.cp, "ep": lay.ep,
                                      "etp": lay.etp, "mbs": lay.mbs}})
        steps.append({**steps[-1], "num_gpus": lay.world_size})
    checker = validator(load_schema("plan", "request"))
    order = [*(model or {}), "seq_length", "global_batch_size", "tp", "pp", "vp", "cp", "ep", "etp", "mbs"]
    for step in steps:
        errors = [(str(e.absolute_path[-1]) if e.absolute_path else "", e)
                  for e in _leaf_errors(checker.iter_errors(step))]
        if errors:   # the first in the arguments' order: a size given before the ones derived from it
            name, e = min(errors, key=lambda x: order.index(x[0]) if x[0] in order else len(order))
            negative = e.validator == "minimum" and isinstance(e.instance, (int, float)) and e.instance < 0
            said = {"maximum": f"{e.instance} is {ABOVE_RANGE} of {e.validator_value}",
                    "minimum": f"{e.instance} is {NEGATIVE}" if negative else
                    f"{e.instance} is below the least of {e.validator_value}"}.get(e.validator, e.message)
            return f"{_ARGUMENT_NAMES.get(name, name)}: {said}, {OUT_OF_RANGE}"
    return None


def _leaf_errors(errors) -> Iterator[Any]:
    """The schema's errors under its oneOf / anyOf branches (a count given where a name or a list
    may be given fails every branch: the branch that takes a count says why)."""
    for e in errors:
        if e.context:
            yield from _leaf_errors(e.context)
        else:
            yield e


# The request's names of layout sizes, as the arguments name them.
_ARGUMENT_NAMES = {"num_gpus": "world size (TP x PP x CP x DP)", "tp": "tensor_model_parallel_size",
                   "pp": "pipeline_model_parallel_size", "vp": "virtual pipeline stages per rank",
                   "cp": "context_parallel_size", "ep": "expert_model_parallel_size",
                   "etp": "expert_tensor_parallel_size", "mbs": "micro_batch_size"}


def layout_from_args(ns: Any, model: ModelConfig, world: int | None, assumed: dict[str, str]) -> Layout:
    tp, pp, cp = ns.tensor_model_parallel_size or 1, ns.pipeline_model_parallel_size or 1, ns.context_parallel_size or 1
    vp = ns.num_virtual_stages_per_pipeline_rank or getattr(ns, "virtual_pipeline_model_parallel_size", None) or 1
    if ns.num_layers_per_virtual_pipeline_stage:
        vp = max(1, (model.num_layers // pp) // ns.num_layers_per_virtual_pipeline_stage)
    layout = getattr(ns, "pipeline_model_parallel_layout", None)
    if layout:   # the layout string's chunks set the virtual stages (Megatron's validate_args)
        vp = max(1, len(pipeline_layout_chunks(str(layout)) or ()) // pp)
    world = world or getattr(ns, "world_size", None)   # a log's dump says it
    if world is None:
        assumed["world_size"] = f"{tp * pp * cp} (TP x PP x CP: the GPU count is not known; pass num_gpus)"
    world = world or tp * pp * cp
    dp = max(1, world // (tp * pp * cp))
    mbs = ns.micro_batch_size if ns.micro_batch_size is not None else 1   # a 0 stays 0: beyond_plan_bounds says it
    if ns.seq_length is None:
        assumed["seq_length"] = "4096 (the arguments set no --seq-length)"
    recompute = ns.recompute_granularity or "none"
    lay = Layout(tp=tp, pp=pp, vp=vp, cp=cp, ep=ns.expert_model_parallel_size or 1,
                  etp=ns.expert_tensor_parallel_size or 1, dp=dp, mbs=mbs,
                  gbs=ns.global_batch_size if ns.global_batch_size is not None else mbs * dp,
                  seq_length=ns.seq_length if ns.seq_length is not None else 4096, recompute=recompute,
                  recompute_layers=ns.recompute_num_layers or (0 if recompute != "full" else 1),
                  distributed_optimizer=bool(ns.use_distributed_optimizer),
                  sequence_parallel=bool(ns.sequence_parallel),
                  precision=precision(ns), **_pipeline_split(ns, model.num_layers, pp))
    if recompute == "full" and getattr(ns, "recompute_method", None) == "uniform":
        # uniform recomputes every layer, checkpointing the input of each group of
        # --recompute-num-layers; block recomputes that many layers of each stage (the Layout's count)
        chunks = lay.chunk_sizes(model.num_layers)
        if chunks:
            lay = lay.but(recompute_layers=max(1, min(chunks)))
            # (the layout's count is one for every stage: where the split is uneven, the smallest's)
            costed = ("costed as full recompute of all of them" if min(chunks) == max(chunks) else
                      f"costed as full recompute of {min(chunks)} layers of each stage, the smallest stage's count "
                      f"(the larger stages' other layers are costed as kept: their memory is overstated)")
            assumed["recompute"] = (f"--recompute-method uniform recomputes every layer of each stage, in groups "
                                    f"of {ns.recompute_num_layers or 1}: {costed}")
    return lay


def precision(ns: Any) -> str:
    """fp8 for Transformer Engine's FP8 (--fp8-format on TE's layers) and for the skill entry's FP8
    linear layers (--skill-fp8-linear on the local layers; labelled and costed as the planner
    labels and costs such a plan at any TP); bf16 otherwise (Megatron's local layers have no
    FP8 path)."""
    if transformer_engine(ns):
        return "fp8" if ns.fp8 else "bf16"
    return "fp8" if skill_entry(ns) and getattr(ns, "skill_fp8_linear", False) else "bf16"


def _pipeline_split(ns: Any, num_layers: int, pp: int) -> dict[str, Any]:
    """Layout fields of the pipeline split. With only one of the first / last counts given,
    Megatron spreads the rest evenly over the other ranks, the other end included."""
    if getattr(ns, "pipeline_model_parallel_layout", None):
        return {"pipeline_split": "layout", "pipeline_layout": str(ns.pipeline_model_parallel_layout)}
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return {"pipeline_split": "embedding_loss" if ns.account_for_embedding_in_pipeline_split else "even"}
    others = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    share = rest // others if others > 0 and rest % others == 0 else 0  # 0: not whole, refused as pp_uneven
    return {"pipeline_split": "uneven", "first_stage_layers": share if first is None else first,
            "last_stage_layers": share if last is None else last}



def logged_run(dumped: dict) -> tuple[Any, ModelConfig | None, Layout | None, dict[str, str], str | None]:
    """A log's argument dump as (its arguments, the model, the layout, what was assumed where an
    argument was missing, why there is no model where there is none)."""
    ns = Args(dumped)
    assumed: dict[str, str] = {}
    model, why = model_from_args(ns, assumed)
    lay = layout_from_args(ns, model, None, assumed) if model is not None else None
    if lay is not None:
        why = beyond_plan_bounds(lay=lay)
        if why:
            model = lay = None
    return ns, model, lay, assumed, why

def skill_entry(ns: Any) -> bool:
    """Whether the arguments are for the skill's entry script (its own flags are set)."""
    return any(getattr(ns, k, None) for k in ("skill_entry", "skill_linear_cross_entropy", "skill_fp8_linear",
                                               "skill_compiled_rope", "skill_native_gqa", "skill_fused_adam"))


def transformer_engine(ns: Any) -> bool:
    return (ns.transformer_impl or "transformer_engine") != "local"


def attention_path(ns: Any) -> tuple[str, str]:
    """The core attention the run uses, and why: the skill's entry runs SDPA; Megatron's
    Transformer Engine layers run TE's fused / flash kernels; its local layers run the unfused
    DotProductAttention, which keeps the S x S scores (memory.py counts them)."""
    if skill_entry(ns) and not transformer_engine(ns):
        return "sdpa", "the skill's entry: torch SDPA (flash / cuDNN / efficient kernels)"
    if not transformer_engine(ns):
        return "unfused", ("--transformer-impl local with Megatron's entry: the local DotProductAttention "
                           "materialises the S x S attention scores")
    return "flash", "Transformer Engine's layers: fused / flash attention (no S x S buffer)"


def explicit_mask(ns: Any) -> bool:
    """Whether Megatron's dataloader builds an explicit [s, s] causal mask per sample (its default;
    --no-create-attention-mask-in-dataloader turns it off). Torch SDPA handed a mask computes the
    whole square with a slower kernel; Megatron's local DotProductAttention reads it either way."""
    return getattr(ns, "create_attention_mask_in_dataloader", True) is not False


def attention_name(ns: Any) -> str:
    """flash, sdpa, sdpa_masked (SDPA over the dataloader's explicit mask) or unfused."""
    path = attention_path(ns)[0]
    return "sdpa_masked" if path == "sdpa" and explicit_mask(ns) else path


def attention_kernel(ns: Any) -> AttentionKernel:
    """The core attention kernel as the step-time model costs it: the planned one (TE's flash,
    the skill's SDPA causal kernel), or the slower one these arguments ask for; the unfused
    kernel's softmax precision and dropout from the arguments (Megatron's default dropout 0.1)."""
    name = attention_name(ns)
    if name not in ("sdpa_masked", "unfused"):
        return PLANNED
    dropout = getattr(ns, "attention_dropout", None)
    return AttentionKernel(name, fp32_softmax=bool(getattr(ns, "attention_softmax_in_fp32", False)
                                                    or getattr(ns, "apply_query_key_layer_scaling", False)),
                           dropout=(dropout if dropout is not None else 0.1) > 0)


def runtime_options(ns: Any) -> RuntimeOptions:
    """The runtime paths the arguments say ran, as the planner's options: Transformer Engine's
    layers, or the local ones with whichever of the skill entry's fused paths are on (none with
    Megatron's own entry, whose weight gradients are fused only with apex's kernel), and the
    attention kernel they ask for."""
    te = transformer_engine(ns)
    own = skill_entry(ns)
    fused_wgrad = getattr(ns, "gradient_accumulation_fusion", True) is not False
    return RuntimeOptions(linear_cross_entropy=own and bool(ns.skill_linear_cross_entropy),
                          compiled_rope=own and bool(ns.skill_compiled_rope),
                          native_gqa=own and bool(ns.skill_native_gqa),
                          sdpa_backend=str(getattr(ns, "skill_sdpa_backend", None) or "auto"),
                          fused_wgrad_accumulation=fused_wgrad,
                          fp8_linear=own and bool(ns.skill_fp8_linear), fused_adam=own and bool(ns.skill_fused_adam),
                          fp8_scaling=str(getattr(ns, "skill_fp8_scaling", None) or "current") if own else "current",
                          te=te, moe=MoEOptions.from_args(ns), megatron=MegatronOptions.from_args(ns),
                          attention_kernel=attention_kernel(ns),
                          te_fp8_delayed=te and bool(getattr(ns, "fp8", None))
                          and getattr(ns, "fp8_recipe", None) == "delayed")


def memory_options(ns: Any, lay: Layout, assumed: dict[str, str]) -> MemoryOptions:
    """The arguments that change memory beyond the layout, as the planner's options; each choice
    not read from an argument is named in `assumed`."""
    attention, why = attention_path(ns)
    assumed["attention"] = f"{attention}: {why}"
    score_bytes = 0.0
    if attention == "unfused":
        fp32 = bool(ns.attention_softmax_in_fp32 or ns.apply_query_key_layer_scaling)
        dropout = (ns.attention_dropout if ns.attention_dropout is not None else 0.1) > 0  # Megatron's default 0.1
        score_bytes = unfused_score_bytes(fp32, dropout)
        assumed["attention"] += (f" ({score_bytes:g} bytes per head and score kept: softmax in "
                                 f"{'fp32' if fp32 else 'bf16'}, attention dropout {'on' if dropout else 'off'})")
    te = transformer_engine(ns)
    # Without TE Megatron falls back to torch's AdamW (multi-tensor: a 4-byte temporary per
    # parameter at the step) unless the skill's entry steps it fused; apex is not assumed.
    if not te:
        assumed["optimizer"] = ("torch's fused AdamW (the skill's --skill-fused-adam)"
                                if getattr(ns, "skill_fused_adam", False) else
                                "torch's multi-tensor AdamW (Megatron's fallback without TE or apex): "
                                "sqrt(exp_avg_sq) of the shard allocated at each step")
    modules = ns.recompute_modules or ["core_attn"]   # Megatron's default under selective
    if isinstance(modules, str):   # one name (typed_arguments lets a list flag's single value be)
        modules = [modules]
    # The planner's own options for the paths these arguments ran, with what only a command line
    # says: the unfused attention's scores, the selective set; the skill's FP8 layers only under
    # its entry (Megatron's entry with local layers has no FP8 linear path).
    opts = runtime_options(ns).memory(lay)
    return dataclasses.replace(opts, score_bytes=score_bytes, recompute_modules=frozenset(modules),
                               fp8_linear=opts.fp8_linear and skill_entry(ns))
