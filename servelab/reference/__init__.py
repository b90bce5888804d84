"""References: plain PyTorch / plain Python versions of every fast component.

Each reference has the same name and signature as its fast twin (a Triton
kernel in :mod:`servelab.kernels`, or a CPU-side structure such as
:class:`servelab.blocks.BlockPool`). They are written to be obviously correct:
gather the blocks, build masks explicitly, compute in float32 (float64 in
tests), keep state in plain lists and dicts. The reference is the spec; the
tests hold the fast versions to it.
"""

# --- block layer references ---
from servelab.reference.block_pool import BlockPool  # noqa: E402,F401
from servelab.reference.kv_cache_manager import KVCacheManager  # noqa: E402,F401
from servelab.reference.hybrid_kv_cache_manager import HybridKVCacheManager  # noqa: E402,F401
# --- end block layer references ---

# --- attention references ---
from servelab.reference.merge_attn_states import merge_attn_states  # noqa: E402
from servelab.reference.paged_attention import paged_attention  # noqa: E402
from servelab.reference.reshape_and_cache import reshape_and_cache  # noqa: E402
# --- end attention references ---

# --- sampling and verification references ---
from servelab.reference.rejection_sample import rejection_sample  # noqa: E402
from servelab.reference.sampling import top_k_top_p_keep_mask, top_k_top_p_sample  # noqa: E402
from servelab.reference.tree_verify import (  # noqa: E402
    TreeVerifyOutput,
    verify_tree_greedy,
    verify_tree_stochastic,
)
from servelab.reference.typical_acceptance import typical_acceptance_sample  # noqa: E402
# --- end sampling references ---
