#!/usr/bin/env bash
# Creates the venv holding NVIDIA Dynamo's standalone KV indexer
# (`python -m dynamo.indexer`), or reuses a cached one. Prints the venv path on
# its last line; tests find its interpreter through KVMERGE_DYNAMO_PYTHON.
#
# Dynamo pins pydantic (<=2.13.5), so it gets a venv of its own, apart from the
# project venv (.ci/setup.sh). The venv lives outside the checkout, keyed by
# .ci/requirements-dynamo.txt, so that a fresh clone on the same machine (CI)
# reuses it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(sha256sum < "$root/.ci/requirements-dynamo.txt" | cut -c1-12)
venv="${KVMERGE_DYNAMO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmerge/venv-dynamo-$key}"
python="${PYTHON:-python3.11}"

mkdir -p "$(dirname "$venv")"
# Two setups at once (a developer and a helper, say) must not both install.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.kvmerge-complete" ]; then
  echo "setup-dynamo: creating $venv (ai-dynamo-runtime, ~75 MB)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  (cd "$root/.ci" && "$venv/bin/python" -m pip install --quiet -r requirements-dynamo.txt) >&2
  # The indexer's entry point must import (the Rust extension and its Python side).
  "$venv/bin/python" -c 'import dynamo.indexer, dynamo._core' >&2
  touch "$venv/.kvmerge-complete"
fi
flock -u 9
echo "$venv"
