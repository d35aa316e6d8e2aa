# The A/B behind BENCHMARKS "Prefill of long prompts": /tmp/old is a git worktree of fd7ea36 (before c2f43af).
cd /work/main
for model in smollm2 gemma3-270m; do
  for i in 1 2 3; do
    for v in old new; do
      if [ $v = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
      echo "== $model $v round $i"
      OMP_NUM_THREADS=2 PYTHONPATH=$P .venv/bin/python scripts/prefill_time.py --target $model --lengths 512,1024,2048,4096 --reps 3 --split 2>/dev/null | tail -1
    done
  done
done
