"""An import loads into Transformer Engine's layers: the names, shapes and values a GPU run's
model (Megatron's TE layer spec) asks the checkpoint for, checked without Transformer Engine.

Transformer Engine cannot run here: its torch extension has no binary wheel and needs a CUDA
GPU. What decides whether an import loads is not TE's kernels but the names: the parameters TE's
modules register and how Megatron's TE wrappers (megatron/core/extensions/transformer_engine.py)
and its spec functions name and shard them in the checkpoint. So each test imports a tiny Hugging
Face model with the real import-hf, then, in a process of its own, puts a minimal stand-in
`transformer_engine` package on the import path: stand-in classes for TE's Linear,
LayerNormLinear, GroupedLinear, RMSNorm, LayerNorm and DotProductAttention that register exactly
the parameters and extra state TE's real modules register (per TE's source, cited at each class)
and compute nothing; any other TE name Megatron touches is an inert mock, as Megatron's own
fallback makes it. With that package Megatron imports its real TE wrappers and spec provider,
get_gpt_decoder_block_spec(use_transformer_engine=True) builds the layers through
get_gpt_layer_with_transformer_engine_spec (grouped-GEMM experts: TEGroupedMLP), and the model's
own sharded_state_dict names every tensor. The checkpoint is then loaded into that model with
megatron.core.dist_checkpointing.load at its default strictness, as Megatron's load_checkpoint
does, and the loaded values are compared with the Hugging Face tensors.

Not covered: a forward pass or a training step through TE's kernels (a GPU run with TE).
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TE_VERSION = "2.18.0"  # the release whose source the stand-ins follow (NVIDIA/TransformerEngine tag v2.18)


# ---- the stand-in transformer_engine package (used only in the probe's own process) ---------
def _install_stand_in_te():
    import contextlib
    import importlib.machinery
    import types
    from unittest.mock import MagicMock

    import torch

    def empty_extra_state(self):
        # module/base.py TransformerEngineBaseModule.get_extra_state and ops/op.py
        # BasicOperation.get_extra_state: an empty uint8 tensor outside FP8.
        return torch.empty(0, dtype=torch.uint8)

    def restore_extra_state(self, state):
        # Both set_extra_state return at once for None or an empty tensor.
        assert state is None or state.numel() == 0, "only empty extra state is expected from an import"

    class Module(torch.nn.Module):
        """TransformerEngineBaseModule's attributes that Megatron's wrappers read."""

        get_extra_state, set_extra_state = empty_extra_state, restore_extra_state

        def __init__(self, in_features=None, out_features=None, **kw):
            super().__init__()
            self.tp_size = kw.get("tp_size") or 1
            self.parallel_mode = kw.get("parallel_mode")
            self.params_dtype = kw.get("params_dtype") or torch.get_default_dtype()
            self.fp8_meta = {"fp8_checkpoint": False}
            self.fp8 = self.fp8_calibration = self.primary_weights_in_fp8 = False
            if in_features is not None:  # TE divides the split dimension by tp_size itself
                self.in_features = in_features // (self.tp_size if self.parallel_mode == "row" else 1)
                self.out_features = out_features // (self.tp_size if self.parallel_mode == "column" else 1)

        def init_fp8_metadata(self, num_gemms=1):
            # module/base.py: sets the FP8 flags from FP8GlobalStateManager, all off outside FP8.
            self.fp8 = self.fp8_calibration = False

        def _new(self, *shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=self.params_dtype))

    class Linear(Module):
        # module/linear.py Linear.__init__: weight_names ["weight"], bias_names ["bias"] when
        # parameters_split is None (Megatron passes none); without bias, `bias` is a plain
        # empty tensor, not a parameter.
        def __init__(self, in_features, out_features, *, bias=True, **kw):
            super().__init__(in_features, out_features, **kw)
            self.use_bias = bias
            self.register_parameter("weight", self._new(self.out_features, self.in_features))
            if bias:
                self.register_parameter("bias", self._new(self.out_features))
            else:
                self.bias = torch.Tensor()

    class LayerNormLinear(Module):
        # module/layernorm_linear.py LayerNormLinear.__init__: layer_norm_weight, then
        # layer_norm_bias unless normalization is RMSNorm, then weight and bias as Linear.
        def __init__(self, in_features, out_features, eps=1e-5, *, bias=True, normalization="LayerNorm", **kw):
            super().__init__(in_features, out_features, **kw)
            self.use_bias = bias
            self.register_parameter("layer_norm_weight", self._new(in_features))
            if normalization != "RMSNorm":
                self.register_parameter("layer_norm_bias", self._new(in_features))
            else:
                self.layer_norm_bias = None
            self.register_parameter("weight", self._new(self.out_features, self.in_features))
            if bias:
                self.register_parameter("bias", self._new(self.out_features))
            else:
                self.bias = torch.Tensor()

    class GroupedLinear(Module):
        # module/grouped_linear.py GroupedLinear.__init__: weight0..weight{n-1} and, with bias,
        # bias0..bias{n-1}, one per GEMM (the single_grouped_weight packing is opt-in, off).
        def __init__(self, num_gemms, in_features, out_features, *, bias=True, **kw):
            super().__init__(in_features, out_features, **kw)
            self.num_gemms, self.use_bias = num_gemms, bias
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", self._new(self.out_features, self.in_features))
                if bias:
                    self.register_parameter(f"bias{i}", self._new(self.out_features))
                else:
                    setattr(self, f"bias{i}", torch.Tensor())

    class RMSNorm(torch.nn.Module):
        # module/rmsnorm.py RMSNorm is ops/basic/rmsnorm.py's operation: one `weight`, and
        # BasicOperation's extra state.
        get_extra_state, set_extra_state = empty_extra_state, restore_extra_state

        def __init__(self, normalized_shape, eps=1e-5, **kw):
            super().__init__()
            self.register_parameter("weight", torch.nn.Parameter(torch.empty(normalized_shape)))

    class LayerNorm(RMSNorm):
        # module/layernorm.py -> ops/basic/layer_norm.py: `weight` and `bias`.
        def __init__(self, normalized_shape, eps=1e-5, **kw):
            super().__init__(normalized_shape)
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(normalized_shape)))

    class DotProductAttention(Module):
        # attention/dot_product_attention/dot_product_attention.py: a parameter only for the
        # learnable softmax type (softmax_offset), which these models do not use.
        def __init__(self, *args, **kw):
            super().__init__()

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = MagicMock(name=f"{self.__name__}.{name}")
            setattr(self, name, value)
            return value

    class Finder:  # every other transformer_engine submodule: an inert stub
        def find_spec(self, name, path=None, target=None):
            if name.startswith("transformer_engine."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Stub(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    modules = {name: Stub(name) for name in ("transformer_engine", "transformer_engine.pytorch",
                                             "transformer_engine.pytorch.cpu_offload",
                                             "transformer_engine.pytorch.distributed",
                                             "transformer_engine.common", "transformer_engine.common.recipe")}
    for name, module in modules.items():
        module.__path__ = []
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(modules[parent], leaf, module)
    modules["transformer_engine"].__version__ = TE_VERSION
    for cls in (Linear, LayerNormLinear, GroupedLinear, RMSNorm, LayerNorm, DotProductAttention):
        setattr(modules["transformer_engine.pytorch"], cls.__name__, cls)
    # base classes Megatron subclasses at import, and the CPU-offload context its block asks for
    modules["transformer_engine.common.recipe"].DelayedScaling = type("DelayedScaling", (), {})
    modules["transformer_engine.pytorch.distributed"].CudaRNGStatesTracker = type("CudaRNGStatesTracker", (), {})
    modules["transformer_engine.pytorch.cpu_offload"].get_cpu_offload_context = \
        lambda *a, **k: (contextlib.nullcontext(), None)
    sys.meta_path.insert(0, Finder())


def _probe(checkpoint: str, hf_folder: str, grouped_gemm: bool, save_to: str | None = None) -> dict:
    """Build the TE model for the import's model, list what it asks for, load the checkpoint
    into it as Megatron does, and compare the loaded norms and experts with Hugging Face's.
    With save_to, the loaded TE model is then saved as a GPU run of TE's layers saves it (its
    own sharded_state_dict, iteration 1, the tracker beside): what export-hf is given after a
    TE-trained run."""
    _install_stand_in_te()
    sys.path.insert(0, str(ROOT / "tools"))
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.extensions import transformer_engine as megatron_te
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from safetensors.torch import load_file

    from megatron_skill.convert import checkpoint as ckpt
    from megatron_skill.core.model import from_hf_config
    from megatron_skill.runtime import cpu_loop, specs

    assert megatron_te.HAVE_TE

    def te_block_spec(config, opts, vp_stage=None, pp_rank=None):
        config.moe_grouped_gemm = grouped_gemm
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=config.normalization)

    specs.block_spec = te_block_spec  # build_model's TransformerConfig, Megatron's TE layers
    ckpt.init_single_process()
    folder = Path(checkpoint) / "release"
    spec = from_hf_config(hf_folder)
    model = cpu_loop.build_model(ckpt.model_config(spec, padded_vocab=ckpt.padded_vocab_of(folder)))
    layer_types = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("megatron.core.ext")})

    asked = model.sharded_state_dict()
    apply_factories(asked)
    requested = {}
    for v in nested_values(asked):
        if isinstance(v, ShardedTensor):
            requested[v.key] = list(v.global_shape)
        elif isinstance(v, ShardedObject):
            requested[v.unique_key] = None
    from torch.distributed.checkpoint import FileSystemReader
    stored = {k: (list(m.size) if hasattr(m, "size") else None)
              for k, m in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()}

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))  # default strictness
    result = model.load_state_dict(loaded["model"], strict=False)
    state = model.state_dict()
    hf = load_file(str(Path(hf_folder) / "model.safetensors"))
    from megatron_skill.convert.hf import MOE_MLP
    expected = {"decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(spec.num_layers):
        meg, src = f"decoder.layers.{i}.", f"model.layers.{i}."
        expected[meg + "self_attention.linear_qkv.layer_norm_weight"] = hf[src + "input_layernorm.weight"]
        if spec.qk_layernorm:
            expected[meg + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
            expected[meg + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        moe = spec.num_experts and spec.moe_pattern()[i] == 1
        post = hf[src + "post_attention_layernorm.weight"]
        expected[meg + ("pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight")] = post
        if moe:
            _, expert, (g, u, d) = MOE_MLP[spec.family]
            for j in range(spec.num_experts):
                e = src + expert.format(j=j)
                fc1, fc2 = (f"{meg}mlp.experts.linear_fc1.weight{j}", f"{meg}mlp.experts.linear_fc2.weight{j}") \
                    if grouped_gemm else (f"{meg}mlp.experts.local_experts.{j}.linear_fc1.weight",
                                          f"{meg}mlp.experts.local_experts.{j}.linear_fc2.weight")
                expected[fc1] = torch.cat([hf[e + g + ".weight"], hf[e + u + ".weight"]])
                expected[fc2] = hf[e + d + ".weight"]
    differ = {k: (float((state[k] - v).abs().max()) if k in state else "absent") for k, v in expected.items()}
    if save_to:
        (Path(save_to) / "iter_0000001").mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1},
                                str(Path(save_to) / "iter_0000001"))
        (Path(save_to) / "latest_checkpointed_iteration.txt").write_text("1")
    return {"layer_types": layer_types, "requested": requested, "stored": stored,
            "missing_after_load": [k for k in result.missing_keys if not k.endswith("_extra_state")],
            "differ": {k: d for k, d in differ.items() if d != 0.0}, "compared": len(expected)}


if __name__ == "__main__":
    print("PROBE " + json.dumps(_probe(sys.argv[1], sys.argv[2], sys.argv[3] == "grouped",
                                      sys.argv[4] if len(sys.argv) > 4 else None)))
    sys.exit(0)


# ---- the tests ----------------------------------------------------------------------------
from conftest import require_modules  # noqa: E402

require_modules("torch", "megatron.core", "transformers", "safetensors")

import pytest  # noqa: E402
from hf_tiny import tiny  # noqa: E402


def _te_model_reads(tmp_path, cli, family: str, grouped_gemm: bool, save_to: Path | None = None) -> dict:
    tiny(family, tmp_path / "hf")
    if not (tmp_path / "mcore").exists():
        code, out, err = cli("import-hf", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"))
        assert code == 0, (out, err[-2000:])
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "mcore"), str(tmp_path / "hf"),
                           "grouped" if grouped_gemm else "sequential", *([str(save_to)] if save_to else [])],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[len("PROBE "):])


@pytest.mark.parametrize("family,grouped_gemm", [
    ("llama", False),       # dense, QK-norm off
    ("qwen3", False),       # dense, QK-norm on, tied embeddings
    ("mixtral", True),      # MoE in every layer (one layer axis in the checkpoint), grouped GEMM
    ("qwen3_moe", True),    # a dense first layer then MoE (per-layer keys), QK-norm, grouped GEMM
    ("qwen3_moe", False),   # the same experts as TE linears one by one (SequentialMLP)
])
def test_an_import_loads_into_transformer_engine_layers(tmp_path, cli, family, grouped_gemm):
    res = _te_model_reads(tmp_path, cli, family, grouped_gemm)
    built = set(res["layer_types"])
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= built, built
    if family in ("mixtral", "qwen3_moe"):
        assert ("TEColumnParallelGroupedLinear" in built) == grouped_gemm, built
    requested, stored = res["requested"], res["stored"]
    # every name the TE model asks for is in the checkpoint, tensors with the same global shape
    assert sorted(set(requested) - set(stored)) == []
    assert {k: (s, stored[k]) for k, s in requested.items() if s != stored[k]} == {}
    # and the checkpoint holds nothing else but Megatron's common state and, for the local
    # layers' readers, an MoE layer's pre-MLP norm under the local spec's name as well
    extra = sorted(set(stored) - set(requested))
    local_alias = [k for k in extra if k.endswith("mlp.linear_fc1.layer_norm_weight")]
    assert extra == sorted(["common_state/shard_0_1", *local_alias])
    assert all(k.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight") in requested
               for k in local_alias)
    assert bool(local_alias) == (family in ("mixtral", "qwen3_moe"))
    # loaded by Megatron's dist_checkpointing at its default strictness: every TE parameter filled,
    # the fused norms, QK norms, MoE norms and each expert's GEMM with Hugging Face's values
    assert res["missing_after_load"] == []
    assert res["differ"] == {} and res["compared"] >= 5


@pytest.mark.parametrize("family,grouped_gemm", [("qwen3_moe", True), ("mixtral", False)])
def test_a_checkpoint_of_transformer_engine_layers_exports_to_hugging_face(tmp_path, cli, family, grouped_gemm):
    """A GPU run of TE's layers saves an MoE layer's pre-MLP norm only under TE's name
    (pre_mlp_layernorm.weight) and no local alias; export-hf reads it back with the local layers
    and must find it there: the export equals the Hugging Face model it came from, bit for bit."""
    from safetensors.torch import load_file

    trained = tmp_path / "te_run"
    res = _te_model_reads(tmp_path, cli, family, grouped_gemm, save_to=trained)
    assert res["differ"] == {}
    from torch.distributed.checkpoint import FileSystemReader
    stored = FileSystemReader(str(trained / "iter_0000001")).read_metadata().state_dict_metadata
    assert any(k.endswith("pre_mlp_layernorm.weight") for k in stored)
    assert not any(k.endswith("mlp.linear_fc1.layer_norm_weight") and "pre_mlp" not in k
                   for k in stored if family == "mixtral")  # every Mixtral layer is MoE: no fused name
    code, out, err = cli("export-hf", "--checkpoint", str(trained), "--hf-config", str(tmp_path / "hf"),
                         "--output", str(tmp_path / "back"), "--dtype", "fp32")
    assert code == 0, (out, err[-3000:])
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    assert [k for k in original if not bool((back[k] == original[k]).all())] == []
