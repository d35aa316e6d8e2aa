# The prefill A/B on the AVX2 Zen 3: /tmp/old is a git worktree of fd7ea36 (before the row blocks, c2f43af).
cd /work/main
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
    echo "== smollm2 $v round $i"
    OMP_NUM_THREADS=2 PYTHONPATH=$P .venv/bin/python scripts/prefill_time.py --target smollm2 --lengths 512,1024,2048,4096 --reps 2 2>/dev/null | tail -1
  done
done
