"""The quantization setting, resolved: shorthand table -> :class:`QuantSpec`, the checkpoint's own
metadata, explicit fields win; targets matched against HF module names.

What ``quantization=`` accepts (``Pipeline`` / ``PipelineConfig``):

- ``"auto"`` (default): what the checkpoint holds. A ``.gguf`` file keeps its block formats (each
  linear layer its own type: Q4_1, Q8_0, Q4_K, Q6_K...); a float folder stays float.
- ``None`` / ``"none"``: float weights (a ``.gguf`` is dequantized at load).
- a shorthand of :data:`SHORTHANDS` (``"int8"``, ``"w4a16"``, ``"w4a16-g32"``, ``"q4_0"`` ...):
  online quantization of a float checkpoint, every linear layer but ``lm_head``.
- a dict or :class:`QuantizationConfigArgs`: ``method`` (a shorthand or registered method) *or*
  ``linear`` (a :class:`QuantSpec` / dict), optional ``group_size``, ``moe``, ``targets`` and
  ``ignore``. Fields left out come from the shorthand, then from the checkpoint: ``{"ignore":
  ["lm_head"]}`` on a GGUF file keeps the file's blocks except the head.

Targets and ignore entries match a layer by any of its HF module names
(:func:`servelab.models.layer_api.hf_module_names`: servelab's fused ``qkv_proj`` is
``q_proj``/``k_proj``/``v_proj``): ``"Linear"`` (every linear layer), an exact name or dotted
suffix (``"lm_head"``, ``"model.layers.0.mlp.down_proj"``, ``"q_proj"``), ``"re:<regex>"``
(``re.fullmatch``), or an fnmatch pattern (``"*.layers.1?.mlp.*"``). A fused layer is quantized
whole: a target matching some of its parts and not the others is refused.

Errors (``ValueError`` naming the field): an unknown method or shorthand, ``method`` and ``linear``
both given, a group size that does not divide a layer's width, ``targets`` or ``ignore`` entries
that match nothing, ``moe`` on a model without expert layers, and a spec contradicting the
checkpoint (an online method on a GGUF file's quantized blocks).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from servelab.quantization.methods import available_quant_methods, get_quant_method

__all__ = ["QuantSpec", "QuantizationConfigArgs", "QuantizationPlan", "SHORTHANDS", "parse_setting",
           "resolve_plan", "matches"]

#: shorthand -> the fields it stands for
SHORTHANDS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8"}, "w8a16": {"method": "int8"},
    "w4a16": {"method": "w4a16", "group_size": 128}, "w4a16-g128": {"method": "w4a16", "group_size": 128},
    "w4a16-g32": {"method": "w4a16", "group_size": 32},
    "q8_0": {"method": "Q8_0"}, "q4_0": {"method": "Q4_0"}, "q4_1": {"method": "Q4_1"},
}
_ONLINE_IGNORE = ("lm_head",)


@dataclass(frozen=True)
class QuantSpec:
    """One scheme: a registered ``method`` and its ``group_size`` (``w4a16``: 32 or 128; else None)."""

    method: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in available_quant_methods():
            raise ValueError(f"quantization method={self.method!r} is unknown; valid: "
                             f"{', '.join(available_quant_methods())} or a shorthand ({', '.join(SHORTHANDS)})")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size <= 0):
            raise ValueError(f"quantization group_size={self.group_size!r} is invalid; valid: a positive int "
                             "(32 or 128 for w4a16) or None")
        if self.group_size is not None and self.method != "w4a16":
            raise ValueError(f"quantization group_size={self.group_size} does not apply to method "
                             f"{self.method!r}; only 'w4a16' has groups")


@dataclass(frozen=True)
class QuantizationConfigArgs:
    """The structured setting (every field optional; see the module docs for who fills what)."""

    linear: QuantSpec | None = None
    moe: QuantSpec | None = None
    targets: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None

    def resolve(self) -> QuantizationConfigArgs:
        return self


def _spec(value: Any, where: str) -> QuantSpec:
    if isinstance(value, QuantSpec):
        return value
    if isinstance(value, str):
        return QuantSpec(**_shorthand(value, where))
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"method", "group_size"})
        if unknown:
            raise ValueError(f"quantization {where} has unknown field(s) {unknown}; valid: method, group_size")
        base = _shorthand(value["method"], f"{where}.method") if "method" in value else {}
        return QuantSpec(**{**base, **{k: v for k, v in value.items() if k != "method"}})
    raise TypeError(f"quantization {where}={value!r} is invalid; valid: a method name, a dict or a QuantSpec")


def _shorthand(name: Any, where: str) -> dict[str, Any]:
    if isinstance(name, str) and name.lower() in SHORTHANDS:
        return dict(SHORTHANDS[name.lower()])
    if isinstance(name, str) and name in available_quant_methods():
        return {"method": name}
    raise ValueError(f"quantization {where}={name!r} is unknown; valid: 'auto', None, 'none', a shorthand "
                     f"({', '.join(SHORTHANDS)}) or a registered method ({', '.join(available_quant_methods())})")


def _patterns(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"quantization {where}={value!r} is invalid; valid: a list of non-empty strings (exact "
                         "names, 're:<regex>' or fnmatch patterns)")
    return tuple(value)


def parse_setting(setting: Any) -> QuantizationConfigArgs | None:
    """The user's ``quantization=`` value as :class:`QuantizationConfigArgs`; ``None`` for None /
    ``"none"``; an all-empty args object for ``"auto"`` (everything from the checkpoint)."""
    if setting is None or (isinstance(setting, str) and setting.lower() == "none"):
        return None
    if isinstance(setting, QuantizationPlan):
        return setting.args
    if isinstance(setting, QuantizationConfigArgs):
        return setting
    if isinstance(setting, str):
        return QuantizationConfigArgs() if setting == "auto" else QuantizationConfigArgs(
            linear=_spec(setting, "method"))
    if not isinstance(setting, Mapping):
        raise TypeError(f"quantization={setting!r} is invalid; valid: 'auto', None, 'none', a method name, a dict "
                        "or a QuantizationConfigArgs")
    valid = {"method", "group_size", *(f.name for f in fields(QuantizationConfigArgs))}
    unknown = sorted(set(setting) - valid)
    if unknown:
        raise ValueError(f"quantization has unknown field(s) {unknown}; valid: {', '.join(sorted(valid))}")
    if "method" in setting and "linear" in setting:
        raise ValueError("quantization fields 'method' and 'linear' are mutually exclusive; give the linear "
                         "layers' scheme once")
    if "group_size" in setting and "method" not in setting:
        raise ValueError("quantization field 'group_size' needs 'method' beside it (or put it inside 'linear')")
    linear = None
    if "method" in setting:
        linear = _spec({"method": setting["method"], **({"group_size": setting["group_size"]}
                                                        if "group_size" in setting else {})}, "method")
    elif setting.get("linear") is not None:
        linear = _spec(setting["linear"], "linear")
    moe = None if setting.get("moe") is None else _spec(setting["moe"], "moe")
    return QuantizationConfigArgs(linear, moe, _patterns(setting.get("targets"), "targets"),
                                  _patterns(setting.get("ignore"), "ignore"))


def matches(pattern: str, names: Sequence[str]) -> bool:
    """Whether ``pattern`` (see the module docs) matches any of ``names``."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return any(regex.fullmatch(n) for n in names)
    if any(c in pattern for c in "*?["):
        return any(fnmatch.fnmatchcase(n, pattern) for n in names)
    return any(n == pattern or n.endswith("." + pattern) for n in names)


@dataclass(frozen=True)
class QuantizationPlan:
    """The resolved setting: which method stores each linear layer, and where it came from.

    Attributes:
        source: ``"checkpoint"`` (a GGUF file's blocks), ``"online"`` (quantized at load) or ``"none"``.
        args: the parsed user setting (None for float weights).
        layers: ``(servelab module name, method or None)`` per linear layer (and ``embed_tokens``).
        group_size: the online method's group, if any.
    """

    source: str
    args: QuantizationConfigArgs | None = None
    layers: tuple[tuple[str, str | None], ...] = ()
    group_size: int | None = None
    groups: dict[str, str] = field(default_factory=dict, compare=False)

    def resolve(self) -> QuantizationPlan:
        return self

    def method_of(self, module_name: str) -> str | None:
        return dict(self.layers).get(module_name)

    def __repr__(self) -> str:
        return f"QuantizationPlan(source={self.source!r}, groups={self.groups!r})"


def module_group(name: str) -> str:
    """``"model.layers.3.self_attn.qkv_proj"`` -> ``"model.layers.*.self_attn.qkv_proj"``."""
    return re.sub(r"\.\d+\.", ".*.", name)


def _summarize(layers: Sequence[tuple[str, str | None]], group_size: int | None) -> dict[str, str]:
    counts: dict[str, dict[str, int]] = {}
    for name, method in layers:
        label = "float" if method is None else (f"{method}(g{group_size})" if method == "w4a16" and group_size
                                                else method)
        per = counts.setdefault(module_group(name), {})
        per[label] = per.get(label, 0) + 1
    return {group: ", ".join(label if len(per) == 1 else f"{label} x{n}" for label, n in per.items())
            for group, per in counts.items()}


def resolve_plan(setting: Any, modules: Sequence[tuple[str, Sequence[str], int]],
                 checkpoint: Mapping[str, str] | None = None, *, has_experts: bool = False,
                 other_modules: Sequence[str] = ()) -> QuantizationPlan:
    """Resolve ``setting`` against a model's linear layers and the checkpoint's per-layer formats.

    Args:
        setting: the ``quantization=`` value.
        modules: ``(servelab module name, its HF names, in_features)`` per linear layer.
        checkpoint: servelab module name -> stored format (e.g. ``"Q4_1"``; ``"F32"`` / ``"F16"`` float)
            for a quantized checkpoint, None for a float one.
        has_experts: whether the model has MoE expert layers (``moe`` applies only then).
        other_modules: further module names ``ignore`` may name (a GGUF file's ``model.embed_tokens``).
    """
    args = parse_setting(setting)
    if args is None:
        return QuantizationPlan("none", None, tuple((name, None) for name, _, _ in modules))
    if args.moe is not None and not has_experts:
        raise ValueError(f"quantization moe={args.moe!r} is set, but this model has no expert (MoE) layers")
    stored = {k: v for k, v in (checkpoint or {}).items() if v not in ("F32", "F16")}
    if args.linear is not None and stored:
        kinds = sorted(set(stored.values()))
        if set(kinds) != {args.linear.method}:
            raise ValueError(f"quantization method={args.linear.method!r} contradicts the checkpoint, which stores "
                             f"{', '.join(kinds)} blocks; valid: 'auto' (keep them), None (dequantize to float) or "
                             "a dict with only targets / ignore")
    online = args.linear is not None and not stored
    if args.linear is None and not stored:
        return QuantizationPlan("none", args, tuple((name, None) for name, _, _ in modules))
    targets = args.targets if args.targets is not None else ("Linear",)
    ignore = args.ignore if args.ignore is not None else (_ONLINE_IGNORE if online else ())
    layers = []
    used = {p: False for p in (*targets, *ignore)}
    for name, hf_names, in_features in modules:
        method = _choose(name, hf_names, targets, ignore, used, stored, args.linear if online else None)
        if method is not None and online and args.linear is not None:
            _check_width(name, in_features, args.linear)
        layers.append((name, method))
    for pattern in ignore:
        if any(matches(pattern, [name]) for name in other_modules):
            used[pattern] = True
    defaults = set(_ONLINE_IGNORE) if args.ignore is None else set()
    unused = [p for p, hit in used.items() if not hit and p not in defaults]
    if unused:
        field_name = "targets" if unused[0] in targets else "ignore"
        raise ValueError(f"quantization {field_name} entry {unused[0]!r} matches no linear layer of this model "
                         f"(e.g. {', '.join(repr(n) for _, hf, _ in modules[:2] for n in hf[:1])})")
    group = args.linear.group_size if online and args.linear is not None else None
    if online and args.linear is not None and args.linear.method == "w4a16" and group is None:
        group = 128
    return QuantizationPlan("online" if online else "checkpoint", args, tuple(layers), group,
                            _summarize(layers, group))


def _choose(name: str, hf_names: Sequence[str], targets: Sequence[str], ignore: Sequence[str],
            used: dict[str, bool], stored: Mapping[str, str], spec: QuantSpec | None) -> str | None:
    """The method of one layer (None: float), marking the patterns that matched."""
    for pattern in ignore:
        if matches(pattern, [name, *hf_names]):
            used[pattern] = True
            return None
    hit = False
    for pattern in targets:
        per_part = [matches(pattern, [h]) or matches(pattern, [name]) for h in hf_names]
        if any(per_part):
            used[pattern] = True
            if not all(per_part):
                parts = [h.rpartition(".")[2] for h, ok in zip(hf_names, per_part) if not ok]
                raise ValueError(f"quantization targets entry {pattern!r} matches part of the fused layer {name!r} "
                                 f"but not {', '.join(parts)}; a fused layer is quantized whole: target all its "
                                 "parts or none")
            hit = True
    if not hit:
        return None
    if spec is not None:
        return spec.method
    return stored.get(name)


def _check_width(name: str, in_features: int, spec: QuantSpec) -> None:
    method = get_quant_method(spec.method)
    if spec.method == "w4a16":
        group = spec.group_size or 128
        if in_features % group:
            raise ValueError(f"quantization group_size={group} does not divide {name}'s input width "
                             f"{in_features}; valid: a divisor of every targeted layer's width (e.g. 32)")
    elif in_features % max(method.block_elems, 1):
        raise ValueError(f"quantization method={spec.method!r} needs input widths that are multiples of "
                         f"{method.block_elems}; {name} has {in_features}")
