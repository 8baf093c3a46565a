#!/usr/bin/env bash
# Run mutmut on a many-core host (the device tool's machines), within a time bound; leave the results for the
# development machine in $OUT/meta.tgz (every mutant's exit code and the per-test stats).
# usage: tools/mutation/run_on_device.sh SECONDS WORKERS [mutant names... | @file-of-names]
set -u
secs=$1; workers=$2; shift 2
if [ "${1:0:1}" = "@" ]; then mapfile -t names < "${1:1}"; set -- "${names[@]}"; fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
timeout -s KILL "$secs" python3 tools/mutation/run_without_clean_tests.py run --max-children "$workers" "$@" \
    > "$OUT/mut.log" 2>&1
tar czf "$OUT/meta.tgz" $(find mutants -name '*.meta') mutants/mutmut-stats.json
python3 tools/mutation/tally.py --counts-only
