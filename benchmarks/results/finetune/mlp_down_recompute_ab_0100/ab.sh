#!/bin/bash
# fusion packed's step, one fresh process per measurement, THP on, two checkouts alternating:
# OLD (4cbec9e, the MLP keeps the gated product for w2) and NEW (6570a19, w2 inside the
# recomputed region). Usage: OLD=dir NEW=dir MODEL_DIR=dir ab.sh OUT ROUNDS [worker args...]
# (MODEL_DIR: a model directory finetune.py's save_model wrote for the same family.)
B=${1:?the output directory}; rounds=${2:?rounds}; shift 2
mkdir -p $B
for r in $(seq ${START:-0} $((rounds - 1))); do  # START=2: from round 2 on
  if [ $((r % 2)) = 1 ]; then o="old new"; else o="new old"; fi
  for v in $o; do
    d=$NEW; [ $v = old ] && d=$OLD
    THP_MEM_ALLOC_ENABLE=1 PYTHONPATH=$d python $d/benchmarks/finetune.py --worker fusion_packed \
      --model-dir $MODEL_DIR --result $B/${v}_$r.json "$@" > $B/${v}_$r.log 2>&1
    python3 -c "import json;d=json.load(open('$B/${v}_$r.json'));print('$r $v', [round(x,2) for x in d['step_s']], d['peak_memory_bytes']>>20, d['losses'])"
  done
done
