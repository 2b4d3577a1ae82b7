export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(python setup.py build_ext --inplace -q > /tmp/build.log 2>&1 || (tail -30 /tmp/build.log; exit 1)) || exit 1
echo "code: $(cat scratch/HEAD)"
B=5100273664; M=${MODEL:-efficientnet}; K=${K:-22}
A="--model $M --steps 30 --warmup 18"
for round in 1 2; do
  timeout 100 python bench/zoo_train.py $A --checkpoint-layers $K --memory-limit ${B}B --json $OUT/frontier_$round.json 2>&1 | tail -1
  timeout 120 python -m um_alloc run --budget $B --json $OUT/planner_default_$round.report.json scratch/zoo_tb.py $A --json $OUT/planner_default_$round.json 2>&1 | grep -E "planner: (tried|a step)|samples/s" | cut -c1-300
  SCRATCH_MARGIN=536870912 timeout 120 python -m um_alloc run --budget $B --json $OUT/planner_m512_$round.report.json scratch/zoo_tb.py $A --json $OUT/planner_m512_$round.json 2>&1 | grep -E "planner: (tried|a step)|samples/s|scratch" | cut -c1-300
done
