#!/bin/bash
# fusion packed's Qwen2.5-VL full step (worker, one process each), THP_MEM_ALLOC_ENABLE on/off alternating
cd "$(dirname "$0")/../../../.."; export PYTHONPATH=$PWD; B=${1:?out}; mkdir -p $B
for r in 0 1 2; do
  if [ $((r % 2)) -eq 0 ]; then order="thp plain"; else order="plain thp"; fi
  for v in $order; do
    if [ $v = thp ]; then e="THP_MEM_ALLOC_ENABLE=1"; else e="THP_MEM_ALLOC_ENABLE="; fi
    env $e /usr/bin/time -f "%U %S %R" -o $B/${v}_$r.time .venv/bin/python benchmarks/finetune.py --worker fusion_packed --family qwen2_5_vl --train full --samples-per-step 8 --max-image 1024 --steps 1 --short-warmup --model-dir ${MODEL_DIR:?a saved model: finetune.py save_model} --result $B/${v}_$r.json > $B/${v}_$r.log 2>&1
    python3 -c "import json;d=json.load(open('$B/${v}_$r.json'));print('$r $v', round(d['step_s'][0],2), round(d['step_cpu_s'][0],1), d['peak_memory_bytes']>>20, open('$B/${v}_$r.time').read().strip())"
  done
done
