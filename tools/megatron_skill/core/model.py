"""A transformer's shape, and what follows from it alone: parameter counts.

Field names are Megatron's own argument names (``--num-layers`` is ``num_layers``),
so a spec maps one-to-one onto a launch command and onto the ``args`` namespace that
Megatron's own accounting code reads.  Nothing here knows about GPUs or parallelism.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

from ..errors import ToolError

# What a field left out of a catalog entry or a request means: a Llama-style decoder.
DEFAULTS: dict[str, Any] = {
    "family": "custom",
    "num_query_groups": None,          # None: plain multi-head attention
    "kv_channels": None,               # None: hidden_size // num_attention_heads
    "max_position_embeddings": 4096,
    "rotary_base": 10000,
    "rope_scaling_factor": None,       # Llama 3.1's long-context RoPE (--use-rope-scaling); None: off
    "untie_embeddings_and_output_weights": True,
    "activation": "swiglu",            # swiglu | gelu | squared_relu
    "normalization": "RMSNorm",        # RMSNorm | LayerNorm
    "norm_epsilon": 1e-5,              # Megatron's default (--norm-epsilon)
    "position_embedding_type": "rope", # rope | learned_absolute
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "num_experts": None,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_router_pre_softmax": False,   # True: top-k of the softmax, not renormalised (Megatron's flag)
    # The router's scores, DeepSeek-V3's way where set: sigmoid scores, a bias per expert that
    # balances the load without the auxiliary loss, routing within the best groups of experts,
    # and the routed weights scaled (Megatron's --moe-router-* flags of the same names).
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "approximations": (),
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "mtp_num_layers": None,
    "default_seq_length": None,
    "published_params": None,
    "published_active_params": None,
    "source": None,
}
REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
ENUMS = {
    "activation": ("swiglu", "gelu", "squared_relu"),
    "normalization": ("RMSNorm", "LayerNorm"),
    "position_embedding_type": ("rope", "learned_absolute"),
    "moe_router_score_function": ("softmax", "sigmoid", "sqrtsoftplus"),
}


def hash_once(obj) -> int:
    """A frozen dataclass's hash, computed from its fields once and kept: the planner's caches hash
    the same model and GPU for every layout they cost (field by field, thousands of times a plan)."""
    kept = obj.__dict__.get("_hash")
    if kept is None:
        kept = hash(tuple(getattr(obj, f.name) for f in dataclasses.fields(obj)))
        object.__setattr__(obj, "_hash", kept)
    return kept


def state_without_hash(obj) -> dict:
    """What pickle and copy carry of such an object: its fields, not the kept hash (a string's hash
    differs from process to process: a hash carried into another would break hash == for equal
    objects)."""
    return {k: v for k, v in obj.__dict__.items() if k != "_hash"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    __hash__ = hash_once
    __getstate__ = state_without_hash

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    family: str
    num_query_groups: int | None
    kv_channels: int | None
    max_position_embeddings: int
    rotary_base: int
    rope_scaling_factor: float | None
    untie_embeddings_and_output_weights: bool
    activation: str
    normalization: str
    norm_epsilon: float
    position_embedding_type: str
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    num_experts: int | None
    moe_router_topk: int
    moe_ffn_hidden_size: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_layer_freq: int | str
    moe_router_pre_softmax: bool
    moe_router_score_function: str
    moe_router_enable_expert_bias: bool
    moe_router_topk_scaling_factor: float | None
    moe_router_num_groups: int | None
    moe_router_group_topk: int | None
    multi_latent_attention: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    mtp_num_layers: int | None
    default_seq_length: int | None
    published_params: float | None
    published_active_params: float | None
    source: str | None
    # What the Hugging Face config it was read from says that this model does not carry
    # (hf_differences): the plan costs, and a script trains, the model without them.
    approximations: tuple[str, ...]

    # ---- derived shape ---------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: RMSNorm has a scale, LayerNorm a scale and a bias."""
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

    def moe_pattern(self) -> list[int]:
        """1 for each layer whose MLP is a mixture of experts, as Megatron's --moe-layer-freq."""
        return list(self._moe_pattern)

    @functools.cached_property
    def _moe_pattern(self) -> tuple[int, ...]:
        if not self.is_moe:
            return (0,) * self.num_layers
        return tuple(moe_layer_pattern(self.moe_layer_freq, self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(self._moe_pattern)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    # ---- parameters, per part --------------------------------------------------------
    def attention_params(self) -> int:
        """Weights of one attention block (without its input norm)."""
        h = self.hidden_size
        if self.multi_latent_attention:
            a, qk = self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * qk
            else:
                q = h * a * qk
            kv = (h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * a * (self.qk_head_dim + self.v_head_dim))
            return q + kv + a * self.v_head_dim * h
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.query_groups * self.head_dim
        params = h * (q + kv) + q * h
        if self.add_bias_linear or self.add_qkv_bias:
            params += q + kv
        if self.add_bias_linear:
            params += h
        if self.qk_layernorm:
            params += 2 * self.head_dim * (1 if self.normalization == "RMSNorm" else 2)
        return params

    def mlp_params(self, ffn: int) -> int:
        """Weights of one dense MLP with hidden width ffn."""
        h = self.hidden_size
        up = (2 if self.gated else 1) * ffn
        params = h * up + ffn * h
        if self.add_bias_linear:
            params += up + h
        return params

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.is_moe else 0

    def routed_expert_params(self) -> int:
        """All routed experts of one MoE layer."""
        return self.num_experts * self.mlp_params(self.expert_ffn) if self.is_moe else 0

    def shared_expert_params(self) -> int:
        s = self.moe_shared_expert_intermediate_size
        return self.mlp_params(s) if s else 0

    def layer_params(self, moe: bool) -> int:
        norms = 2 * self.norm_params
        if moe:
            mlp = self.router_params() + self.routed_expert_params() + self.shared_expert_params()
        else:
            mlp = self.mlp_params(self.ffn_hidden_size)
        return self.attention_params() + mlp + norms

    def embedding_params(self, vocab: int | None = None) -> int:
        """Input embedding, plus learned positions when the model has them."""
        v = vocab or self.vocab_size
        pos = self.max_position_embeddings * self.hidden_size
        return v * self.hidden_size + (pos if self.position_embedding_type == "learned_absolute" else 0)

    def output_params(self, vocab: int | None = None) -> int:
        """The output layer's own weight: none when tied to the input embedding."""
        v = vocab or self.vocab_size
        return v * self.hidden_size if self.untie_embeddings_and_output_weights else 0

    def mtp_params(self) -> int:
        """DeepSeek-V3-style multi-token prediction modules (shared embedding and head)."""
        if not self.mtp_num_layers:
            return 0
        last_is_moe = bool(self.moe_pattern()[-1])
        h = self.hidden_size
        per_module = self.layer_params(last_is_moe) + 3 * self.norm_params + 2 * h * h
        return self.mtp_num_layers * per_module

    def total_params(self, vocab: int | None = None) -> int:
        """The main model, as papers count it (MTP modules excluded)."""
        layers = (self.num_dense_layers * self.layer_params(False)
                  + self.num_moe_layers * self.layer_params(True))
        return layers + self.norm_params + self.embedding_params(vocab) + self.output_params(vocab)

    def active_params(self, vocab: int | None = None) -> int:
        """Parameters a token touches: the top-k routed experts instead of all of them."""
        if not self.is_moe:
            return self.total_params(vocab)
        idle = (self.num_experts - self.moe_router_topk) * self.mlp_params(self.expert_ffn)
        return self.total_params(vocab) - self.num_moe_layers * idle

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "family": self.family,
            "params_b": round(self.total_params() / 1e9, 3),
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "heads": self.num_attention_heads,
            "query_groups": self.query_groups,
            "vocab": self.vocab_size,
        }
        if self.is_moe:
            out.update(active_params_b=round(self.active_params() / 1e9, 3),
                       experts=self.num_experts, topk=self.moe_router_topk)
        if self.mtp_num_layers:
            out["mtp_params_b"] = round(self.mtp_params() / 1e9, 3)
        if self.approximations:
            out["approximations"] = list(self.approximations)
        return out

    def to_fields(self) -> dict[str, Any]:
        """The spec as plain field values, the form a request may carry (which names no
        approximations: a request's fields are the model)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "approximations"}


# The words of a bad_model answer for what Megatron itself refuses when it builds the model
# (after its parser and validate_args have passed it): validate makes those errors.
REFUSED_WHEN_BUILT = "(Megatron refuses it when it builds the model)"
MAX_PATTERN = 65536   # entries a layer pattern may spell out (models have at most 4,096 layers)


def _layer_list(text: str) -> list[int] | int | None:
    """The list a --moe-layer-freq string spells, as Megatron's eval would make it, from list
    literals of 0 and 1 joined by + and repeated by * (in any nesting), or the whole number it
    is: read from its syntax tree, never evaluated; None for anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None

    def value(node: ast.AST) -> list[int] | int | None:
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            return items if all(i in (0, 1) and not isinstance(i, list) for i in items) else None
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return a + b if isinstance(a, list) and isinstance(b, list) and len(a) + len(b) <= MAX_PATTERN \
                    else None
            if isinstance(a, int) and isinstance(b, list):
                a, b = b, a
            if isinstance(a, list) and isinstance(b, int) and 0 <= len(a) * b <= MAX_PATTERN:
                return a * b
        return None

    try:
        out = value(tree)
    except RecursionError:   # thousands of terms in a chain: no pattern a model has
        return None
    return out


def moe_layer_pattern(freq: int | str | list | tuple, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq: an int N (every Nth layer, from layer 0), a list, or
    the string form "([0]*3+[1]*58)".  Parsed without eval."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if isinstance(freq, (list, tuple)):
        pattern = [int(bool(x)) for x in freq]
    else:
        pattern = _layer_list(str(freq))
        if isinstance(pattern, int) and pattern >= 1:   # "2": Megatron's int form, as text
            return moe_layer_pattern(pattern, num_layers)
        if not isinstance(pattern, list):
            raise ToolError("bad_model", f"cannot read moe_layer_freq {str(freq)[:200]!r}",
                            where="model.moe_layer_freq",
                            fix='give an int, a list of 0/1, or a string like "([0]*3+[1]*58)" or "([1]*3+[0])*6"')
    if len(pattern) != num_layers:
        raise ToolError("bad_model", f"moe_layer_freq has {len(pattern)} entries for {num_layers} layers "
                        f"{REFUSED_WHEN_BUILT}",
                        where="model.moe_layer_freq", fix="give one 0/1 entry per layer")
    return pattern


def _router_rule(v: dict[str, Any]) -> tuple[str, str, str, bool] | None:
    """The first rule for the router the fields break, as (what, the field, how to fix, whether
    Megatron refuses it), or None. Megatron's (TransformerConfig and its group-limited top-k):
    a script that breaks one passes the argument parser and stops when Megatron builds the
    model, or at its first step."""
    experts, topk = v["num_experts"], v["moe_router_topk"]
    routed = (v["moe_router_score_function"] != "softmax" or v["moe_router_enable_expert_bias"]
              or v["moe_router_topk_scaling_factor"] is not None or v["moe_router_num_groups"] is not None)
    if not experts:   # not Megatron's rule (it ignores them): settings that would say nothing
        return ("router settings on a model without experts", "num_experts",
                "give num_experts, or leave the moe_router_* fields out", False) if routed else None
    if v["moe_router_enable_expert_bias"] and v["moe_router_score_function"] == "softmax":
        return ("the expert bias needs sigmoid (or sqrtsoftplus) scores in Megatron", "moe_router_enable_expert_bias",
                "set moe_router_score_function to sigmoid, or leave the bias out", True)
    if topk == 1 and v["moe_router_score_function"] == "softmax" and not v["moe_router_pre_softmax"]:
        return ("top-1 routing over softmax scores renormalised gives every token the weight 1: Megatron asks for "
                "the softmax before the top-k", "moe_router_pre_softmax", "set moe_router_pre_softmax to true",
                True)
    groups, group_topk = v["moe_router_num_groups"], v["moe_router_group_topk"]
    if (groups is None) != (group_topk is None) or (groups and (group_topk > groups or experts % groups)):
        return (f"moe_router_num_groups {groups} and moe_router_group_topk {group_topk}: give both, the groups "
                "dividing the experts and the top groups no more than the groups", "moe_router_num_groups",
                "DeepSeek-V3: 8 groups, the top 4", False)
    if groups and not 1 <= topk // group_topk <= experts // groups:
        return (f"group-limited routing ranks each of {groups} groups by the sum of its top {topk // group_topk} "
                f"scores (top-k {topk} // {group_topk} groups), which must be 1 to {experts // groups}, the "
                "experts of a group", "moe_router_group_topk",
                "choose at most top-k groups, and no more top-k per group than a group has experts", True)
    return None


def build_spec(name: str, fields: dict[str, Any], where: str = "model") -> ModelConfig:
    """A spec from field values: defaults filled in, every field checked."""
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ToolError("bad_model", f"unknown model field(s) {unknown}", where=where,
                        fix=f"use Megatron argument names, e.g. {', '.join(REQUIRED)}")
    missing = [k for k in REQUIRED if fields.get(k) is None]
    if missing:
        raise ToolError("bad_model", f"model is missing {missing}", where=where,
                        fix="give every one of " + ", ".join(REQUIRED))
    values = {**DEFAULTS, **fields}
    for key in ("moe_layer_freq", "approximations"):   # tuples: a model is hashable (the planner caches by it)
        if isinstance(values[key], list):
            values[key] = tuple(values[key])
    for key in REQUIRED + ("num_query_groups", "kv_channels", "num_experts", "moe_ffn_hidden_size",
                           "moe_shared_expert_intermediate_size", "q_lora_rank", "mtp_num_layers",
                           "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk"):
        v = values[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ToolError("bad_model", f"{key} must be a positive integer, got {v!r}",
                            where=f"{where}.{key}", fix=f"set {key} to a positive integer")
    eps = values["norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ToolError("bad_model", f"norm_epsilon must be a number between 0 and 1, got {eps!r}",
                        where=f"{where}.norm_epsilon", fix="use the model's epsilon (1e-5 or 1e-6 for most)")
    scale = values["moe_router_topk_scaling_factor"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1e6):
        raise ToolError("bad_model", f"moe_router_topk_scaling_factor must be a positive number or null, got {scale!r}",
                        where=f"{where}.moe_router_topk_scaling_factor", fix="DeepSeek-V3 scales by 2.5")
    for key, choices in ENUMS.items():
        if values[key] not in choices:
            raise ToolError("bad_model", f"{key} must be one of {list(choices)}, got {values[key]!r}",
                            where=f"{where}.{key}", fix=f"choose one of {list(choices)}")
    router_rule = _router_rule(values)
    if router_rule:
        what, field, fix, megatrons = router_rule
        raise ToolError("bad_model", f"{what} {REFUSED_WHEN_BUILT}" if megatrons else what, where=f"{where}.{field}",
                        fix=fix)
    factor = values["rope_scaling_factor"]
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise ToolError("bad_model", f"rope_scaling_factor must be a number >= 1 or null, got {factor!r}",
                        where=f"{where}.rope_scaling_factor", fix="Llama 3.1 uses 8, Llama 3.2 uses 32")
    spec = ModelConfig(name=name, **values)
    if not spec.multi_latent_attention and spec.kv_channels is None and spec.hidden_size % spec.num_attention_heads:
        raise ToolError("bad_model", f"hidden_size {spec.hidden_size} is not a multiple of num_attention_heads "
                        f"{spec.num_attention_heads}: the heads would not split it evenly", where=f"{where}.num_attention_heads",
                        fix="use a number of heads that divides hidden_size, or give kv_channels (the head size)")
    if not spec.multi_latent_attention and spec.num_attention_heads % spec.query_groups:
        raise ToolError("bad_model", "num_attention_heads must be a multiple of num_query_groups",
                        where=f"{where}.num_query_groups", fix="use a divisor of num_attention_heads")
    if spec.is_moe:
        if spec.moe_router_topk > spec.num_experts:
            raise ToolError("bad_model", "moe_router_topk exceeds num_experts",
                            where=f"{where}.moe_router_topk", fix="route to at most num_experts experts")
        spec.moe_pattern()  # raises on a malformed pattern
    return spec


# ---- Hugging Face config.json --------------------------------------------------------
def hf_config_json(path: str | Path) -> tuple[dict, Path]:
    """A Hugging Face config.json as read (the file, or the one in a folder), and its path."""
    from .. import files

    p = Path(path)
    if files.kind_of(p) == "folder":
        p = p / "config.json"
    return files.read_json_object(p, where="hf_config", what="Hugging Face config.json", code="bad_model",
                                  unique_keys=True), p


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read a local Hugging Face config.json (Llama, Mixtral, Qwen2/3, Qwen3-MoE, DeepSeek-V3)."""
    where = "hf_config"
    cfg, p = hf_config_json(path)
    check_rope_fields(cfg, where)
    mtype = cfg.get("model_type")
    readers = {"llama": _hf_llama, "mistral": _hf_llama, "mixtral": _hf_llama, "qwen2": _hf_llama,
               "qwen3": _hf_llama, "qwen2_moe": _hf_llama, "qwen3_moe": _hf_llama,
               "deepseek_v3": _hf_deepseek, "deepseek_v2": _hf_deepseek}
    if not isinstance(mtype, str) or mtype not in readers:
        raise ToolError("bad_model", f"model_type {str(mtype)[:80]!r} is not supported", where=f"{where}.model_type",
                        fix=f"supported: {sorted(readers)}; or give the model as field values")
    check_hf_counts(cfg, where)
    try:
        fields = readers[mtype](cfg)
    except KeyError as e:
        raise ToolError("bad_model", f"config.json of model_type {mtype!r} lacks {e.args[0]!r}",
                        where=f"{where}.{e.args[0]}", fix="give a complete Hugging Face config.json") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:  # a field of the wrong type elsewhere
        raise ToolError("bad_model", f"config.json of model_type {mtype!r} holds a value that cannot be read: {e}",
                        where=where, fix="give the Hugging Face config.json as transformers writes it") from None
    # What the config says it is; a folder's name is often a cache hash (snapshots/3f2a...).
    archs = cfg.get("architectures")
    name = (str(cfg.get("_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1]
            or (p.stem if p.name != "config.json" else "")
            or (str(archs[0]) if isinstance(archs, list) and archs else "") or str(mtype))
    return build_spec(str(name), {**fields, "approximations": hf_differences(cfg)}, where=where)


# The router settings of DeepSeek's configs, and what transformers takes where a config leaves one
# out (DeepseekV3's router is always sigmoid scores with expert bias over expert groups): read into
# the model's moe_router_* fields.
DEEPSEEK_ROUTER = {
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy", "n_group": None, "topk_group": None,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": False},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True},
}


def deepseek_router(cfg: dict) -> dict:
    """A DeepSeek config's router settings: its own, transformers' default where it gives none."""
    return {**DEEPSEEK_ROUTER[cfg["model_type"]],
            **{k: cfg[k] for k in DEEPSEEK_ROUTER["deepseek_v2"] if cfg.get(k) is not None}}


READ_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def hf_differences(cfg: dict, weights_only: bool = False) -> list[str]:
    """What a Hugging Face config.json says of its model that the readers here do not carry into
    the model, and so into a plan's costs and a script's flags: each in words. Plan and render
    state them; convert.hf refuses a config with any that changes what the weights mean
    (weights_only: all but a sliding window, which is the same model up to the window's length)."""
    out = []
    rope, params = rope_scaling_type(cfg), rope_parameters(cfg)
    if rope not in ("default", "llama3"):
        factor = f", factor {params['factor']}" if "factor" in params else ""
        out.append(f"RoPE scaling {rope!r}{factor}: read as plain RoPE (Megatron's GPTModel builds Llama 3.1's "
                   "scaling only)")
    elif rope == "llama3":
        off = {k: params.get(k) for k, v in LLAMA3_ROPE_FIXED.items()
               if isinstance(params.get(k, v), (int, float)) and float(params.get(k, v)) != v}
        if off:
            out.append(f"Llama 3 RoPE scaling with {off}: read with the constants Megatron builds in "
                       f"{LLAMA3_ROPE_FIXED}")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        out.append(f"RoPE on a part of each head (partial_rotary_factor {cfg['partial_rotary_factor']}): read as on "
                   "all of it")
    window = cfg.get("sliding_window")
    # Qwen's configs carry a window that is off unless use_sliding_window (transformers' default:
    # off), and then only from layer max_window_layers on; layer_types (newer configs) names each
    # layer's attention
    qwen = str(cfg.get("model_type", "")).startswith("qwen")
    sliding = cfg.get("use_sliding_window", not qwen) and (
        not qwen or (cfg.get("max_window_layers") or 0) < (cfg.get("num_hidden_layers") or 0))
    if isinstance(cfg.get("layer_types"), list):
        sliding = "sliding_attention" in cfg["layer_types"]
    if window and sliding and not weights_only:
        out.append(f"sliding-window attention ({window} tokens): read as full causal attention, the same model "
                   f"for sequences up to {window} tokens")
    if str(cfg.get("hidden_act", "silu")) != "silu":
        out.append(f"MLP activation {str(cfg['hidden_act'])[:40]!r}: read as SwiGLU (SiLU-gated)")
    biased = [k for k in ("mlp_bias", "attention_bias") if cfg.get(k)]
    if str(cfg.get("model_type", "")).startswith("qwen2"):
        biased = [k for k in biased if k != "attention_bias"]   # Qwen2's q/k/v biases are read (add_qkv_bias)
    if biased:
        out.append(f"biases ({', '.join(biased)}): read without them")
    if cfg.get("model_type") in DEEPSEEK_ROUTER:   # the routers read into moe_router_*; others are not
        r = deepseek_router(cfg)
        if r["scoring_func"] not in ("softmax", "sigmoid") or r["topk_method"] not in READ_TOPK_METHODS:
            out.append(f"the router's {str(r['scoring_func'])[:40]} scores with top-k method "
                       f"{str(r['topk_method'])[:40]}: read as softmax scores, greedy top-k")
        topk = cfg.get("num_experts_per_tok") or 1
        if r["scoring_func"] == "sigmoid" and not r["norm_topk_prob"] and topk > 1:
            out.append("sigmoid scores of the chosen experts not renormalised: read renormalised (Megatron's "
                       "sigmoid router renormalises them)")
        if (r["n_group"] or 1) > 1 and r["topk_method"] == "group_limited_greedy":
            out.append("expert groups ranked by their best score (DeepSeek-V2): read as ranked by the sum of "
                       f"their top {max(1, topk // (r['topk_group'] or 1))} (Megatron's group-limited routing)")
        elif (r["n_group"] or 1) > 1 and r["topk_method"] == "noaux_tc" and topk // (r["topk_group"] or 1) != 2:
            out.append("expert groups ranked by the sum of their top 2 scores (DeepSeek-V3): read as the sum of "
                       f"their top {topk // (r['topk_group'] or 1)} (Megatron's group-limited routing)")
    if cfg.get("model_type") == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        out.append("the shared expert's sigmoid gate: read as an ungated shared expert")
    return out


def _hf_llama(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    fields = {
        "family": cfg["model_type"],
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": cfg.get("num_key_value_heads") or heads,
        "kv_channels": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings") or 4096,
        "rotary_base": rope_theta(cfg),
        "rope_scaling_factor": llama3_rope_factor(cfg),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-5)),
        "add_qkv_bias": cfg["model_type"].startswith("qwen2"),
        "qk_layernorm": cfg["model_type"].startswith("qwen3"),
    }
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        fields.update(num_experts=experts, moe_router_topk=cfg["num_experts_per_tok"],
                      # Mixtral's experts are intermediate_size wide (it has no moe_intermediate_size)
                      moe_ffn_hidden_size=(cfg.get("moe_intermediate_size") if cfg["model_type"] != "mixtral"
                                           else None) or cfg["intermediate_size"],
                      # Mixtral always renormalises the chosen experts' weights; Qwen's MoE says so
                      moe_router_pre_softmax=cfg["model_type"] != "mixtral" and not cfg.get("norm_topk_prob", False))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1) or 1
        pattern = [0 if (i in dense_only or (i + 1) % step) else 1 for i in range(fields["num_layers"])]
        if 0 in pattern:
            fields["moe_layer_freq"] = pattern
        if cfg.get("shared_expert_intermediate_size"):
            fields["moe_shared_expert_intermediate_size"] = cfg["shared_expert_intermediate_size"]
    return fields


# The counts a Hugging Face config gives, and the most each may be (those of the model's own fields).
HF_COUNTS = {"num_hidden_layers": 4096, "hidden_size": 1048576, "intermediate_size": 4194304,
             "num_attention_heads": 16384, "num_key_value_heads": 16384, "head_dim": 65536, "vocab_size": 16777216,
             "max_position_embeddings": 16777216, "num_local_experts": 65536, "num_experts": 65536,
             "num_experts_per_tok": 1024, "moe_intermediate_size": 4194304, "decoder_sparse_step": 4096,
             "shared_expert_intermediate_size": 4194304, "sliding_window": 16777216, "n_group": 65536,
             "topk_group": 65536, "n_routed_experts": 65536, "kv_lora_rank": 65536, "q_lora_rank": 65536,
             "qk_nope_head_dim": 65536, "qk_rope_head_dim": 65536, "v_head_dim": 65536, "moe_layer_freq": 4096,
             "max_window_layers": 4096}
# Counts that may be 0 as well (no dense layers first, no shared experts, no MTP layers).
HF_COUNTS_FROM_ZERO = {"first_k_dense_replace": 4096, "n_shared_experts": 1024, "num_nextn_predict_layers": 64}
# The other settings the readers and hf_differences look at, and the JSON types each may have
# (or null): a string where a switch is asked would otherwise read as true, a list as a window.
HF_TYPES = {"norm_topk_prob": bool, "use_sliding_window": bool, "mlp_bias": bool, "attention_bias": bool,
            "tie_word_embeddings": bool, "scoring_func": str, "topk_method": str, "hidden_act": str,
            "routed_scaling_factor": (int, float), "partial_rotary_factor": (int, float)}


def check_hf_counts(cfg: dict, where: str) -> None:
    """Each count the readers compute with is absent, null or a whole number in its range: a
    string, a list, 0 or 1e30 would otherwise fail inside the arithmetic or make a huge list;
    each other setting they read is of its type (HF_TYPES)."""
    for key, kinds in HF_TYPES.items():
        value = cfg.get(key)
        if value is not None and (not isinstance(value, kinds) or (kinds is not bool and isinstance(value, bool))):
            kind = kinds.__name__ if isinstance(kinds, type) else "number"
            raise ToolError("bad_model", f"config.json's {key} must be a {'switch (true or false)' if kinds is bool else kind}"
                            f", got {json.dumps(value)[:80]}", where=f"{where}.{key}",
                            fix="give the Hugging Face config.json as transformers writes it")
    for key, least, most in [(k, 1, m) for k, m in HF_COUNTS.items()] + [(k, 0, m) for k, m in HF_COUNTS_FROM_ZERO.items()]:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most):
            raise ToolError("bad_model", f"config.json's {key} must be a whole number from {least} to {most}, got "
                            f"{json.dumps(value)[:80]}", where=f"{where}.{key}",
                            fix="give the Hugging Face config.json as transformers writes it")


def check_rope_fields(cfg: dict, where: str) -> None:
    """RoPE's settings are an object or absent: anything else (a list, a number) would otherwise be
    read as no scaling at all, and the model trained at the wrong positions."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ToolError("bad_model", f"config.json's {key} is a JSON {type(value).__name__}, not an object",
                            where=f"{where}.{key}", fix=f"give {key} as an object (rope_type, factor, ...) or null, "
                            "as transformers writes it")


def rope_parameters(cfg: dict) -> dict:
    """RoPE's settings of a Hugging Face config: transformers 5 writes them under rope_parameters
    (rope_theta inside), earlier versions as rope_theta and rope_scaling at the top."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        return params
    scaling = cfg.get("rope_scaling")
    return {**(scaling if isinstance(scaling, dict) else {}),
            **({"rope_theta": cfg["rope_theta"]} if "rope_theta" in cfg else {})}


def rope_theta(cfg: dict, where: str = "/hf_config") -> int:
    """The RoPE base as Megatron's --rotary-base takes it (an integer): a base that is not a whole
    number is refused, since int() of it would plan and train another model (its attention over
    far positions moves)."""
    theta = rope_parameters(cfg).get("rope_theta", cfg.get("rope_theta", 10000))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ToolError("bad_model", f"rope_theta {theta!r} is not a positive number", where=where,
                        fix="give the RoPE base the model was trained with")
    if theta != int(theta):
        raise ToolError("bad_model", f"rope_theta {theta!r} is not a whole number, and Megatron's --rotary-base "
                        f"takes only whole numbers: trained as {int(theta)} the model would not be this one "
                        "(its attention over far positions moves)", where=where,
                        fix=f"only a whole RoPE base runs as given; to accept the change, set rope_theta to "
                            f"{round(theta)} in a copy of the config")
    return int(theta)


# Megatron's --use-rope-scaling is Llama 3.1's scheme with these constants built in
# (RotaryEmbedding._apply_scaling in megatron-core 0.19).
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling_type(cfg: dict) -> str:
    p = rope_parameters(cfg)
    return str(p.get("rope_type") or p.get("type") or "default")


def llama3_rope_factor(cfg: dict) -> float | None:
    """The factor of Llama 3.1-style RoPE scaling, or None for plain RoPE (and for schemes
    Megatron's GPTModel does not have, which convert.hf refuses by name)."""
    p = rope_parameters(cfg)
    if rope_scaling_type(cfg) != "llama3":
        return None
    return float(p.get("factor", 8.0))


def _hf_deepseek(cfg: dict) -> dict:
    layers = cfg["num_hidden_layers"]
    dense = cfg.get("first_k_dense_replace", 0)
    fields = {
        "family": "deepseek",
        "num_layers": layers,
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings") or 4096,
        "rotary_base": rope_theta(cfg),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "multi_latent_attention": True,
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_head_dim": cfg["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "kv_channels": cfg["v_head_dim"],
        "num_experts": cfg["n_routed_experts"],
        "moe_router_topk": cfg["num_experts_per_tok"],
        "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
        # transformers: layer i is an MoE layer from first_k_dense_replace on, every moe_layer_freq-th
        "moe_layer_freq": [int(i >= dense and i % (cfg.get("moe_layer_freq") or 1) == 0) for i in range(layers)],
        # MLA's norms of the query and key-value latents (Megatron builds them with --qk-layernorm)
        "qk_layernorm": True,
    }
    r = deepseek_router(cfg)
    if r["scoring_func"] == "sigmoid":   # Megatron normalises the chosen sigmoid scores, as DeepSeek-V3 does
        fields["moe_router_score_function"] = "sigmoid"
    else:   # softmax over all experts, then the top k, renormalised only where the config says so
        fields["moe_router_pre_softmax"] = not r["norm_topk_prob"]
    if r["topk_method"] == "noaux_tc":
        fields["moe_router_enable_expert_bias"] = True
    if (r["n_group"] or 1) > 1 and r["topk_method"] in ("group_limited_greedy", "noaux_tc"):
        fields.update(moe_router_num_groups=r["n_group"], moe_router_group_topk=r["topk_group"])
    # DeepSeek-V2 scales the routed weights only where it does not renormalise them; V3 always
    scaled = cfg["model_type"] == "deepseek_v3" or not r["norm_topk_prob"]
    if r["routed_scaling_factor"] not in (None, 1, 1.0) and scaled:
        fields["moe_router_topk_scaling_factor"] = float(r["routed_scaling_factor"])
    if cfg.get("n_shared_experts"):
        fields["moe_shared_expert_intermediate_size"] = cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    if cfg.get("num_nextn_predict_layers"):
        fields["mtp_num_layers"] = cfg["num_nextn_predict_layers"]
    return fields
