#!/usr/bin/env bash
# Builds .venv-sglang: SGLang (pinned) without its GPU stack, plus kvshare, for the SGLang
# HiCache backend's tests (tests/sglang/).
#
#   scripts/setup_sglang_venv.sh [PYTHON]     # PYTHON: the interpreter to build from
#
# SGLang's own requirements pull CUDA kernels (sglang-kernel, flashinfer, flash-attn, ...)
# that neither build nor run on a CPU machine, so SGLang is installed with --no-deps and
# then only what its HiCache code imports: the storage interface and backend factory
# (sglang.srt.mem_cache.hicache_storage, .storage), the file backend, and the MHA device
# and host KV pools built on the CPU. torch and torchvision are SGLang's pins (local
# wheels on the machines this project builds on; ~100 s into a fresh venv); the other
# packages are pinned where SGLang pins them.
#
# kvshare goes in with its server dependencies (not the `agent` extra, whose torch pin is
# the main venv's): the tests start a real kvshare server in the same venv, in-process or
# as `python -m kvshare.cli serve`, so the suite does not depend on any other environment.
# Re-running the script reuses a venv whose sglang and torch are already the pinned ones.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.14.1"
TORCHVISION_VERSION="0.29.1"
VENV=".venv-sglang"
PYTHON="${1:-python3}"
# What `import sglang.srt.mem_cache...` needs, found by importing it in a bare venv.
SGLANG_IMPORTS=(
    aiohttp "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" dill gguf IPython msgspec
    numpy orjson packaging psutil pybase64 pydantic pyzmq requests "sentencepiece==0.2.1"
    starlette tqdm "transformers==5.19.0"
)

# pip's notes about this machine's unused local index paths, and its complaint that
# SGLang's (deliberately) uninstalled requirements are missing, are noise: keep the rest.
pip_quiet() {
    "$VENV/bin/python" -m pip "$@" 2>&1 | {
        grep -v -e "neither a file nor a directory" -e "^sglang $SGLANG_VERSION requires" \
            -e "dependency resolver does not currently take into account" || true
    }
    return "${PIPESTATUS[0]}"
}

if [ -x "$VENV/bin/python" ] \
    && "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(m.version('sglang') != '$SGLANG_VERSION' or m.version('torch') != '$TORCH_VERSION')" \
        2>/dev/null; then
    echo "$VENV: sglang $SGLANG_VERSION and torch $TORCH_VERSION already installed"
else
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip_quiet install -q --upgrade pip "setuptools>=68"
    pip_quiet install -q --no-deps "sglang==$SGLANG_VERSION"
    pip_quiet install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
    pip_quiet install -q "${SGLANG_IMPORTS[@]}"
fi
# kvshare itself (editable, so the tests run this checkout), its server dependencies and
# the test tools.
PYTHONWARNINGS=ignore pip_quiet install -q --no-build-isolation -e . "pytest>=8" "pytest-timeout>=2.3"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import warnings

warnings.simplefilter("ignore")  # SGLang warns about quantization kernels it lacks on a CPU
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401

import replica_agent.adapters.sglang  # noqa: F401

print(f"sglang {m.version('sglang')}, torch {torch.__version__}, kvshare {m.version('kvshare')}")
PY
