#!/usr/bin/env bash
# Sets up .venv for lightning-para. Safe to run again.
#
# Rules (see README):
# * an already-installed torch is kept: the venv sees the system site-packages, and
#   pip is never asked to replace a torch that satisfies torch>=2.6;
# * on a machine without an NVIDIA GPU only the CPU build of torch is installed, never the
#   multi-GB CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

if "$PY" -c "import torch, sys; sys.exit(0 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 6) else 1)" 2>/dev/null; then
    echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing torch==$TORCH_VERSION (CUDA build)"
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
else
    echo "setup: no GPU, installing the CPU build of torch==$TORCH_VERSION"
    # Pinning the "+cpu" local version means only a CPU build can match: a local wheel
    # (pip's find-links, e.g. /opt/wheels) or a mirror of PyTorch's CPU index, with torch's
    # small dependencies (filelock, sympy, ...) from the configured index. Otherwise PyTorch's
    # CPU index itself. Never plain `torch` from PyPI, whose Linux wheel pulls several GB of
    # CUDA libraries.
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || "$PY" -m pip install --quiet "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi

# torch is now satisfied, so resolving the rest cannot swap it for another build.
"$PY" -m pip install --quiet -e ".[dev]"
# litgpt (the LitGPT integration's tests): without its pins (jsonargparse<=4.41, huggingface-hub<1.4), which would
# downgrade transformers 5; its model code needs only torch, lightning, pyyaml and psutil (installed by [dev]).
"$PY" -m pip install --quiet --no-deps "litgpt==0.5.13"
"$PY" -c "import torch, lightning, lightning_para; print('setup: torch', torch.__version__, '| lightning', lightning.__version__, '| lightning_para', lightning_para.__version__)"
