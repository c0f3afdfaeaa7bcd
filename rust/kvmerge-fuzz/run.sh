#!/usr/bin/env bash
# Runs each fuzz target for a bounded time (default 180 s each), one after
# the other on one core. Inputs are at most 4 KiB, so any single allocation
# over 16 MiB is reported as a finding (-malloc_limit_mb). New inputs go to scratch/<target> (not checked in);
# the checked-in seeds in corpus/<target> are read, never written. Crashes
# land in artifacts/<target>/ and stop the script.
#
#   rust/kvmerge-fuzz/run.sh [seconds] [target...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
secs=${1:-180}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(decode_batch encode_payload merger)
cd "$here/../.."
for t in "${targets[@]}"; do
    mkdir -p "$here/scratch/$t"
    echo "== $t: ${secs}s"
    cargo +nightly fuzz run --fuzz-dir "$here" "$t" "$here/scratch/$t" "$here/corpus/$t" -- \
        -max_total_time="$secs" -malloc_limit_mb=16 -print_final_stats=1
done
