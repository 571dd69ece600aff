"""The catalogs: every model's parameter count against its published total, config.json import."""
from pathlib import Path

import pytest

from megatron_skill.core import catalog
from megatron_skill.core.model import from_hf_config
from megatron_skill.errors import ToolError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
REQUIRED_MODELS = ["llama3-8b", "llama3-70b", "llama3.1-405b", "llama3.2-1b", "llama3.2-3b", "mixtral-8x7b",
                   "mixtral-8x22b", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "nemotron4-340b",
                   "gpt3-175b"]


def test_catalog_has_the_required_models():
    assert set(REQUIRED_MODELS) <= set(catalog.model_names())


@pytest.mark.parametrize("name", REQUIRED_MODELS)
def test_parameter_count_matches_published_total(name):
    m = catalog.get_model(name)
    assert abs(m.total_params() / 1e9 - m.published_params) / m.published_params < 0.005


@pytest.mark.parametrize("name", [n for n in REQUIRED_MODELS if catalog.get_model(n).is_moe])
def test_active_parameters_match_published(name):
    # Published active counts are rounded to whole billions (37B, 22B, 3.3B): 2 % covers the rounding.
    m = catalog.get_model(name)
    assert abs(m.active_params() / 1e9 - m.published_active_params) / m.published_active_params < 0.02


def test_nemotron4_is_dense_and_deepseek_mtp_is_separate():
    assert not catalog.get_model("nemotron4-340b").is_moe
    ds = catalog.get_model("deepseek-v3")
    assert ds.num_moe_layers == 58 and ds.num_dense_layers == 3
    # The 671B excludes the MTP module, which (with its shared embedding and head) is the 14B of the 685B checkpoint.
    assert 11e9 < ds.mtp_params() < 14e9


def test_mixtral_is_not_eight_times_seven_billion():
    m = catalog.get_model("mixtral-8x7b")
    assert m.total_params() < 8 * 7e9 * 0.85  # experts share attention and embeddings


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.2-1b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_hf_config_gives_the_catalog_model(name):
    spec = from_hf_config(FIXTURES / name / "config.json")
    ref = catalog.get_model(name)
    assert spec.total_params() == ref.total_params()
    assert spec.active_params() == ref.active_params()


def test_hf_qwen2_has_qkv_bias():
    spec = from_hf_config(FIXTURES / "qwen2-7b")
    assert spec.add_qkv_bias
    assert abs(spec.total_params() / 1e9 - 7.62) / 7.62 < 0.005  # Qwen2-7B: 7.62B


@pytest.mark.parametrize("fixture,code", [("broken.json", "bad_model"), ("incomplete.json", "bad_model"),
                                           ("unsupported.json", "bad_model"), ("missing.json", "not_found")])
def test_bad_hf_config_is_one_clear_error(fixture, code):
    with pytest.raises(ToolError) as e:
        from_hf_config(FIXTURES / fixture)
    assert e.value.code == code and e.value.fix


def test_gpu_catalog_uses_dense_peaks():
    for key in ("h100-sxm", "h200"):
        g = catalog.get_gpu(key)
        assert g.bf16_dense_tflops == 989  # 1979 is the sparse figure
        assert g.fp8_dense_tflops == 1979
    assert not catalog.get_gpu("a100-80gb").supports_fp8
    assert catalog.get_gpu("gb200").nvlink_domain == 72
    assert set(catalog.gpu_names()) >= {"h100-sxm", "h100-pcie", "h100-nvl", "h200", "a100-40gb",
                                        "a100-80gb", "b200", "gb200"}


def test_unknown_names_suggest_close_matches():
    with pytest.raises(ToolError) as e:
        catalog.get_model("llama3-8")
    assert e.value.code == "not_found" and "llama3-8b" in e.value.fix
