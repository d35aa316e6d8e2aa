# The specdecode bench A/B behind BENCHMARKS "Long documents end to end": /tmp/old is a git worktree of fd7ea36.
cd /work/main
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
    echo "== $v round $i $(date +%T)"
    OMP_NUM_THREADS=2 PYTHONPATH=$P .venv/bin/specdecode bench --prompts docs/bench/long_context/long_prompts.jsonl \
      --proposer lookup --gamma auto --max-new-tokens 128 --no-hf --threads 2 --out /tmp/pf/bench-$v-$i 2>&1 | tail -25
  done
done
