#!/usr/bin/env bash
# Judge the vLLM adapter's mutants by the `vllm` tests, which need vLLM: mutmut's selection leaves them out (and the
# device host has no vLLM), so these mutants have "no tests" or "not checked" there. Each mutant runs in its own
# process with mutmut's trampolines in mutants/ (tools/mutation/generate.py makes them), PARALLEL at a time; each
# pays vLLM's import (about 10 s). The tests run clean first: if they fail unmutated, nothing is judged.
# usage: tools/mutation/judge_with_vllm.sh NAMES_FILE PARALLEL TEST_PATH... > vllm-verdicts.txt
# then: python tools/mutation/tally.py --judged vllm-verdicts.txt. VLLM_PYTHON: the interpreter that has vLLM.
names=$1; parallel=$2; shift 2
export VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python} OMP_NUM_THREADS=1 TESTS="$*"
# The trampolines import mutmut (its pure-Python part only): unpacked from its wheel, whatever vLLM's Python is.
site=$PWD/mutants/.mutmut-site
[ -d "$site/mutmut" ] || "$VLLM_PYTHON" -m zipfile -e .mutwhl/mutmut-3.8.1-py3-none-any.whl "$site" || exit 1
export PYTHONPATH=$site
pytest_in_mutants() {
  (cd mutants && MUTANT_UNDER_TEST="$1" timeout "$2" "$VLLM_PYTHON" -m pytest -q -x -p no:cacheprovider -n 0 \
     -m vllm --hypothesis-profile=mutmut $TESTS 2>&1)
}
judge() {
  out=$(pytest_in_mutants "$1" 300); rc=$?
  if [ $rc -eq 124 ]; then echo "TIMEOUT  $1"
  elif [ $rc -eq 0 ]; then echo "SURVIVED $1"
  elif [ $rc -eq 5 ]; then echo "NO TESTS $1"
  else echo "KILLED   $1 | $(echo "$out" | grep -m1 -E '^(FAILED|ERROR)')"; fi
}
export -f pytest_in_mutants judge
clean=$(pytest_in_mutants "" 900) || { echo "the tests fail unmutated:" >&2; echo "$clean" | tail -n 20 >&2; exit 1; }
xargs -a "$names" -P "$parallel" -I{} bash -c 'judge "$@"' _ {}
