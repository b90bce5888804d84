"""Triton kernels: the fast path of every op whose reference lives in
:mod:`servelab.reference` under the same name and signature.

They run on CUDA GPUs, and on CPU tensors under ``TRITON_INTERPRET=1`` (slow;
used by the tests). Pick between a kernel and its reference through the
backend registry rather than importing one directly when you want a refusal
with a reason instead of an exception.
"""

# --- attention kernels (paged attention, cache write, state merge) ---
# --- end attention kernels ---

# --- sampling and verification kernels ---
# --- end sampling kernels ---
