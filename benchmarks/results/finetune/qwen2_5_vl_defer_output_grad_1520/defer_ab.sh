#!/bin/bash
cd /work/main
export PYTHONPATH=$PWD
B=${1:?the output directory}
mkdir -p $B
for r in 0 1; do
  if [ $((r % 2)) -eq 0 ]; then order="now deferred"; else order="deferred now"; fi
  for v in $order; do
    flag=""; [ $v = deferred ] && flag="--defer-output-grad"
    echo "round $r $v start $(date +%T) $(cat /proc/loadavg)"
    .venv/bin/python benchmarks/finetune.py --family qwen2_5_vl --train full --samples-per-step 8 --max-image 1024 --steps 1 --rounds 1 --short-warmup --memory-limit-gib 20 --only fusion_packed $flag --out $B/${v}_$r > $B/${v}_$r.log 2>&1
    grep "^fusion_packed" $B/${v}_$r/*_cpu.txt
  done
done
echo "done $(date +%T)"
