"""The model registry: built-in architectures, dispatch by ``architectures`` /
``model_type``, registering a new one (the loader, ``ModelConfig.from_hf`` and
``build_tiny_model`` all go through it), and the refusals."""

from __future__ import annotations

import pytest

from servelab.models import (
    LlamaForCausalLM,
    ModelConfig,
    available_model_architectures,
    build_tiny_model,
    get_model_architecture,
    load_model,
    register_model_architecture,
    supported_model_types,
    tiny_config,
)
from servelab.models import registry
from servelab.models.config import llama_family_config


@pytest.fixture
def scratch_registry():
    """Registrations made in a test are removed after it."""
    before = dict(registry._REGISTRY._entries)
    yield
    registry._REGISTRY._entries.clear()
    registry._REGISTRY._entries.update(before)


def test_builtins_are_registered_lazily():
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(available_model_architectures())
    assert supported_model_types()[:3] == ["llama", "qwen2", "mistral"]
    assert "gemma3_text" in supported_model_types() and registry.gguf_architectures()[:2] == ["llama", "qwen2"]
    assert get_model_architecture("Qwen2ForCausalLM").model_class is LlamaForCausalLM
    assert get_model_architecture("Gemma3ForCausalLM").model_class.__name__ == "Gemma3ForCausalLM"


def test_dispatch_by_architectures_then_model_type():
    cfg = tiny_config("qwen2")
    assert registry.architecture_for(cfg).name == "Qwen2ForCausalLM"
    cfg.architectures = None
    assert registry.architecture_for(cfg).name == "Qwen2ForCausalLM"
    cfg.architectures = ["LlamaForCausalLM"]  # registered, but for another model_type
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\] is not supported for "
                                         r"model_type='qwen2'; expected one of \['Qwen2ForCausalLM'\]"):
        ModelConfig.from_hf(cfg)


def test_a_registered_architecture_is_what_the_loader_builds(tmp_path, scratch_registry):
    class CountingLlama(LlamaForCausalLM):
        built = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            CountingLlama.built += 1

    seen = []

    def config_from_hf(hf, generation_config=None):
        seen.append(hf.architectures)
        return llama_family_config(hf, generation_config)

    register_model_architecture("CountingLlamaForCausalLM", CountingLlama, config_from_hf, model_type="llama")
    path = build_tiny_model(tmp_path / "m", arch="llama", architectures=["CountingLlamaForCausalLM"])
    model, config = load_model(path)
    assert type(model) is CountingLlama and CountingLlama.built == 1
    assert config.architecture == "CountingLlamaForCausalLM" and seen == [["CountingLlamaForCausalLM"]]
    plain, plain_config = load_model(build_tiny_model(tmp_path / "p", arch="llama"))
    assert type(plain) is LlamaForCausalLM and plain_config.architecture == "LlamaForCausalLM"


def test_registration_errors(scratch_registry):
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already registered; pass override=True"):
        register_model_architecture("LlamaForCausalLM", LlamaForCausalLM, llama_family_config, model_type="llama")
    with pytest.raises(TypeError, match="model_class must be a class"):
        register_model_architecture("X", 3, llama_family_config, model_type="llama")
    with pytest.raises(ValueError, match="not a lazy 'package.module:attribute' reference"):
        register_model_architecture("X", LlamaForCausalLM, "no_colon", model_type="llama")
    with pytest.raises(ValueError, match="model_type='' must be a non-empty string"):
        register_model_architecture("X", LlamaForCausalLM, llama_family_config, model_type="")
    with pytest.raises(ValueError, match=r"unknown model architecture 'Nope'; known: .*'LlamaForCausalLM'"):
        get_model_architecture("Nope")
    register_model_architecture("LlamaForCausalLM", "servelab.models.llama:LlamaForCausalLM",
                                "servelab.models.config:llama_family_config", model_type="llama",
                                gguf_names=("llama",), override=True)
    assert get_model_architecture("LlamaForCausalLM").model_class is LlamaForCausalLM
