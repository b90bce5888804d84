"""First-principles step times: a model's shapes on a piece of hardware, as a roofline per op group.

One step of ``T`` tokens over ``S`` sequences reading ``K`` KV positions (and
``Q`` causal query-key pairs in prefill chunks) costs::

    step_overhead + seq_overhead * S
    + max(GEMM FLOPs / (peak_flops * gemm_eff),  weight bytes / (mem_bw * bw_eff))       linear layers + LM head
    + max(attn FLOPs / (peak_flops * attn_eff),  KV bytes / (mem_bw * bw_eff))           attention

- GEMM FLOPs = 2 * (linear parameters) * T + 2 * hidden * vocab * S (one logits row per sequence);
  the weights are read once per step. With a ``gemm_efficiency_curve`` (``[[rows, efficiency],
  ...]``, measured per shape class: a GEMM of a few rows reaches far less of peak than a big one,
  on a CPU even less than its weight-streaming time says) the decoder layers' GEMMs use the
  efficiency at ``T`` rows and the LM head its own at ``S`` rows, each under its own roofline,
  interpolated in log(rows) between the measured classes and held beyond them.
- Mixture of experts (``ModelShape.num_experts > 0``): the GEMM FLOPs count the parameters a token
  *activates* (attention, dense layers, and per sparse layer its top-k experts, the shared expert and
  the router: :attr:`ModelShape.active_linear_params`); the weight bytes count the experts a step
  *touches*: ``E * (1 - (1 - k / E) ** T)`` distinct experts per sparse layer in expectation under
  uniform routing (:meth:`ModelShape.linear_params_read`), from ``k`` at one token to all ``E``.
- attention FLOPs = 4 * layers * heads * head_dim * (Q + decode reads); KV bytes = K * 2 * layers *
  kv_heads * head_dim * dtype bytes (every position a sequence attends to is read once per step).

The hardware table (``hardware.json`` beside this module) gives peak dense
FLOP/s, memory bandwidth, efficiency per op group and per-step / per-sequence
overheads for A100-80GB, A100-40GB, H100-SXM, H200, L40S, MI300X and ``cpu-measured``
(this machine, one thread), each number with its source; ``_published`` holds the
published serving measurements the GPU entries are compared with (:func:`published_figures`,
``bench/roofline_check.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

from servelab.scheduling.simulator.features import step_features

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# ModelShape's mixture-of-experts fields (0 for a dense model) and the HF config keys they are read from.
_MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
               "num_sparse_layers")
_MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")


@dataclass(frozen=True)
class Hardware:
    """One device of the table (see the module docstring for the fields' meaning)."""

    name: str
    peak_flops: float
    mem_bw: float
    memory_bytes: float
    gemm_efficiency: float
    attention_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    sources: dict
    gemm_efficiency_curve: tuple | None = None

    def gemm_efficiency_at(self, rows: int) -> float:
        """The fraction of ``peak_flops`` a GEMM of ``rows`` rows reaches (``gemm_efficiency`` without a curve)."""
        curve = self.gemm_efficiency_curve
        if not curve:
            return self.gemm_efficiency
        if rows <= curve[0][0]:
            return curve[0][1]
        for (r0, e0), (r1, e1) in zip(curve, curve[1:]):
            if rows <= r1:
                w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return e0 + w * (e1 - e0)
        return curve[-1][1]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Hardware {self.name!r}: {f.name}={value!r}; valid: a finite number >= 0")
        for name in ("peak_flops", "mem_bw", "gemm_efficiency", "attention_efficiency", "bandwidth_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware {self.name!r}: {name} must be > 0")
        curve = self.gemm_efficiency_curve
        if curve is not None:
            points = [tuple(p) for p in curve] if isinstance(curve, (list, tuple)) else None
            if not points or any(len(p) != 2 or not all(isinstance(v, (int, float)) and v > 0 for v in p)
                                 for p in points) or any(a[0] >= b[0] for a, b in zip(points, points[1:])):
                raise ValueError(f"Hardware {self.name!r}: gemm_efficiency_curve={curve!r}; valid: None or "
                                 f"[[rows, efficiency], ...] with rows increasing and every number > 0")
            object.__setattr__(self, "gemm_efficiency_curve", tuple(points))


def hardware_table() -> dict[str, Hardware]:
    """The shipped table, by name."""
    text = (resources.files("servelab.scheduling.simulator") / "hardware.json").read_text()
    raw = json.loads(text)
    return {name: Hardware(name=name, **entry) for name, entry in raw.items() if not name.startswith("_")}


def published_figures() -> list[dict]:
    """Published measurements the table's GPU entries are checked against (``hardware.json``'s
    ``_published``): each names its ``hardware``, ``model`` (a preset), ``dtype``, ``batch``,
    ``context``, ``metric`` (``tpot_p50_s`` or ``decode_tok_s``), ``value`` and ``source``."""
    text = (resources.files("servelab.scheduling.simulator") / "hardware.json").read_text()
    return list(json.loads(text).get("_published", []))


def get_hardware(hardware: str | Hardware) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    table = hardware_table()
    if hardware not in table:
        raise ValueError(f"hardware={hardware!r} is not in the table; valid: {', '.join(table)} (or a Hardware)")
    return table[hardware]


@dataclass(frozen=True)
class ModelShape:
    """What a step's cost depends on: a decoder's shapes and dtype; for a mixture of experts also
    ``num_experts`` routed experts (0: dense) of width ``moe_intermediate_size``, ``experts_per_token``
    of them per token, a ``shared_expert_intermediate_size`` shared expert (0: none), in
    ``num_sparse_layers`` of the layers (the others dense, of width ``intermediate_size``)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_sparse_layers: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name in _MOE_FIELDS else 1
            if f.name == "dtype":
                if value not in DTYPE_BYTES:
                    raise ValueError(f"ModelShape.dtype={value!r}; valid: {', '.join(DTYPE_BYTES)}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ModelShape.{f.name}={value!r}; valid: an int >= {least}")
        if self.num_experts and not (1 <= self.experts_per_token <= self.num_experts
                                     and self.moe_intermediate_size >= 1
                                     and 1 <= self.num_sparse_layers <= self.num_layers):
            raise ValueError(f"ModelShape of {self.num_experts} experts: experts_per_token={self.experts_per_token} "
                             f"must be in [1, {self.num_experts}], moe_intermediate_size="
                             f"{self.moe_intermediate_size} >= 1, num_sparse_layers={self.num_sparse_layers} in "
                             f"[1, {self.num_layers}]")

    @classmethod
    def from_config(cls, config: Any, dtype: str | None = None) -> ModelShape:
        """From a Hugging Face style config (object or dict: ``num_hidden_layers``, ``hidden_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
        ``vocab_size``, ``torch_dtype``) or a preset name (:data:`MODEL_PRESETS`)."""
        if isinstance(config, ModelShape):
            return config
        if isinstance(config, str):
            if config not in MODEL_PRESETS:
                raise ValueError(f"model={config!r} is not a preset; valid: {', '.join(MODEL_PRESETS)} or a config")
            return MODEL_PRESETS[config]
        raw: dict[str, Any] = dict(config) if isinstance(config, dict) else {
            k: getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "intermediate_size",
                                                  "vocab_size", "torch_dtype", "dtype", *_MOE_CONFIG_KEYS)}
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            raw_dtype = dtype or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
            layers = int(raw["num_hidden_layers"])
            return cls(layers, hidden, heads, int(raw.get("num_key_value_heads") or heads),
                       int(raw.get("head_dim") or hidden // heads), int(raw["intermediate_size"]),
                       int(raw["vocab_size"]), str(raw_dtype).replace("torch.", ""), **_moe_shape(raw, layers))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model config {config!r:.120} lacks a shape field: {exc}") from None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear maps (q, k, v, o, gate, up, down; every expert,
        the shared expert and the router of a MoE layer)."""
        return round(self._linear_params(self.num_experts))

    @property
    def active_linear_params(self) -> int:
        """Linear parameters one token multiplies: :attr:`linear_params` with ``experts_per_token``
        routed experts per sparse layer (the GEMM FLOPs are ``2 *`` this ``* T``)."""
        return round(self._linear_params(self.experts_per_token))

    def linear_params_read(self, num_tokens: int) -> int:
        """Linear parameters a step of ``num_tokens`` tokens reads: every dense weight, and per sparse
        layer the expected distinct experts ``E * (1 - (1 - k / E) ** T)`` (uniform routing)."""
        if not self.num_experts:
            return self.linear_params
        e, k = self.num_experts, self.experts_per_token
        return round(self._linear_params(e * (1.0 - (1.0 - k / e) ** max(num_tokens, 1))))

    def _linear_params(self, experts: float) -> float | int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        sparse = self.num_sparse_layers if self.num_experts else 0
        dense = (self.num_layers - sparse) * 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        moe = sparse * (experts * 3 * h * self.moe_intermediate_size + shared + self.num_experts * h)
        return self.num_layers * attn + dense + moe

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


MODEL_PRESETS: dict[str, ModelShape] = {
    # Shapes from the models' published config.json files.
    "llama-3.1-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256, "bfloat16"),
    "llama-3.1-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 128256, "bfloat16"),
    "qwen2.5-7b": ModelShape(28, 3584, 28, 4, 128, 18944, 152064, "bfloat16"),
    "smollm2-135m": ModelShape(30, 576, 9, 3, 64, 1536, 49152, "float32"),
    "mixtral-8x7b": ModelShape(32, 4096, 32, 8, 128, 14336, 32000, "bfloat16", num_experts=8, experts_per_token=2,
                               moe_intermediate_size=14336, num_sparse_layers=32),
    "qwen3-30b-a3b": ModelShape(48, 2048, 32, 4, 128, 6144, 151936, "bfloat16", num_experts=128,
                                experts_per_token=8, moe_intermediate_size=768, num_sparse_layers=48),
}


def _moe_shape(raw: dict[str, Any], num_layers: int) -> dict[str, int]:
    """The MoE fields of a HF config's ``raw`` values (Mixtral: ``num_local_experts``, experts of width
    ``intermediate_size``; Qwen-MoE: ``num_experts``, ``moe_intermediate_size``, sparse layers by
    ``decoder_sparse_step`` minus ``mlp_only_layers``; OLMoE: ``num_experts`` of width
    ``intermediate_size``); ``{}`` for a dense config."""
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if not experts:
        return {}
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return {"num_experts": experts, "experts_per_token": int(raw.get("num_experts_per_tok") or 1),
            "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
            "num_sparse_layers": sparse}


@dataclass(frozen=True)
class RooflineCostModel:
    """Step time of ``model`` on ``hardware`` (see the module docstring); ``time_of(out)`` for the simulator."""

    hardware: Hardware
    model: ModelShape
    tensor_parallel: int = 1

    def step_time(self, num_tokens: int, num_kv_tokens: int, num_seqs: int = 0, num_prefill_tokens: int = 0,
                  attn_pairs: float = 0.0) -> float:
        return sum(self.breakdown(num_tokens, num_kv_tokens, num_seqs, num_prefill_tokens, attn_pairs).values())

    def breakdown(self, num_tokens: int, num_kv_tokens: int, num_seqs: int = 0, num_prefill_tokens: int = 0,
                  attn_pairs: float = 0.0) -> dict[str, float]:
        """Seconds per op group: ``overhead``, ``gemm``, ``attention``."""
        hw, m, tp = self.hardware, self.model, self.tensor_parallel
        seqs = max(num_seqs, 1 if num_tokens else 0)
        flops = hw.peak_flops * tp
        bw = hw.mem_bw * hw.bandwidth_efficiency * tp
        lm_head = m.hidden_size * m.vocab_size
        if not num_tokens:
            gemm = 0.0
        elif hw.gemm_efficiency_curve:  # layers at T rows and the LM head at S rows, each on its own roofline
            layers = 2.0 * m.active_linear_params * num_tokens / (flops * hw.gemm_efficiency_at(num_tokens))
            head = 2.0 * lm_head * seqs / (flops * hw.gemm_efficiency_at(seqs))
            read = m.linear_params_read(num_tokens) * m.dtype_bytes / bw
            gemm = max(layers, read) + max(head, lm_head * m.dtype_bytes / bw)
        else:
            gemm_flops = 2.0 * m.active_linear_params * num_tokens + 2.0 * lm_head * seqs
            read = (m.linear_params_read(num_tokens) + lm_head) * m.dtype_bytes / bw
            gemm = max(gemm_flops / (flops * hw.gemm_efficiency), read)
        decode_reads = max(num_kv_tokens - num_prefill_tokens, 0)
        attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * (attn_pairs + decode_reads)
        attention = max(attn_flops / (flops * hw.attention_efficiency), num_kv_tokens * m.kv_bytes_per_token / bw)
        overhead = (hw.step_overhead_s + hw.seq_overhead_s * seqs) if num_tokens else 0.0
        return {"overhead": overhead, "gemm": gemm, "attention": attention}

    def time_of(self, out) -> float:
        return self.step_time(*step_features(out))

    def decode_throughput(self, batch_size: int, context_len: int) -> float:
        """Output tokens/s of ``batch_size`` sequences decoding at ``context_len`` tokens each."""
        t = self.step_time(batch_size, batch_size * context_len, batch_size)
        return batch_size / t


def roofline_cost_model(hardware: str | Hardware, model: Any, *, dtype: str | None = None,
                        tensor_parallel: int = 1) -> RooflineCostModel:
    """A :class:`RooflineCostModel` for ``model`` (a config, a :class:`ModelShape` or a preset name)
    on ``hardware`` (a table name or a :class:`Hardware`); ``tensor_parallel`` GPUs split FLOPs and
    bytes evenly (communication not modelled)."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel!r}; valid: an int >= 1")
    shape = ModelShape.from_config(model, dtype)
    if dtype is not None and shape.dtype != dtype:
        shape = ModelShape(**{**{f.name: getattr(shape, f.name) for f in fields(shape)}, "dtype": dtype})
    return RooflineCostModel(get_hardware(hardware), shape, tensor_parallel)
