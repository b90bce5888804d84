"""The model registry: which decoder class and config reader serve each Hugging Face architecture.

A checkpoint's ``config.json`` names its architecture (``"architectures":
["Qwen3ForCausalLM"]``) and its ``model_type`` (``"qwen3"``). One
registration ties such a name to the two things servelab needs::

    register_model_architecture("Qwen3ForCausalLM", Qwen3ForCausalLM, qwen3_config_from_hf,
                                model_type="qwen3")

- ``model_class``: the decoder, built as ``model_class(config, attention,
  dtype=..., device=...)`` by :func:`~servelab.models.load_model` (any class
  with :class:`~servelab.models.LlamaForCausalLM`'s ``forward`` /
  ``compute_logits`` interface and its HF-style parameter names).
- ``config_from_hf(hf_config, generation_config) ->``
  :class:`~servelab.models.ModelConfig`: validates the transformers config
  object and refuses what the class does not compute (``ValueError`` naming
  the field and the value).

Both may be lazy ``"package.module:attribute"`` strings, imported on first
use, so the built-in entries below import nothing (and make no import
cycle). :meth:`ModelConfig.from_hf` and the loader dispatch through
:func:`architecture_for`: by the config's ``architectures`` list when it has
one (every name must be registered for the config's ``model_type``), else by
``model_type``. ``model_type`` is also what :func:`~servelab.models.build_tiny_model`
takes as ``arch``; ``gguf_names`` are the ``general.architecture`` values
of GGUF files the architecture accepts.

Adding an architecture is one new model file plus one
``register_model_architecture`` line (the built-ins are listed at the end of
this module).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelab._internal.registry import Registry

__all__ = ["ModelArchitecture", "architecture_for", "available_model_architectures", "get_model_architecture",
           "gguf_architectures", "model_class_for", "register_model_architecture", "supported_model_types"]


def _load(ref: Any) -> Any:
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


@dataclass
class ModelArchitecture:
    """One registered architecture (see the module docstring).

    Attributes:
        name: the HF architecture name (``"LlamaForCausalLM"``).
        model_type: the HF ``model_type`` it is chosen for when a config lists
            no ``architectures`` (``"llama"``).
        gguf_names: GGUF ``general.architecture`` values that load as it.
    """

    name: str
    _model_class: Any
    _config_from_hf: Any
    model_type: str
    gguf_names: tuple[str, ...] = ()

    @property
    def model_class(self) -> type:
        """The decoder class (a lazy entry is imported here)."""
        self._model_class = _load(self._model_class)
        return self._model_class

    @property
    def config_from_hf(self) -> Callable[..., Any]:
        """``(hf_config, generation_config) -> ModelConfig`` (a lazy entry is imported here)."""
        self._config_from_hf = _load(self._config_from_hf)
        return self._config_from_hf


def _check_entry(entry: Any) -> None:
    if not isinstance(entry, ModelArchitecture):
        raise TypeError(f"a model architecture entry must be a ModelArchitecture, got {type(entry).__name__}")


_REGISTRY: Registry[ModelArchitecture] = Registry("model architecture", check=_check_entry)


def _check_ref(name: str, value: Any, what: str) -> None:
    if isinstance(value, str):
        if ":" not in value:
            raise ValueError(f"{name}={value!r} is not a lazy 'package.module:attribute' reference")
    elif not callable(value):
        raise TypeError(f"{name} must be {what} or a 'package.module:attribute' string, got {type(value).__name__}")


def register_model_architecture(hf_architecture_name: str, model_class: type | str,
                                config_from_hf: Callable[..., Any] | str, *, model_type: str,
                                gguf_names: tuple[str, ...] = (), override: bool = False) -> None:
    """Serve checkpoints whose config names ``hf_architecture_name`` with ``model_class``.

    Args:
        hf_architecture_name: as in ``config.json``'s ``architectures``.
        model_class: the decoder class, or a lazy ``"module:Class"`` string.
        config_from_hf: ``(hf_config, generation_config=None) -> ModelConfig``,
            or a lazy string.
        model_type: the HF ``model_type`` of such configs; a config without
            ``architectures`` is served by the first architecture registered
            for its ``model_type``.
        gguf_names: GGUF ``general.architecture`` values that load as this.
        override: replace an existing registration of the same name.

    Raises:
        ValueError: the name is taken (without ``override``) or invalid.
        TypeError: ``model_class`` / ``config_from_hf`` are not callables or lazy strings.
    """
    _check_ref("model_class", model_class, "a class")
    _check_ref("config_from_hf", config_from_hf, "a callable")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type={model_type!r} must be a non-empty string (the HF config's model_type)")
    if isinstance(gguf_names, str) or not all(isinstance(g, str) and g for g in gguf_names):
        raise ValueError(f"gguf_names={gguf_names!r} must be a tuple of non-empty strings")
    _REGISTRY.register(hf_architecture_name, ModelArchitecture(hf_architecture_name, model_class, config_from_hf,
                                                               model_type, tuple(gguf_names)), override=override)


def get_model_architecture(name: str) -> ModelArchitecture:
    """The registration of ``name``; ``ValueError`` listing the known names otherwise."""
    return _REGISTRY.get(name)


def available_model_architectures() -> list[str]:
    """Registered HF architecture names, sorted."""
    return _REGISTRY.available()


def _entries() -> list[ModelArchitecture]:
    return [_REGISTRY.lookup(name) for name in _REGISTRY._entries]  # registration order


def supported_model_types() -> list[str]:
    """``model_type`` values some registered architecture serves, in registration order."""
    return list(dict.fromkeys(entry.model_type for entry in _entries()))


def gguf_architectures() -> list[str]:
    """GGUF ``general.architecture`` values some registered architecture accepts, in registration order."""
    return list(dict.fromkeys(g for entry in _entries() for g in entry.gguf_names))


def architecture_for(hf: Any) -> ModelArchitecture:
    """The registered architecture serving the transformers config ``hf``.

    Raises:
        ValueError: ``model_type`` is not served, or ``architectures`` names an
            architecture not registered for that ``model_type``.
    """
    model_type = getattr(hf, "model_type", None)
    served = [entry for entry in _entries() if entry.model_type == model_type]
    if not served:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: "
                         f"{', '.join(supported_model_types())} (register_model_architecture adds one)")
    names = list(getattr(hf, "architectures", None) or [])
    by_name = {entry.name: entry for entry in served}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"architectures={names!r} is not supported for model_type={model_type!r}; "
                         f"expected one of {sorted(by_name)!r}")
    return by_name[names[0]] if names else served[0]


def model_class_for(config: Any) -> type:
    """The decoder class serving ``config`` (a :class:`~servelab.models.ModelConfig`):
    its ``architecture``'s registration, else the first one for its ``arch`` (model_type)."""
    name = getattr(config, "architecture", None)
    if name:
        return get_model_architecture(name).model_class
    for entry in _entries():
        if entry.model_type == config.arch:
            return entry.model_class
    raise ValueError(f"arch={config.arch!r} is not served by any registered architecture; "
                     f"supported: {', '.join(supported_model_types())}")


# ---- built-in architectures (lazy: nothing is imported until a checkpoint needs it) ----------
_LLAMA = "servelab.models.llama:LlamaForCausalLM"
_LLAMA_CONFIG = "servelab.models.config:llama_family_config"
register_model_architecture("LlamaForCausalLM", _LLAMA, _LLAMA_CONFIG, model_type="llama", gguf_names=("llama",))
register_model_architecture("Qwen2ForCausalLM", _LLAMA, _LLAMA_CONFIG, model_type="qwen2", gguf_names=("qwen2",))
register_model_architecture("MistralForCausalLM", _LLAMA, _LLAMA_CONFIG, model_type="mistral")
register_model_architecture("Qwen3ForCausalLM", "servelab.models.qwen3:Qwen3ForCausalLM",
                            "servelab.models.qwen3:qwen3_config_from_hf", model_type="qwen3")
register_model_architecture("Gemma2ForCausalLM", "servelab.models.gemma2:Gemma2ForCausalLM",
                            "servelab.models.gemma2:gemma2_config_from_hf", model_type="gemma2")
register_model_architecture("Gemma3ForCausalLM", "servelab.models.gemma3:Gemma3ForCausalLM",
                            "servelab.models.gemma3:gemma3_config_from_hf", model_type="gemma3_text",
                            gguf_names=("gemma3",))
# Mixture-of-experts decoders (servelab/moe: routing, experts kernels, EPLB).
register_model_architecture("MixtralForCausalLM", "servelab.models.mixtral:MixtralForCausalLM",
                            "servelab.models.mixtral:mixtral_config_from_hf", model_type="mixtral")
register_model_architecture("Qwen2MoeForCausalLM", "servelab.models.qwen2_moe:Qwen2MoeForCausalLM",
                            "servelab.models.qwen2_moe:qwen2_moe_config_from_hf", model_type="qwen2_moe")
register_model_architecture("Qwen3MoeForCausalLM", "servelab.models.qwen3_moe:Qwen3MoeForCausalLM",
                            "servelab.models.qwen3_moe:qwen3_moe_config_from_hf", model_type="qwen3_moe")
register_model_architecture("OlmoeForCausalLM", "servelab.models.olmoe:OlmoeForCausalLM",
                            "servelab.models.olmoe:olmoe_config_from_hf", model_type="olmoe")
