"""Triton kernels: the fast path of every op whose reference lives in
:mod:`servelab.reference` under the same name and signature.

They run on CUDA GPUs, and on CPU tensors under ``TRITON_INTERPRET=1`` (slow;
used by the tests). Pick between a kernel and its reference through the
backend registry rather than importing one directly when you want a refusal
with a reason instead of an exception.
"""

# --- attention kernels (paged attention, cache write, state merge) ---
from servelab.kernels.merge_attn_states import merge_attn_states  # noqa: E402
from servelab.kernels.paged_attention import paged_attention  # noqa: E402
from servelab.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
# --- end attention kernels ---

# --- sampling and verification kernels ---
from servelab.kernels.rejection_sample import rejection_sample  # noqa: E402
from servelab.kernels.sampling import top_k_top_p_sample  # noqa: E402
# --- end sampling kernels ---
