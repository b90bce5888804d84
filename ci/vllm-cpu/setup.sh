#!/usr/bin/env bash
# Build (or reuse) a virtual environment holding vLLM's CPU-side classes beside servelab,
# on a machine without a GPU. Usage:
#
#     bash ci/vllm-cpu/setup.sh VENV_DIR        # ~3-4 min and ~4 GB the first time; seconds when cached
#
# vLLM's wheel depends on a CUDA build of torch, so a plain `pip install vllm` pulls several GB of
# nvidia-* wheels. Instead: torch's CPU wheel first, then vLLM and the ~65 small packages its
# scheduler, sampler and config classes import, all with --no-deps from the pinned list beside this
# script (never resolve dependencies here: they pin a CUDA torch). servelab itself goes in editable,
# also with --no-deps (its dependencies are already satisfied by the list).
#
# What works on CPU with this environment (vllm 0.33.0, torch 2.13.0+cpu):
#   * vllm.v1.core.sched.scheduler.Scheduler, built like vLLM's tests/v1/core/utils.py builds it,
#     with VLLM_TARGET_DEVICE=cpu and a config-only model folder (see
#     servelab/integrations/vllm/tiny_llama_config/);
#   * vllm.v1.core.block_pool.BlockPool and the KV-cache manager;
#   * vllm.v1.sample logits processors on CPU tensors.
# Running vllm.LLM itself needs a GPU build (see bench/gpu/vllm_integration.py).
#
# Reuse: the environment is rebuilt only when the pinned list or this script changed (a stamp file
# inside VENV_DIR records their hash), so CI caches VENV_DIR between runs.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${1:?usage: setup.sh VENV_DIR}
TORCH_SPEC=${SERVELAB_VLLM_TORCH:-torch==2.13.0}

stamp=$(cat "$HERE/requirements-nodeps.txt" "$HERE/setup.sh" | sha256sum | cut -c1-16)-$TORCH_SPEC
if [[ -f "$VENV/.servelab-vllm-stamp" && "$(cat "$VENV/.servelab-vllm-stamp")" == "$stamp" ]]; then
  echo "vllm-cpu: reusing $VENV"
else
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "$TORCH_SPEC"
  "$VENV/bin/pip" install --quiet --no-deps -r "$HERE/requirements-nodeps.txt"
  # the test runner and servelab's plotting dependency (pure Python or CPU-only wheels; resolving
  # their dependencies is safe, and numpy/pillow/packaging are already satisfied by the list)
  "$VENV/bin/pip" install --quiet pytest hypothesis matplotlib
  echo "$stamp" > "$VENV/.servelab-vllm-stamp"
fi
# servelab from this checkout, always (cheap; the checkout may have moved since the cache was built)
"$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
"$VENV/bin/python" - <<'EOF'
import torch, vllm
print("vllm-cpu: torch", torch.__version__, "| vllm", vllm.__version__)
EOF
