#!/usr/bin/env bash
# Judge mutants whose code runs only on CUDA by the GPU tests, with mutmut's trampolines in mutants/ (mutmut's own
# selection leaves the `gpu` tests out, so these have "no tests" there). Two GPUs, PARALLEL runs at a time.
# usage: tools/mutation/judge_on_gpu.sh NAMES_FILE PARALLEL > gpu-verdicts.txt
names=$1; parallel=$2
export OMP_NUM_THREADS=1
judge() {
  name=$1; gpu=$(( $(echo -n "$name" | cksum | cut -d' ' -f1) % 2 ))
  out=$(cd mutants && CUDA_VISIBLE_DEVICES=$gpu MUTANT_UNDER_TEST="$name" timeout 100 python3 -m pytest -q -x \
        -p no:cacheprovider -m gpu --hypothesis-profile=gpu tests/test_gpu_executor.py tests/test_gpu_layers.py 2>&1)
  rc=$?
  if [ $rc -eq 124 ]; then echo "TIMEOUT  $name"
  elif [ $rc -eq 0 ]; then echo "SURVIVED $name"
  else echo "KILLED   $name | $(echo "$out" | grep -m1 '^FAILED')"; fi
}
export -f judge
xargs -a "$names" -P "$parallel" -I{} bash -c 'judge "$@"' _ {}
