#!/usr/bin/env bash
# A draft head for smollm2 made on a borrowed GPU in one go: the target answers as many training prompts as
# ANSWER_SECONDS allow (one make-data process per prompt range, padded batches), then every ARM
# trains a head at once on all of those answers for TRAIN_MINUTES (train-head --max-minutes), and OUT receives
# each head (head.safetensors + config.json), the answers (gzip) and the logs.
#
#   recipes/gpu_head.sh TARGET PROMPTS OUT
#
# TARGET: the target (a .gguf file or a bundled name); PROMPTS: make-data's --prompts (chats in ShareGPT's order,
# so indices match `--prompts sharegpt`). Settings (environment): DEVICE (cuda), DTYPE (the answering target's:
# bfloat16), ANSWER_SECONDS (240),
# TRAIN_MINUTES (3), BATCH (256), MAX_NEW (384), MAX_PROMPT (1536), RANGES (skip:limit per make-data process), SELF
# (questions the target writes itself, make-data --prompts self, answered by one more process in the same time and
# trained on after ShareGPT's answers; 0 = none), ARMS (name=train-head options;...). Tried on the CPU at small
# scale with DEVICE=cpu and small settings.
set -u
TARGET=$1 PROMPTS=$2 OUT=$3
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} ANSWER_SECONDS=${ANSWER_SECONDS:-240} TRAIN_MINUTES=${TRAIN_MINUTES:-3}
BATCH=${BATCH:-256} MAX_NEW=${MAX_NEW:-384} MAX_PROMPT=${MAX_PROMPT:-1536} THREADS=${THREADS:-4} SELF=${SELF:-0}
# ShareGPT's 17,390 prompts in four ranges (each also answers the 32 held-out prompts; duplicates are merged):
# first those no shipped stage saw (13,968 on), then the rest.
RANGES=${RANGES:-"13936:3600 0:4600 4568:4632 9168:4800"}
ARMS=${ARMS:-"lr1e-4=--init shipped --lr 1e-4;lr3e-4=--init shipped --lr 3e-4;long=--init shipped --lr 1e-4 --max-length 2048 --batch-tokens 4096"}
export PYTHONUNBUFFERED=1 SPECDECODE_KERNELS=0 TOKENIZERS_PARALLELISM=false
CLI=(python3 -c 'from specdecode.cli import main; main()')
mkdir -p "$OUT" work/logs
start=$(date +%s)
# the dense float32 copy of the GGUF, built once before the processes that read it start
python3 -c "from specdecode.models.loader import load_model as m; m('$TARGET', dtype='float32', backend='transformers', quantization=None)" \
  >work/logs/load.log 2>&1 || { cat work/logs/load.log; exit 1; }
echo "loaded in $(($(date +%s) - start)) s"
# the 32 prompts train-head holds out, whatever their length, so its figures are on the usual held-out chats
timeout -s INT 120 "${CLI[@]}" make-data --target "$TARGET" --prompts "$PROMPTS" --out work/answers_held --limit 32 \
  --batching padded --batch 8 --max-new-tokens "$MAX_NEW" --device "$DEVICE" --dtype "$DTYPE" --threads "$THREADS" \
  >work/logs/make-data-held.log 2>&1
echo "held-out prompts answered at $(($(date +%s) - start)) s"

i=0
for range in $RANGES; do
  skip=${range%%:*} limit=${range##*:}
  timeout -s INT "$ANSWER_SECONDS" "${CLI[@]}" make-data --target "$TARGET" --prompts "$PROMPTS" --out "work/answers$i" \
    --skip "$skip" --limit "$limit" --batching padded --batch "$BATCH" --max-new-tokens "$MAX_NEW" \
    --max-prompt-tokens "$MAX_PROMPT" --device "$DEVICE" --dtype "$DTYPE" \
    --threads "$THREADS" >"work/logs/make-data$i.log" 2>&1 &
  i=$((i + 1))
done
if [ "$SELF" -gt 0 ]; then  # written and answered in one process: questions first, then their answers
  timeout -s INT "$ANSWER_SECONDS" "${CLI[@]}" make-data --target "$TARGET" --prompts self --limit "$SELF" \
    --out work/self --batching padded --batch "$BATCH" --max-new-tokens "$MAX_NEW" --device "$DEVICE" \
    --dtype "$DTYPE" --threads "$THREADS" >work/logs/make-data-self.log 2>&1 &
fi
wait
echo "answering took $(($(date +%s) - start)) s"; tail -n 2 work/logs/make-data*.log

python3 - <<'EOF'
import json, pathlib
records = {}
for path in sorted(pathlib.Path("work").glob("answers*/answers.jsonl")):
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off when the time ran out
            continue
        records[record["index"]] = record
pathlib.Path("work/merged").mkdir(exist_ok=True)
with open("work/merged/answers.jsonl", "w", encoding="utf-8") as file:
    for index in sorted(records):
        file.write(json.dumps(records[index], ensure_ascii=False) + "\n")
    own = []  # the target's own questions (their own numbering), after ShareGPT's: its held-out 32 stay first
    path = pathlib.Path("work/self/answers.jsonl")
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            own.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    for record in own:
        file.write(json.dumps(record, ensure_ascii=False) + "\n")
tokens = sum(r["tokens"] for r in [*records.values(), *own])
print(f"{len(records)} ShareGPT answers and {len(own)} to the target's own questions, {tokens:,} answer tokens; "
      f"held out (0-31) all there: {all(i in records for i in range(32))}")
EOF
gzip -c work/merged/answers.jsonl >"$OUT/answers.jsonl.gz"

IFS=';' read -ra arms <<<"$ARMS"
for arm in "${arms[@]}"; do
  name=${arm%%=*} options=${arm#*=}
  # shellcheck disable=SC2086
  "${CLI[@]}" train-head --target "$TARGET" --data work/merged/answers.jsonl --out "work/$name" $options --epochs 1 \
    --checkpoint-every 1000000 --cache-gb 0 --device "$DEVICE" --threads "$THREADS" \
    --max-minutes "$TRAIN_MINUTES" >"work/logs/train-$name.log" 2>&1 &
done
wait
for arm in "${arms[@]}"; do
  name=${arm%%=*}
  echo "== $name"; tail -n 8 "work/logs/train-$name.log"
  tar -cf "$OUT/head-$name.tar" -C "work/$name" head.safetensors config.json 2>/dev/null
done
tar -czf "$OUT/logs.tar.gz" -C work logs
echo "total $(($(date +%s) - start)) s"
