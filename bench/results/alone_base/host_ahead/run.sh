#!/bin/bash
# The units of BERT-Large (16 GiB), DenseNet-121 (0.5) and ViT-B/16 (0.6) timed by themselves twice
# over: from an idle GPU and with the host ahead (sitecustomize.py here). From the repository root:
#   OUT=/some/dir bash bench/results/alone_base/host_ahead/run.sh
export PYTHONUNBUFFERED=1
HERE=$PWD/bench/results/alone_base/host_ahead
mkdir -p $OUT/alone
export UM_AHEAD_DIR=$OUT/alone UM_AHEAD_MODE=ahead PYTHONPATH=$HERE:$PWD
python bench/bench_planner.py --budget 16GiB --batch 32 --methods stock,planner --out $OUT/bert 2>&1 | tee $OUT/bert.log
python bench/bench_zoo.py --models densenet --fractions 0.5 --repeats 1 --out $OUT/zoo_densenet 2>&1 | tee $OUT/zoo_densenet.log
python bench/bench_zoo.py --models vit --fractions 0.6 --repeats 1 --out $OUT/zoo_vit 2>&1 | tee $OUT/zoo_vit.log
