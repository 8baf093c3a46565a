#!/usr/bin/env bash
# Judge mutants whose code runs only on CUDA by the GPU tests, with mutmut's trampolines in mutants/ (mutmut's own
# selection leaves the `gpu` tests out, so these have "no tests" there). PARALLEL runs at a time, spread over every
# GPU the host has; TEST_PATHs default to the executor's GPU tests.
# usage: tools/mutation/judge_on_gpu.sh NAMES_FILE PARALLEL [TEST_PATH...] > gpu-verdicts.txt
names=$1; parallel=$2; shift 2
tests=("$@"); [ ${#tests[@]} -eq 0 ] && tests=(tests/test_gpu_executor.py tests/test_gpu_layers.py)
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 1 ] || { echo "judge_on_gpu.sh: no GPU" >&2; exit 2; }
export OMP_NUM_THREADS=1 GPUS=$gpus TESTS="${tests[*]}"
judge() {
  name=$1; gpu=$(( $(echo -n "$name" | cksum | cut -d' ' -f1) % GPUS ))
  # shellcheck disable=SC2086  # TESTS is a list of paths
  out=$(cd mutants && CUDA_VISIBLE_DEVICES=$gpu MUTANT_UNDER_TEST="$name" timeout 300 python3 -m pytest -q -x \
        -p no:cacheprovider -m gpu --hypothesis-profile=gpu $TESTS 2>&1)
  rc=$?
  if [ $rc -eq 124 ]; then echo "TIMEOUT  $name"
  elif [ $rc -eq 0 ]; then echo "SURVIVED $name"
  else echo "KILLED   $name | $(echo "$out" | grep -m1 '^FAILED')"; fi
}
export -f judge
xargs -a "$names" -P "$parallel" -I{} bash -c 'judge "$@"' _ {}
