#!/usr/bin/env bash
# The GPU checks, as one script for a lent device machine (CUDA, PyTorch, no vLLM, no network):
# the KV path's and the pool's CUDA branches under test, then benchmarks/kv_path_cuda.py and
# benchmarks/pool_cuda.py at Llama-3.1-8B's KV geometry. Wheels the machine lacks (msgspec) travel
# in .whl/ (see benchmarks/RESULTS.md).
#   OUT=/tmp/out bash benchmarks/gpu_check.sh          # everything
#   OUT=/tmp/out bash benchmarks/gpu_check.sh pool     # the tests and the pool's benchmark only
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD
elif [ -d .whl/msgspec-src ]; then  # no wheel for this Python: build it (benchmarks/gpu_build_msgspec.sh)
    bash benchmarks/gpu_build_msgspec.sh || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/device.txt"
df -h /dev/shm | tail -1 | sed 's/^/shm /' | tee -a "$OUT/device.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/spine/test_kv_layouts.py tests/spine/test_connector_datapath.py \
    tests/spine/test_pool_connector.py 2>&1 | tee "$OUT/tests.log" | tail -15
timeout 200 python3 -m benchmarks.pool_cuda --out "$OUT/pool_8k.json" 2>&1 | tee "$OUT/pool_8k.log"
timeout 200 python3 -m benchmarks.pool_cuda --layout kv_first --tokens 32768 --repeats 2 --out "$OUT/pool_32k.json" \
    2>&1 | tee "$OUT/pool_32k.log"
[ "${1:-all}" = pool ] && exit 0
timeout 240 python3 -m benchmarks.kv_path_cuda --out "$OUT/kv_path_8k.json" 2>&1 | tee "$OUT/kv_path_8k.log"
timeout 200 python3 -m benchmarks.kv_path_cuda --tokens 32768 --chunk-tokens 4096 --transports shm,tcp --layouts blocks_first \
    --repeats 2 --out "$OUT/kv_path_32k.json" 2>&1 | tee "$OUT/kv_path_32k.log"
