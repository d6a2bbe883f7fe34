#!/usr/bin/env bash
# Creates a separate virtual environment holding LMCache's standalone server, the
# peer `kvshare bench` compares against (see docs/design.md §12, "Running the peers").
# LMCache is never a dependency of kvshare: it lives only in this venv.
#
#   bash benchmarks/setup_lmcache.sh            # venv at $KVSHARE_LMCACHE_VENV or the default
#   kvshare bench --lmcache-python "$VENV/bin/python"
#
# torch is pinned exactly: the CPU wheel of that version lies on local disk here; a
# looser pin would pull a multi-GB CUDA build. LMCache is installed with --no-deps
# (its full requirements pull CUDA wheels) plus the modules its import chain needs;
# pip then lists lmcache's other requirements as unmet: expected, the server needs none.
set -euo pipefail

VENV="${KVSHARE_LMCACHE_VENV:-${HOME}/.cache/kvshare/lmcache-venv}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "${VENV}/bin/python" ]]; then
    mkdir -p "$(dirname "${VENV}")"
    "${PYTHON}" -m venv "${VENV}"
fi
PIP=("${VENV}/bin/python" -m pip install --quiet)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "lmcache==0.5.6"
"${PIP[@]}" "numpy<=2.2.6" numba sortedcontainers prometheus_client py-cpuinfo psutil \
    aiohttp requests cachetools pyyaml

# The server module must import; the CUDA extension may fail to (no GPU), which the
# CPU server does not need.
"${VENV}/bin/python" - <<'PY'
import importlib.util
spec = importlib.util.find_spec("lmcache.v1.server")
assert spec is not None, "lmcache.v1.server not importable"
print("lmcache server module:", spec.origin)
PY
echo "KVSHARE_LMCACHE_PYTHON=${VENV}/bin/python"
