#!/bin/bash
# What NVML counts for MobileNetV3 at 2.75 GiB under the launcher, beside the pool's backed peak.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/nvml
python - <<'PY' > $OUT/nvml/context.txt 2>&1
import torch, pynvml, os
torch.zeros(1, device="cuda")
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
def mine():
    return sum(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid())
print("context after a tensor", mine() >> 20, "MiB")
m = torch.nn.Conv2d(16, 16, 3).cuda().to(torch.bfloat16); torch.backends.cudnn.benchmark = True
with torch.autocast("cuda", dtype=torch.bfloat16):
    m(torch.randn(8, 16, 64, 64, device="cuda")).sum().backward()
a = torch.randn(256, 256, device="cuda"); (a @ a).sum().item()
torch.cuda.synchronize(); print("after cudnn conv and a matmul", mine() >> 20, "MiB; torch reserved", torch.cuda.memory_reserved() >> 20, "MiB")
PY
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 100 > $OUT/nvml/samples.csv &
SMI=$!
timeout 240 python -m um_alloc run --budget 2952790016 --json $OUT/nvml/launcher.json bench/zoo_train.py --model mobilenet --batch 256 --steps 40 --warmup 30 > $OUT/nvml/run.log 2>&1
echo "rc $?" >> $OUT/nvml/run.log
kill $SMI
python - <<'PY' >> $OUT/nvml/run.log
import json, os
d = json.load(open(os.environ["OUT"] + "/nvml/launcher.json"))
def walk(x, p=""):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, p + "." + k)
    elif isinstance(x, (int, float)) and any(s in p for s in ("backed", "reserved", "peak", "highwater", "nvml", "overflow", "stage")):
        print(p, x)
walk(d)
PY
awk -F, '{if ($2>m) m=$2} END {print "nvidia-smi max used MiB", m}' $OUT/nvml/samples.csv >> $OUT/nvml/run.log
tail -40 $OUT/nvml/run.log
