"""Building blocks of the decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

Numerics follow Hugging Face's Llama so float32 logits agree to ~1e-6 and
bf16/fp16 runs round the same way: RMSNorm normalizes in float32 and casts
back before the weight multiply; cos/sin are computed in float32 and cast to
the activation dtype before rotating.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelab.models import cpu_norm
from servelab.models.config import ModelConfig
from servelab.models.linear import Linear
from servelab.models.layer_api import gate_up_slices, set_output_slices


_FUSED_NORM_DTYPES = (torch.float32, torch.float64) if hasattr(torch, "rms_norm") else ()


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))``; x ``[..., hidden]`` any float dtype."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if cpu_norm.usable(x, self.weight):
            # One C call, the same bits as torch.rms_norm (servelab.models.cpu_norm).
            return cpu_norm._rms_norm(x, self.weight, self.eps)
        if x.device.type == "cpu" and dtype in _FUSED_NORM_DTYPES and self.weight.dtype == dtype:
            # One call instead of six: on a CPU torch's rms_norm evaluates the
            # same expression (mean of squares, + eps, rsqrt, two multiplies)
            # bit for bit (tests hold it to the unfused form); the Python
            # dispatch of five small ops per norm was the cost.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # float32 statistics: bf16 squares lose too much before the mean.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM.

    ``gate_up_proj.weight`` is ``[2 * intermediate, hidden]``: rows
    ``[:intermediate]`` are HF's ``gate_proj``, the rest ``up_proj``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, **kw)
        set_output_slices(self.gate_up_proj, gate_up_slices(intermediate_size))  # HF's gate/up_proj (layer_api)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, n = self.gate_up_proj(x), self.intermediate_size
        gate, up = gate_up[..., :n], gate_up[..., n:]  # slices: cheaper than Tensor.split
        if torch.is_grad_enabled():  # autograd needs silu's input: no in-place ops
            return self.down_proj(F.silu(gate) * up)
        # Inference: the same two ops, in place in the GEMM's output (bit-identical).
        # A prefill's [T, intermediate] temporaries are megabytes each; fresh ones
        # cost page faults that took longer than the arithmetic.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (the "NeoX" pairing HF checkpoints use:
    dimension ``i`` rotates with ``i + head_dim/2``, not with ``i + 1``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token ``cos``/``sin`` ``[T, head_dim]``."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """RoPE frequencies for one model; :meth:`forward` gives per-token cos/sin.

    Supported ``rope_type``: ``default`` (``inv_freq = theta^(-2i/d)``) and the
    scaled variants ``linear``, ``dynamic``, ``yarn``, ``llama3``. Scaled
    frequencies and the attention factor (yarn's ``mscale``, applied to both
    cos and sin, hence squared on the scores) come from
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` so they equal HF's
    bit for bit.

    ``dynamic`` (NTK) rescales by the current sequence length once it passes
    ``max_position_embeddings``. HF uses the length of the whole (single)
    batch; here each sequence uses its own ``seq_len``, which is the same for
    one sequence and the only choice that does not make a request's result
    depend on its batch-mates.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type = config.rope_type
        dim = config.head_dim
        # Computed on the CPU whatever the model's device (one result
        # everywhere), copied to a device on first use there.
        if self.rope_type == "default":
            exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            inv_freq, scaling = 1.0 / (config.rope_theta ** exponents), 1.0
        else:
            inv_freq, scaling = self._hf_init(None)
        self.attention_scaling = float(scaling)
        # A plain attribute, not a buffer: derived from the config (never in a
        # checkpoint) and immune to to_empty() after a meta-device build.
        self.inv_freq = inv_freq.float()
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def _hf_init(self, device, seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.config.hf_config is None:
            raise ValueError(f"rope_type={self.rope_type!r} needs ModelConfig.hf_config to compute frequencies")
        init = ROPE_INIT_FUNCTIONS[self.rope_type]
        if seq_len is None:
            return init(self.config.hf_config, device)
        return init(self.config.hf_config, device, seq_len=seq_len)

    def forward(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                query_start_loc: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` in ``dtype`` for int ``positions`` ``[T]``.

        ``seq_lens`` / ``query_start_loc`` (the attention metadata's) are only
        read by ``dynamic`` RoPE, to find each token's sequence length.
        """
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on.setdefault(positions.device, self.inv_freq.to(positions.device))
        if self.rope_type == "dynamic" and seq_lens is not None and query_start_loc is not None:
            inv_freq = self._dynamic_inv_freq(inv_freq, seq_lens, query_start_loc, positions.shape[0])
            freqs = positions.float()[:, None] * inv_freq  # inv_freq per token [T, d/2]
        else:
            freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _dynamic_inv_freq(self, base: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
        per_token = base[None, :].expand(num_tokens, -1).clone()
        limit = self.config.max_position_embeddings
        starts = query_start_loc.tolist()
        for i, seq_len in enumerate(seq_lens.tolist()):
            if seq_len > limit and starts[i + 1] > starts[i]:
                # An int64 tensor, as HF passes max(position_ids) + 1, so the
                # float32 arithmetic inside the init function is the same.
                length = torch.tensor(seq_len, dtype=torch.int64, device=base.device)
                inv_freq, _ = self._hf_init(base.device, seq_len=length)
                per_token[starts[i]:starts[i + 1]] = inv_freq.float()
        return per_token
