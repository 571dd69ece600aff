"""Hugging Face Llama-family weights <-> Megatron-Core GPTModel parameters, tensor by tensor.

The families whose decoder layer is attention (q, k, v, o projections, grouped-query heads,
optional q/k/v bias, optional per-head RMSNorm of q and k) and a gated MLP (gate, up, down) or a
mixture of such MLPs behind a softmax router: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3,
Mixtral and Qwen3-MoE. Megatron keeps

  linear_qkv   [groups x (q heads of the group, then k, then v) x head_dim, hidden]: the query
               heads of one key/value group next to their key and value, so that tensor
               parallelism splits whole groups
  linear_fc1   [gate ; up]: SwiGLU's first half goes through SiLU (Megatron's glu chunks in two),
               the same for each expert (mlp.experts.local_experts.<j>) of an MoE layer, whose
               router is mlp.router
  word_embeddings / output_layer   rows padded to Megatron's padded vocabulary with zeros

Both directions are pure functions of one layer's tensors, so a conversion streams layer by
layer and never holds the model. Both use Megatron's rotate-half RoPE convention, which is the
one Hugging Face's Llama weights are stored in (no permutation either way).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}

# What a tokenizer or generation needs beside the weights: copied with them, when present, by
# import-hf and export-hf.
COMPANION_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
HF_LAYER = "model.layers.{i}."
DENSE_MLP = ("mlp.", ("gate_proj", "up_proj", "down_proj"))
# An MoE layer's router and the prefix of expert j, and the expert's gate, up and down names.
MOE_MLP = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
           "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj"))}


def check_config(cfg: dict, where: str = "/hf_model") -> str:
    """The family of a Hugging Face config.json this module converts exactly, or a ToolError that
    says what in it has no Megatron counterpart here."""
    from ..core.model import hf_differences, rope_theta
    from ..errors import ToolError

    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ToolError("bad_model", f"architecture {archs or cfg.get('model_type')!r} has no conversion",
                        where=f"{where}/config.json", fix="supported: " + ", ".join(ARCHITECTURES))
    rope_theta(cfg, f"{where}/config.json")   # a base Megatron's --rotary-base cannot take is refused
    differences = hf_differences(cfg, weights_only=True)
    if differences:
        raise ToolError("bad_model", "the config has what the conversion's Megatron model lacks: "
                        + "; ".join(differences), where=f"{where}/config.json",
                        fix="convert a config of the family's standard layer: plain RoPE or Llama 3.1's (rope_type "
                            "llama3), SiLU-gated MLPs without biases (Qwen2's q/k/v bias too)")
    return ARCHITECTURES[arch]


def _is_moe_layer(model, i: int) -> bool:
    return bool(model.num_experts) and model.moe_pattern()[i] == 1


def _mlp_to_megatron(get, hf: str, i: int, model) -> dict:
    if not _is_moe_layer(model, i):
        prefix, (g, u, d) = DENSE_MLP
        return {"mlp.linear_fc1.weight": _cat(get(f"{hf}{prefix}{g}.weight"), get(f"{hf}{prefix}{u}.weight")),
                "mlp.linear_fc2.weight": get(f"{hf}{prefix}{d}.weight")}
    router, expert, (g, u, d) = MOE_MLP[model.family]
    out = {"mlp.router.weight": get(hf + router)}
    for j in range(model.num_experts):
        e = hf + expert.format(j=j)
        out[f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = _cat(get(f"{e}{g}.weight"), get(f"{e}{u}.weight"))
        out[f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = get(f"{e}{d}.weight")
    return out


def _mlp_to_hf(meg: dict, hf: str, i: int, model) -> dict:
    if not _is_moe_layer(model, i):
        prefix, (g, u, d) = DENSE_MLP
        gate, up = meg["mlp.linear_fc1.weight"].chunk(2, dim=0)
        return {f"{hf}{prefix}{g}.weight": gate, f"{hf}{prefix}{u}.weight": up,
                f"{hf}{prefix}{d}.weight": meg["mlp.linear_fc2.weight"]}
    router, expert, (g, u, d) = MOE_MLP[model.family]
    out = {hf + router: meg["mlp.router.weight"]}
    for j in range(model.num_experts):
        e = hf + expert.format(j=j)
        gate, up = meg[f"mlp.experts.local_experts.{j}.linear_fc1.weight"].chunk(2, dim=0)
        out.update({f"{e}{g}.weight": gate, f"{e}{u}.weight": up,
                    f"{e}{d}.weight": meg[f"mlp.experts.local_experts.{j}.linear_fc2.weight"]})
    return out


def _mlp_names(model, i: int) -> list[str]:
    if not _is_moe_layer(model, i):
        return ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    return ["mlp.router.weight"] + [f"mlp.experts.local_experts.{j}.linear_fc{n}.weight"
                                    for j in range(model.num_experts) for n in (1, 2)]


def _grouped(q, k, v, groups: int):
    """[q ; k ; v] rows (or bias entries) reordered group by group: Megatron's QKV layout."""
    import torch

    per = q.shape[0] // groups
    kv = k.shape[0] // groups
    parts = [t.reshape(groups, n, *t.shape[1:]) for t, n in ((q, per), (k, kv), (v, kv))]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _ungrouped(qkv, groups: int, heads: int, head_dim: int):
    per = heads // groups * head_dim
    g = qkv.reshape(groups, per + 2 * head_dim, *qkv.shape[1:])
    q, k, v = g[:, :per], g[:, per:per + head_dim], g[:, per + head_dim:]
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _pad_rows(t, rows: int):
    import torch

    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def layer_to_megatron(get: Callable[[str], Any], i: int, model) -> dict[str, Any]:
    """Megatron's parameters of decoder layer i (full, unsplit), from get(hf_name)."""
    hf = HF_LAYER.format(i=i)
    groups = model.query_groups
    out = {
        "input_layernorm.weight": get(hf + "input_layernorm.weight"),
        "pre_mlp_layernorm.weight": get(hf + "post_attention_layernorm.weight"),
        "self_attention.linear_qkv.weight": _grouped(get(hf + "self_attn.q_proj.weight"),
                                                     get(hf + "self_attn.k_proj.weight"),
                                                     get(hf + "self_attn.v_proj.weight"), groups),
        "self_attention.linear_proj.weight": get(hf + "self_attn.o_proj.weight"),
        **_mlp_to_megatron(get, hf, i, model),
    }
    if model.add_qkv_bias:
        out["self_attention.linear_qkv.bias"] = _grouped(get(hf + "self_attn.q_proj.bias"),
                                                         get(hf + "self_attn.k_proj.bias"),
                                                         get(hf + "self_attn.v_proj.bias"), groups)
    if model.qk_layernorm:
        out["self_attention.q_layernorm.weight"] = get(hf + "self_attn.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = get(hf + "self_attn.k_norm.weight")
    return out


def layer_to_hf(meg: dict[str, Any], i: int, model) -> dict[str, Any]:
    """The inverse of layer_to_megatron: Hugging Face's tensors of layer i."""
    hf = HF_LAYER.format(i=i)
    heads, groups, d = model.num_attention_heads, model.query_groups, model.head_dim
    q, k, v = _ungrouped(meg["self_attention.linear_qkv.weight"], groups, heads, d)
    out = {hf + "input_layernorm.weight": meg["input_layernorm.weight"],
           hf + "post_attention_layernorm.weight": meg["pre_mlp_layernorm.weight"],
           hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k, hf + "self_attn.v_proj.weight": v,
           hf + "self_attn.o_proj.weight": meg["self_attention.linear_proj.weight"],
           **_mlp_to_hf(meg, hf, i, model)}
    if model.add_qkv_bias:
        qb, kb, vb = _ungrouped(meg["self_attention.linear_qkv.bias"], groups, heads, d)
        out.update({hf + "self_attn.q_proj.bias": qb, hf + "self_attn.k_proj.bias": kb,
                    hf + "self_attn.v_proj.bias": vb})
    if model.qk_layernorm:
        out[hf + "self_attn.q_norm.weight"] = meg["self_attention.q_layernorm.weight"]
        out[hf + "self_attn.k_norm.weight"] = meg["self_attention.k_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _cat(a, b):
    import torch

    return torch.cat([a, b], dim=0)


def to_megatron(get: Callable[[str], Any], model, padded_vocab: int) -> Iterator[tuple[str, Any]]:
    """(Megatron name, full tensor) for the whole model, layer by layer."""
    embed = get("model.embed_tokens.weight")
    yield "embedding.word_embeddings.weight", _pad_rows(embed, padded_vocab)
    for i in range(model.num_layers):
        for name, t in layer_to_megatron(get, i, model).items():
            yield f"decoder.layers.{i}.{name}", t
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    if model.untie_embeddings_and_output_weights:
        yield "output_layer.weight", _pad_rows(get("lm_head.weight"), padded_vocab)


def to_hf(get: Callable[[str], Any], model) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) from Megatron's full parameters, layer by layer; the vocabulary
    padding dropped."""
    vocab = model.vocab_size
    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")[:vocab].contiguous()
    for i in range(model.num_layers):
        prefix = f"decoder.layers.{i}."
        names = layer_to_megatron_names(model, i)
        yield from layer_to_hf({n: get(prefix + n) for n in names}, i, model).items()
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if model.untie_embeddings_and_output_weights:
        yield "lm_head.weight", get("output_layer.weight")[:vocab].contiguous()


def layer_to_megatron_names(model, i: int) -> list[str]:
    names = ["input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_proj.weight", *_mlp_names(model, i)]
    if model.add_qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if model.qk_layernorm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return names


# ---- tensor and pipeline parallel pieces ----------------------------------------------------
# How each Megatron parameter splits over TP ranks: the dimension, or None (replicated).
def tp_dim(name: str) -> int | None:
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                      "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def tp_piece(name: str, full, tp: int, rank: int, model):
    """TP rank `rank`'s piece of a full parameter: QKV by whole key/value groups, FC1's gate and up
    halves each split (so each rank holds its own [gate ; up]), rows or columns otherwise."""
    import torch

    dim = tp_dim(name)
    if dim is None or tp == 1:
        return full
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        g = full.reshape(model.query_groups, -1, *full.shape[1:])
        return g.chunk(tp, dim=0)[rank].reshape(-1, *full.shape[1:]).contiguous()
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).contiguous()
    return full.chunk(tp, dim=dim)[rank].contiguous()


def tp_join(name: str, pieces: list, model):
    """The inverse of tp_piece over all ranks' pieces, in rank order."""
    import torch

    dim = tp_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return torch.cat(pieces, dim=0)
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=dim)


EXPERT = ".mlp.experts.local_experts."


def stage_name(name: str, first_layer: int, first_expert: int = 0) -> str:
    """A full-model parameter name as the rank names it whose pipeline stage starts at layer
    first_layer and whose expert-parallel group holds experts from first_expert on."""
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers."):].split(".", 1)
    name = f"decoder.layers.{int(i) - first_layer}.{rest}"
    if EXPERT in name:
        head, tail = name.split(EXPERT)
        j, rest = tail.split(".", 1)
        name = f"{head}{EXPERT}{int(j) - first_expert}.{rest}"
    return name


# ---- reading a Hugging Face folder, and filling a model's own piece --------------------------
def weight_map(folder) -> dict[str, str] | None:
    """model.safetensors.index.json's weight_map (tensor name: shard file), or None for a folder
    with one model.safetensors; a ToolError for a folder with neither or a damaged index."""
    from pathlib import Path

    from .. import files
    from ..errors import ToolError

    index = Path(folder) / "model.safetensors.index.json"
    if files.kind_of(index) == "missing":
        if files.kind_of(Path(folder) / "model.safetensors") != "missing":
            return None
        raise ToolError("not_found", f"no model.safetensors or model.safetensors.index.json in {folder}",
                        where="/hf_model", fix="give a local Hugging Face model folder saved with safetensors "
                        "(a .bin-only folder: load and save it again with safe_serialization)")
    mapping = files.read_json_object(index, "/hf_model", "safetensors index", code="bad_model").get("weight_map")
    if not isinstance(mapping, dict) or not all(isinstance(v, str) and v for v in mapping.values()):
        raise ToolError("bad_model", f"{index} is not a safetensors index (no weight_map of file names)",
                        where="/hf_model", fix="give the folder as saved by save_pretrained")
    return mapping


def hf_reader(folder) -> Callable[[str], Any]:
    """get(name) for a local Hugging Face folder's safetensors (one file, or shards named by
    model.safetensors.index.json), each tensor read when asked. The file is opened for each read
    and closed after it: its memory-mapped pages leave with it, so nothing more is held than the
    tensor being converted."""
    from pathlib import Path

    from safetensors import safe_open

    from ..errors import ToolError

    folder = Path(folder)
    where = weight_map(folder)

    def get(name: str):
        file = where.get(name) if where is not None else "model.safetensors"
        if file is None:
            raise ToolError("bad_model", f"the checkpoint has no tensor {name}", where="/hf_model",
                            fix="the weights do not match config.json's architecture")
        path = folder / file
        if not path.is_file():
            raise ToolError("not_found", f"shard {file} of {folder} is missing", where="/hf_model",
                            fix="download every shard the index names")
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(name)

    return get


def fill(model, get: Callable[[str], Any], spec, padded_vocab: int, tp: int, tp_rank: int, first_layer: int,
         num_local_layers: int, first_expert: int = 0, progress: Callable[[int], None] | None = None) -> None:
    """Copy this rank's piece of the Hugging Face weights into a Megatron GPTModel built for its TP
    rank, pipeline stage and expert-parallel rank, layer by layer (only the layers of this stage
    are read, and of an MoE layer only this rank's experts are kept)."""
    import torch

    own = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    done = set()

    def put(full_name: str, full):
        name = stage_name(full_name, first_layer, first_expert)
        if name not in own:
            return
        piece = tp_piece(full_name, full, tp, tp_rank, spec)
        if tuple(piece.shape) != tuple(own[name].shape):
            from ..errors import ToolError
            raise ToolError("bad_model", f"{full_name}: the checkpoint gives {tuple(piece.shape)}, the model wants "
                            f"{tuple(own[name].shape)}", where="/hf_model", fix="config.json and the weights disagree")
        with torch.no_grad():
            own[name].copy_(piece.to(own[name].dtype))
        done.add(name)

    if "embedding.word_embeddings.weight" in own or "output_layer.weight" in own:
        embed = _pad_rows(get("model.embed_tokens.weight"), padded_vocab)
        put("embedding.word_embeddings.weight", embed)
        if not spec.untie_embeddings_and_output_weights:
            put("output_layer.weight", embed)  # the last stage's copy of the tied weights
    for i in range(first_layer, first_layer + num_local_layers):
        for name, t in layer_to_megatron(get, i, spec).items():
            put(f"decoder.layers.{i}.{name}", t)
        if progress is not None:
            progress(i)
    if "decoder.final_layernorm.weight" in own:
        put("decoder.final_layernorm.weight", get("model.norm.weight"))
    if spec.untie_embeddings_and_output_weights and "output_layer.weight" in own:
        put("output_layer.weight", _pad_rows(get("lm_head.weight"), padded_vocab))
    left = sorted(set(own) - done)
    if left:
        from ..errors import ToolError
        raise ToolError("bad_model", f"no Hugging Face tensor for {left[:3]}{' ...' if len(left) > 3 else ''}",
                        where="/hf_model", fix="the architecture is not one of " + ", ".join(ARCHITECTURES))


# ---- what a folder must hold, checked from the safetensors headers alone ---------------------
def megatron_shapes(model, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every full Megatron parameter of the model and its shape (the layout-free names)."""
    h, d = model.hidden_size, model.head_dim
    heads, groups = model.num_attention_heads, model.query_groups
    ffn, expert_ffn = model.ffn_hidden_size, model.expert_ffn if model.num_experts else 0
    out = {"embedding.word_embeddings.weight": (padded_vocab, h), "decoder.final_layernorm.weight": (h,)}
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (padded_vocab, h)
    per = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
           "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
           "self_attention.linear_qkv.bias": ((heads + 2 * groups) * d,),
           "self_attention.linear_proj.weight": (h, heads * d),
           "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
           "mlp.linear_fc1.weight": (2 * ffn, h), "mlp.linear_fc2.weight": (h, ffn),
           "mlp.router.weight": (model.num_experts or 0, h)}
    for i in range(model.num_layers):
        for name in layer_to_megatron_names(model, i):
            if ".local_experts." in name:
                shape = (2 * expert_ffn, h) if name.endswith("fc1.weight") else (h, expert_ffn)
            else:
                shape = per[name]
            out[f"decoder.layers.{i}.{name}"] = shape
    return out


def hf_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face folder of this model holds, and its shape: the Megatron
    shapes sent through to_hf on the meta device (one naming rule, not two)."""
    import torch

    meta = {k: torch.empty(s, device="meta") for k, s in megatron_shapes(model, model.vocab_size).items()}
    return {k: tuple(v.shape) for k, v in to_hf(meta.__getitem__, model)}


def check_weights(folder, model) -> dict[str, Any]:
    """Every tensor the conversion reads is in the folder's safetensors with the shape config.json
    implies; the shards the index names exist. Reads headers only. Returns the files, their
    bytes, the tensors' dtype and the names the conversion leaves unused."""
    from pathlib import Path

    from safetensors import safe_open

    from ..errors import ToolError

    folder = Path(folder)
    index = weight_map(folder)
    files = ["model.safetensors"] if index is None else sorted(set(index.values()))
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ToolError("not_found", f"{len(missing)} shard(s) the index names are missing (or not regular "
                        f"files): {missing[:3]}",
                        where="/hf_model", fix="copy every shard of the checkpoint into the folder")
    have: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(str(folder / f), "pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    have[name] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ToolError("bad_model", f"{f} is not a readable safetensors file: {e}", where="/hf_model",
                            fix="download the shard again") from None
    want = hf_shapes(model)
    absent = [n for n in want if n not in have]
    if absent:
        raise ToolError("bad_model", f"config.json's model needs {len(absent)} tensor(s) the weights lack, "
                        f"e.g. {absent[:3]}", where="/hf_model",
                        fix="the weights are not this config's model (or not a supported architecture)")
    wrong = [(n, want[n], have[n][0]) for n in want if have[n][0] != want[n]]
    if wrong:
        n, w, g = wrong[0]
        raise ToolError("bad_model", f"{len(wrong)} tensor(s) disagree with config.json, e.g. {n}: the weights "
                        f"hold {g}, config.json implies {w}", where="/hf_model",
                        fix="give the config.json that came with these weights")
    dtypes = sorted({have[n][1] for n in want})
    return {"files": files, "bytes": sum((folder / f).stat().st_size for f in files), "dtypes": dtypes,
            "tensors": len(want), "unused": sorted(set(have) - set(want))}


# ---- a config.json for a model that did not come from one -----------------------------------
def hf_config_for(model) -> dict[str, Any]:
    """A Hugging Face config.json that transformers builds the model from: Qwen3(-MoE) for
    QK-norm, Qwen2 for QKV bias, Mixtral for MoE, Llama otherwise. A model no family holds
    (LayerNorm, GELU, learned positions, linear biases, MLA) is a ToolError."""
    from ..errors import ToolError

    if (model.activation != "swiglu" or model.normalization != "RMSNorm" or model.position_embedding_type != "rope"
            or model.add_bias_linear or model.multi_latent_attention or model.moe_shared_expert_intermediate_size
            or (model.add_qkv_bias and (model.qk_layernorm or model.num_experts))):
        raise ToolError("bad_model", f"{model.name} has no Hugging Face family here (SwiGLU, RMSNorm, RoPE, no "
                        "linear biases but Qwen2's QKV bias, no MLA or shared experts)", where="/model",
                        fix="export models of the Llama, Qwen2, Qwen3, Mixtral or Qwen3-MoE shape")
    moe = bool(model.num_experts)
    if moe and model.qk_layernorm:
        arch, mtype = "Qwen3MoeForCausalLM", "qwen3_moe"
    elif moe:
        if model.moe_router_pre_softmax or 0 in model.moe_pattern():
            raise ToolError("bad_model", "a Mixtral-shaped model renormalises its top-k and has experts in "
                            "every layer", where="/model", fix="give the model QK-norm to export it as Qwen3-MoE")
        arch, mtype = "MixtralForCausalLM", "mixtral"
    elif model.qk_layernorm:
        arch, mtype = "Qwen3ForCausalLM", "qwen3"
    elif model.add_qkv_bias:
        arch, mtype = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, mtype = "LlamaForCausalLM", "llama"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    if model.rope_scaling_factor:
        from ..core.model import LLAMA3_ROPE_FIXED
        rope = {**rope, "rope_type": "llama3", "factor": float(model.rope_scaling_factor), **LLAMA3_ROPE_FIXED}
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": mtype, "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups, "head_dim": model.head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        # both spellings: transformers 5 reads rope_parameters, earlier versions rope_theta / rope_scaling
        "rope_parameters": rope, "rope_theta": rope["rope_theta"],
        **({"rope_scaling": rope} if model.rope_scaling_factor else {}),
        "attention_bias": model.add_qkv_bias, "mlp_bias": False,
    }
    if moe:
        cfg.update(num_local_experts=model.num_experts, num_experts=model.num_experts,
                   num_experts_per_tok=model.moe_router_topk)
        if mtype == "mixtral":
            cfg["intermediate_size"] = model.expert_ffn
        else:
            cfg.update(moe_intermediate_size=model.expert_ffn, norm_topk_prob=not model.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(model.moe_pattern()) if not m])
    return cfg
