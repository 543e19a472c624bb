#!/bin/bash
# The users' Qwen2.5-VL full step, fusion packed alone, one process per variant: glibc's
# malloc or jemalloc (LD_PRELOAD), the output's gradient now or deferred.
# Usage: allocator_ab.sh OUT ROUND JEMALLOC_SO VARIANT... (VARIANT: {glibc,jemalloc}_{now,deferred})
cd "$(dirname "$0")/../../../.."
export PYTHONPATH=$PWD
B=${1:?the output directory}; r=${2:?the round index}; JE=${3:?libjemalloc.so.2}; shift 3
mkdir -p $B
for v in "$@"; do
  flag=""; case $v in *deferred) flag="--defer-output-grad";; esac
  pre=""; case $v in jemalloc*) pre="$JE";; esac
  echo "round $r $v start $(date +%T) $(cat /proc/loadavg)"
  LD_PRELOAD=$pre .venv/bin/python benchmarks/finetune.py --family qwen2_5_vl --train full \
    --samples-per-step 8 --max-image 1024 --steps 1 --rounds 1 --short-warmup \
    --memory-limit-gib 20 --only fusion_packed $flag --out $B/${v}_$r > $B/${v}_$r.log 2>&1
  grep "^fusion_packed" $B/${v}_$r/*_cpu.txt || tail -3 $B/${v}_$r.log
done
echo "done $(date +%T)"
