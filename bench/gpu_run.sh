#!/usr/bin/env bash
# The GPU runs behind bench/RESULTS.md, on a machine that has torch, triton and transformers but
# cannot install packages: kvfleet is put on the path through a shim, and the few pure-Python
# packages it lacks come as wheels in .whl/ (see the device notes in bench/RESULTS.md).
#   bash bench/gpu_run.sh OUTDIR check    # kernels at real sizes + GPU tests
#   bash bench/gpu_run.sh OUTDIR bench    # throughput, latency
set -uo pipefail
out=${1:?output dir}
shift
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/kv/kvfleet
for pkg in engine kernels operator; do ln -sfn "$PWD/$pkg" "/tmp/kv/kvfleet/$pkg"; done
export PYTHONPATH=/tmp/site:/tmp/kv PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
py="python3 -P"

for step in "$@"; do
    case $step in
    check)
        timeout 300 $py bench/kernel_test_gpu.py 2>&1 | tee "$out/kernels.txt"
        timeout 400 $py -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.txt"
        ;;
    gputests)
        timeout 400 $py -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.txt"
        ;;
    qwen3)
        timeout 500 $py bench/throughput.py --model bench/models/Qwen3-0.6B --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --baselines hf-static hf-continuous \
            --baseline-num-prompts 32 --result-json "$out/qwen3_throughput.json" 2>&1 |
            tee "$out/qwen3_throughput.txt"
        ;;
    qwen3-static)
        timeout 500 $py bench/throughput.py --model bench/models/Qwen3-0.6B --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --baselines hf-static \
            --baseline-num-prompts 32 --result-json "$out/qwen3_throughput.json" 2>&1 |
            tee "$out/qwen3_throughput.txt"
        ;;
    profile)
        timeout 300 $py bench/profile_step.py --model bench/models/Qwen3-0.6B --batch 128 \
            --context 1024 2>&1 | tee "$out/profile.txt"
        timeout 300 $py bench/throughput.py --model bench/models/Qwen3-0.6B --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --step-stats 2>&1 | tee "$out/steps.txt"
        ;;
    llama8b)
        timeout 550 $py bench/throughput.py --model bench/models/Llama-3.1-8B --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --baselines hf-static \
            --baseline-num-prompts 32 --result-json "$out/llama31_throughput.json" 2>&1 |
            tee "$out/llama31_throughput.txt"
        ;;
    requests)
        timeout 500 $py bench/throughput.py --model bench/models/Meta-Llama-3-8B --num-prompts 1000 \
            --input-len 256 256 --output-len 256 256 --result-json "$out/llama3_requests.json" 2>&1 |
            tee "$out/llama3_requests.txt"
        ;;
    latency)
        timeout 300 $py bench/latency.py --model bench/models/Llama-3.1-8B --profile 2>&1 |
            tee "$out/latency.txt"
        ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
