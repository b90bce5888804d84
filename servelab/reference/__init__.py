"""References: plain PyTorch / plain Python versions of every fast component.

Each reference has the same name and signature as its fast twin (a Triton
kernel in :mod:`servelab.kernels`, or a CPU-side structure such as
:class:`servelab.blocks.BlockPool`). They are written to be obviously correct:
gather the blocks, build masks explicitly, compute in float32 (float64 in
tests), keep state in plain lists and dicts. The reference is the spec; the
tests hold the fast versions to it.
"""

# --- block layer references ---
# --- end block layer references ---

# --- attention references ---
# --- end attention references ---

# --- sampling and verification references ---
# --- end sampling references ---
