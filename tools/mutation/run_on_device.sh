#!/usr/bin/env bash
# Run mutmut on a many-core host (the device tool's machines), within a time bound; leave the results for the
# development machine in $OUT/meta.tgz (every mutant's exit code, and the per-test stats of a whole-suite run).
# usage: tools/mutation/run_on_device.sh SECONDS WORKERS [mutant names or globs... | @file-of-names]
# With KVFSM_MUTMUT_TESTS set (run_without_clean_tests.py: the stats and verdicts come from those test paths alone),
# the stats come back apart, as $OUT/stats.json: a later whole-suite run must not load them (mutmut would see the
# changed selection and reset every verdict in mutants/). The mutants are generated here, WORKERS processes at once.
set -u
secs=$1; workers=$2; shift 2
if [ "${1:-}" != "" ] && [ "${1:0:1}" = "@" ]; then mapfile -t names < "${1:1}"; set -- "${names[@]}"; fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s)
timeout -s KILL "$secs" python3 tools/mutation/run_without_clean_tests.py run --max-children "$workers" "$@" \
    > "$OUT/mut.log" 2>&1
echo "mutmut: exit $? after $(( $(date +%s) - start )) s"
tr '\r' '\n' < "$OUT/mut.log" | grep -a -E "done in|mutations/second|new tests|failed|Error" | tail -n 5
stats=mutants/mutmut-stats.json
if [ -n "${KVFSM_MUTMUT_TESTS:-}" ]; then cp "$stats" "$OUT/stats.json"; stats=; fi
tar czf "$OUT/meta.tgz" $(find mutants -name '*.meta') $stats
python3 tools/mutation/tally.py --counts-only
