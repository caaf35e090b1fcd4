#!/usr/bin/env bash
# The GPU runs behind bench/RESULTS.md, on a machine that has torch, triton and transformers but
# cannot install packages: kvfleet is put on the path through a shim, and the few pure-Python
# packages it lacks come as wheels in .whl/ (see the device notes in bench/RESULTS.md).
#   bash bench/gpu_run.sh OUTDIR check    # kernels at real sizes + GPU tests
#   GPU_RUN_ARCHIVE=$OUT/run.tgz bash bench/gpu_run.sh /tmp/o STEPS...  # one file back from a device call
#   bash bench/gpu_run.sh OUTDIR qwen3 llama8b requests latency ...   # throughput, latency
#   bash bench/gpu_run.sh OUTDIR gemma-chat gpt2-burst llama2-13b      # issue 9's workloads
#   bash bench/gpu_run.sh OUTDIR tp-tests tp-llama8b tp-70b            # two GPUs: tensor parallel
#   bash bench/gpu_run.sh OUTDIR moe-placement    # two GPUs: experts split vs placed per rank
#   bash bench/gpu_run.sh OUTDIR moe-fp8          # Qwen3-30B-A3B bf16 vs fp8 weights and cache
#   bash bench/gpu_run.sh OUTDIR structured structured-profile   # structured outputs' cost (issue 22)
#   bash bench/gpu_run.sh OUTDIR async-ab          # async scheduling against the synchronous loop
#   bash bench/gpu_run.sh OUTDIR lora              # multi-LoRA: 8 and 64 adapters against the base
#   bash bench/gpu_run.sh OUTDIR fp8-check fp8w-requests fp8w-latency fp8w-llama2-13b  # fp8 weights
#   bash bench/gpu_run.sh OUTDIR fp8-linear fp8-gemm-sweep fp8-profile  # fp8 linears; a batch-1 step
#   bash bench/gpu_run.sh OUTDIR check fp8-llama2-13b      # fp8 kernels; Llama-2-13B bf16/fp8 KV/both
#   bash bench/gpu_run.sh OUTDIR moe-tests moe-kernel moe-kernel-sweep  # the fused MoE kernel
#   bash bench/gpu_run.sh OUTDIR moe-kernel-w8a8  # fp8 experts: W8A8 vs W8A16 vs bf16 by tokens
#   bash bench/gpu_run.sh OUTDIR moe-block        # the whole MoE block's launches and time, decode
#   bash bench/gpu_run.sh OUTDIR embeddings        # embedding throughput against HF (issue 43)
#   bash bench/gpu_run.sh OUTDIR lora-tests lora-kernel lora-kernel-sweep  # batched LoRA (issue 40)
#   FLEET_WORKLOAD=tenants bash bench/gpu_run.sh OUTDIR fleet-routing-20_40_60-128  # issue 41
#   bash bench/gpu_run.sh OUTDIR router-overhead   # the precise router's added latency (CPU)
#   bash bench/gpu_run.sh OUTDIR startup llama8b  # an engine's start, cold then warm (issue 42)
#   bash bench/gpu_run.sh OUTDIR cpu-kv-tier       # the host KV tier off vs on (issue 42)
# Models are dummy-weight bench/models/* configs in bf16; the chat and burst steps give them a
# dummy tokenizer (bench/dummy_tokenizer.py), since they send text.
set -uo pipefail
out=${1:?output dir}
shift
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/kv/kvfleet
# Every package folder setup.py builds (its FOLDERS), so a new one needs no change here.
for pkg in $(python3 -c 'import ast, sys; t = ast.parse(open("setup.py").read())
print(*next(ast.literal_eval(n.value) for n in t.body
            if isinstance(n, ast.Assign) and n.targets[0].id == "FOLDERS"))'); do
    ln -sfn "$PWD/$pkg" "/tmp/kv/kvfleet/$pkg"
done
# The distribution's metadata, which the operator reads its version from (its User-Agent).
mkdir -p /tmp/kv/kvfleet-0.dist-info
printf 'Metadata-Version: 2.1\nName: kvfleet\nVersion: %s\n' \
    "$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')" \
    >/tmp/kv/kvfleet-0.dist-info/METADATA
export PYTHONPATH=/tmp/site:/tmp/kv PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on shared multi-GPU hosts (the device notes: it can take the host's
# GPUs out of service); set here too in case the machine's environment is not inherited.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# The commit that runs: a snapshot made with `git archive` passes KVFLEET_COMMIT (the scripts
# read it too); a checkout's HEAD counts only at its top, not a parent repository's.
if [ -z "${KVFLEET_COMMIT:-}" ] && [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; then
    KVFLEET_COMMIT=$(git rev-parse --short HEAD)
fi
export KVFLEET_COMMIT=${KVFLEET_COMMIT:-unknown}
echo "commit $KVFLEET_COMMIT" | tee -a "$out/gpu.txt"
py="python3"
# The fleet steps run one engine per visible GPU.
ngpus=$(nvidia-smi -L | wc -l)
gpus=$(seq -s, 0 $((ngpus - 1)))

# A kvfleet server on 127.0.0.1:8000 in the background ($server); returns once it is ready.
start_server() {
    local log=$1
    shift
    $py -m kvfleet.engine.cli serve --host 127.0.0.1 --port 8000 "$@" >"$log" 2>&1 &
    server=$!
    for _ in $(seq 240); do
        $py -c 'import urllib.request as r; r.urlopen("http://127.0.0.1:8000/ready", timeout=2)' \
            2>/dev/null && return 0
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    echo "the kvfleet server did not get ready; see $log" >&2
    kill $server 2>/dev/null
    return 1
}

for step in "$@"; do
    case $step in
    check)
        timeout 420 $py bench/kernel_test_gpu.py 2>&1 | tee "$out/kernels.txt"
        timeout 400 $py -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_structured_gpu.py \
            tests/engine/test_fp8_kv_gpu.py tests/engine/test_moe_gpu.py tests/engine/test_lora_gpu.py \
            tests/engine/test_host_kv_tier_gpu.py 2>&1 |
            tee "$out/gpu_tests.txt"
        ;;
    gputests)
        timeout 400 $py -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_structured_gpu.py \
            tests/engine/test_fp8_kv_gpu.py tests/engine/test_moe_gpu.py tests/engine/test_lora_gpu.py \
            tests/engine/test_host_kv_tier_gpu.py 2>&1 |
            tee "$out/gpu_tests.txt"
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
    embeddings)
        # Issue 43: embedding throughput of a Qwen3-0.6B-sized model (dummy weights, bf16) at
        # 512-token inputs, kvfleet's pooling runner against HF AutoModel batches in the same call.
        timeout 500 $py bench/embeddings.py --model bench/models/Qwen3-0.6B --num-prompts 4096 \
            --input-len 512 --hf-batch-size 32 128 --result-json "$out/embeddings.json" 2>&1 |
            tee "$out/embeddings.txt"
        ;;
    fp8-check)
        # FP8 weights at real sizes: the GEMM against its dequantized reference, an 8B-class
        # stack's and a Qwen3-30B-A3B stack's (fp8 experts) first-token logprobs with
        # --quantization fp8 against bf16.
        timeout 400 $py -m pytest -q -s -p no:cacheprovider tests/engine/test_fp8_weights_gpu.py 2>&1 |
            tee "$out/fp8_weights_tests.txt"
        ;;
    moe-tests)
        # Issue 39's fused MoE kernel on the GPU: against its twin at real sizes, replayed from
        # a CUDA graph, tiny MoE models with graphs equal to eager and HF.
        timeout 500 $py -m pytest -q -s -p no:cacheprovider tests/engine/test_moe_gpu.py 2>&1 |
            tee "$out/moe_gpu_tests.txt"
        ;;
    moe-kernel)
        # The fused MoE kernel's time against the per-expert PyTorch loop and a dense GEMM of the
        # same FLOPs at Qwen3-30B-A3B's and Mixtral-8x7B's shapes, bf16 and fp8 weights (W8A16 and
        # W8A8), 1-4,096 tokens (moe_kernel.json).
        timeout 560 $py bench/moe_kernel.py --out-dir "$out" 2>&1 | tee "$out/moe_kernel.txt"
        ;;
    moe-block)
        # The whole MoE block at decode sizes (router through combine): its launches and time
        # with the routing and alignment in one launch and in their own (moe_block.json).
        mkdir -p "$out/block"
        timeout 560 $py bench/moe_kernel.py --out-dir "$out/block" --blocks \
            --tokens 1 2 4 8 16 32 64 2>&1 | tee "$out/moe_block.txt"
        ;;
    moe-kernel-w8a8)
        # Qwen3-30B-A3B's fp8 experts in both modes against bf16 at the token counts between
        # decode and prefill: where W8A8 starts to beat W8A16 (engine.layers.moe.W8A8_MIN_TOKENS).
        mkdir -p "$out/w8a8"
        timeout 560 $py bench/moe_kernel.py --out-dir "$out/w8a8" --models qwen3-30b-a3b \
            --tokens 1 8 16 32 64 128 256 512 4096 2>&1 | tee "$out/moe_kernel_w8a8.txt"
        ;;
    moe-kernel-sweep)
        # The fused MoE kernel's candidate tiles per token-count bucket, best first, and a TILES
        # table for kernels/fused_moe.py; MOE_SWEEP_MODELS / MOE_SWEEP_DTYPES / MOE_SWEEP_TOKENS
        # pick the shapes and sizes (Qwen3-30B-A3B bf16 at each bucket's largest size by default:
        # one model and dtype fits the step's time; MOE_SWEEP_DTYPES=fp8 sweeps W8A8_TILES).
        read -ra sweep_models <<<"${MOE_SWEEP_MODELS:-qwen3-30b-a3b}"
        read -ra sweep_dtypes <<<"${MOE_SWEEP_DTYPES:-bf16}"
        read -ra sweep_tokens <<<"${MOE_SWEEP_TOKENS:-1 32 128 512 2048 4096}"
        timeout 580 $py bench/moe_kernel.py --out-dir "$out" --sweep --models "${sweep_models[@]}" \
            --dtypes "${sweep_dtypes[@]}" --sweep-tokens "${sweep_tokens[@]}" 2>&1 |
            tee "$out/moe_kernel_sweep.txt"
        ;;
    lora-tests)
        # Issue 40's batched LoRA kernels against their twins at Llama-3.1-8B's sizes, and
        # replayed from a CUDA graph as the slot map changes.
        timeout 500 $py -m pytest -q -s -p no:cacheprovider tests/kernels/test_lora_gpu.py 2>&1 |
            tee "$out/lora_gpu_tests.txt"
        ;;
    lora-kernel)
        # What batched LoRA's shrink + expand add to each Llama-3.1-8B projection's GEMM, 1-2,048
        # tokens, ranks 16 and 64, 8 and 16 slots (lora_kernel.json).
        timeout 560 $py bench/lora_kernel.py --out-dir "$out" 2>&1 | tee "$out/lora_kernel.txt"
        ;;
    lora-kernel-sweep)
        # Batched LoRA's candidate tiles per token-count bucket at Llama-3.1-8B's projections
        # (rank 16, 8 slots), best first, and a TILES table for kernels/lora.py;
        # LORA_SWEEP_TOKENS picks the token counts (each bucket's largest and 1 by default).
        read -ra sweep_tokens <<<"${LORA_SWEEP_TOKENS:-1 16 32 128 512 2048}"
        timeout 580 $py bench/lora_kernel.py --out-dir "$out" --sweep \
            --sweep-tokens "${sweep_tokens[@]}" 2>&1 | tee "$out/lora_kernel_sweep.txt"
        ;;
    fp8-linear)
        # Where an fp8 linear's time goes at Llama-3-8B's shapes: bf16, W8A8 and its parts.
        timeout 400 $py bench/fp8_linear_bench.py 2>&1 | tee "$out/fp8_linear.txt"
        ;;
    fp8-gemm-sweep)
        # The decode GEMM's tiles (kernels.fp8_gemm) at Llama-3-8B's shapes, 1-16 tokens.
        timeout 400 $py bench/fp8_linear_bench.py --gemm-sweep 2>&1 | tee "$out/fp8_gemm_sweep.txt"
        ;;
    fp8-llama2-13b)
        # Issue 21's Llama-2-13B goals: the article's workload (256 requests, input and output
        # uniform in [128, 512]) in bf16, with an fp8 KV cache, and with fp8 weights and KV cache,
        # in one call.
        for variant in bf16 fp8kv fp8w-fp8kv; do
            case $variant in
            bf16) vargs=() ;;
            fp8kv) vargs=(--kv-cache-dtype fp8) ;;
            fp8w-fp8kv) vargs=(--quantization fp8 --kv-cache-dtype fp8) ;;
            esac
            echo "== $step $variant: ${vargs[*]}" | tee -a "$out/$step.txt"
            timeout 280 $py bench/throughput.py --model bench/models/Llama-2-13b-hf \
                --num-prompts 256 --input-len 128 512 --output-len 128 512 --step-stats \
                "${vargs[@]}" --result-json "$out/${step}_$variant.json" 2>&1 |
                tee -a "$out/$step.txt"
        done
        ;;
    fp8w-requests | fp8w-latency | fp8w-llama2-13b)
        # Issue 21's fp8-weight goals, bf16 then --quantization fp8 in the same call (dummy
        # weights): Llama-3-8B 1000 x 256/256; batch-1 Llama-3.1-8B TPOT against its weight-read
        # floor (fp8 weights count one byte); the article's Llama-2-13B workload. FP8_ENGINE_ARGS
        # (e.g. "--kv-cache-dtype fp8") is added to the fp8 runs.
        read -ra fp8_extra <<<"${FP8_ENGINE_ARGS:-}"
        for q in bf16 fp8; do
            qargs=()
            [ $q = fp8 ] && qargs=(--quantization fp8 "${fp8_extra[@]}")
            echo "== $step $q: ${qargs[*]}" | tee -a "$out/$step.txt"
            case $step in
            fp8w-requests)
                timeout 280 $py bench/throughput.py --model bench/models/Meta-Llama-3-8B \
                    --num-prompts 1000 --input-len 256 256 --output-len 256 256 "${qargs[@]}" \
                    --result-json "$out/${step}_$q.json" 2>&1 | tee -a "$out/$step.txt"
                ;;
            fp8w-latency)
                timeout 250 $py bench/latency.py --model bench/models/Llama-3.1-8B "${qargs[@]}" \
                    2>&1 | tee -a "$out/$step.txt"
                ;;
            fp8w-llama2-13b)
                timeout 280 $py bench/throughput.py --model bench/models/Llama-2-13b-hf \
                    --num-prompts 256 --input-len 128 512 --output-len 128 512 --step-stats \
                    "${qargs[@]}" --result-json "$out/${step}_$q.json" 2>&1 | tee -a "$out/$step.txt"
                ;;
            esac
        done
        ;;
    fp8-profile)
        # Where a batch-1 Llama-3.1-8B decode step's time goes, bf16 then fp8 weights (issue 21's
        # batch-1 TPOT): the kernels, the device's idle gaps, the host's share.
        for q in bf16 fp8; do
            qargs=()
            [ $q = fp8 ] && qargs=(--quantization fp8)
            timeout 200 $py bench/profile_step.py --model bench/models/Llama-3.1-8B --batch 1 \
                --context 128 "${qargs[@]}" 2>&1 | tee "$out/fp8_profile_$q.txt"
        done
        ;;
    profile)
        timeout 300 $py bench/profile_step.py --model bench/models/Qwen3-0.6B --batch 128 \
            --context 1024 2>&1 | tee "$out/profile.txt"
        timeout 300 $py bench/throughput.py --model bench/models/Qwen3-0.6B --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --step-stats 2>&1 | tee "$out/steps.txt"
        ;;
    gemma-profile)
        # Where a gemma-2-2b decode step's time goes at the chat workload's batch sizes.
        for batch in 1 32; do
            timeout 200 $py bench/profile_step.py --model bench/models/gemma-2-2b-it --batch $batch \
                --context 128 2>&1 | tee "$out/gemma_profile_b${batch}.txt"
        done
        ;;
    startup)
        # Issue 42's fast start: Llama-3.1-8B (dummy weights) started three times on one compile
        # cache, the first cold, each phase from kvfleet_engine_startup_seconds, the first
        # request's TTFT/TPOT right after ready and the TPOT once the rest of the graphs are in
        # (startup.json). Run `llama8b` in the same call for the throughput against RESULTS.md.
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        timeout 560 $py bench/startup.py --model /tmp/llama8b --runs 3 --fresh \
            --cache-dir /tmp/kvfleet-compile-cache --out-dir "$out" \
            --result-json "$out/startup.json" -- --load-format dummy --dtype bfloat16 \
            --max-model-len 8192 2>&1 | tee "$out/startup.txt"
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
    gemma-chat)
        # Closed-loop chat users, 10 s of warm-up then 60 s (CHAT_DURATION) measured, 1 then 32 users.
        timeout 120 $py bench/dummy_tokenizer.py bench/models/gemma-2-2b-it /tmp/gemma-2-2b-it ||
            continue
        start_server "$out/gemma_chat_server.log" --model /tmp/gemma-2-2b-it --load-format dummy \
            --dtype bfloat16 --served-model-name gemma-2-2b-it || continue
        for users in 1 32; do
            timeout 120 $py bench/serve.py --base-url http://127.0.0.1:8000 --model gemma-2-2b-it \
                --endpoint chat --prompt "Explain RAG in 3 sentences" --output-len 200 \
                --users $users --warmup-duration 10 --duration "${CHAT_DURATION:-60}" \
                --result-json "$out/gemma_chat_${users}users.json" 2>&1 |
                tee "$out/gemma_chat_${users}users.txt"
        done
        kill $server
        wait $server
        ;;
    gpt2-burst)
        # 50 simultaneous requests of 50 tokens at kvfleet, then at sequential HF generate.
        timeout 120 $py bench/dummy_tokenizer.py bench/models/gpt2-large /tmp/gpt2-large || continue
        timeout 500 $py bench/burst.py --model /tmp/gpt2-large --served-model-name gpt2-large \
            --dtype bfloat16 --startup-timeout 240 --log-dir "$out/gpt2_burst_logs" \
            --result-json "$out/gpt2_burst.json" 2>&1 | tee "$out/gpt2_burst.txt"
        ;;
    llama2-13b)
        # 256 requests, input and output uniform in [128, 512]; HF baselines on the first 8.
        # Then the same requests behind one shared 2,000-token prefix, with prefix caching (the
        # default) and without.
        timeout 330 $py bench/throughput.py --model bench/models/Llama-2-13b-hf --num-prompts 256 \
            --input-len 128 512 --output-len 128 512 --step-stats \
            --baselines hf-static --hf-batch-size 1 8 --baseline-num-prompts 8 \
            --result-json "$out/llama2_13b_throughput.json" 2>&1 |
            tee "$out/llama2_13b_throughput.txt"
        timeout 200 $py bench/throughput.py --model bench/models/Llama-2-13b-hf --num-prompts 256 \
            --input-len 128 512 --output-len 128 512 --prefix-len 2000 --step-stats \
            --result-json "$out/llama2_13b_prefix.json" 2>&1 | tee "$out/llama2_13b_prefix.txt"
        timeout 300 $py bench/throughput.py --model bench/models/Llama-2-13b-hf --num-prompts 256 \
            --input-len 128 512 --output-len 128 512 --prefix-len 2000 --step-stats \
            --no-enable-prefix-caching --result-json "$out/llama2_13b_prefix_uncached.json" 2>&1 |
            tee "$out/llama2_13b_prefix_uncached.txt"
        ;;
    structured)
        # Issue 22's goals: 32 chat users, every request under a JSON schema (one cached schema,
        # then a new schema each request) against the same workload unconstrained, in this call;
        # Llama-3.1-8B dummy weights with a 128k tokenizer, the size the grammar's masks are for.
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        start_server "$out/structured_server.log" --model /tmp/llama8b --load-format dummy \
            --dtype bfloat16 --max-model-len 8192 --served-model-name llama8b || continue
        timeout 400 $py bench/structured.py --base-url http://127.0.0.1:8000 --model llama8b \
            --users 32 --max-tokens 256 --warmup-duration 10 --duration "${STRUCTURED_DURATION:-30}" \
            --rounds "${STRUCTURED_ROUNDS:-2}" \
            --result-json "$out/structured.json" 2>&1 | tee "$out/structured.txt"
        kill $server
        wait $server
        ;;
    lora)
        # Issue 40's goals: Llama-3.1-8B (dummy), 32 closed-loop users, 512/128 tokens: the base
        # model alone, then 8 rank-16 adapters spread over the requests (--max-loras 8), then 64
        # with --max-loras 16 (churn from host memory), same call; LORA_DURATION seconds each.
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        [ -d /tmp/lora8b/a63 ] || timeout 600 $py bench/lora.py adapters \
            --model bench/models/Llama-3.1-8B --out /tmp/lora8b --count 64 --rank 16 >/dev/null ||
            continue
        for run in base lora8 lora64; do
            case $run in
            base) largs=() names=(llama8b) ;;
            lora8) names=(a0 a1 a2 a3 a4 a5 a6 a7)
                largs=(--enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules) ;;
            lora64) names=($(seq -f 'a%g' 0 63))
                largs=(--enable-lora --max-loras 16 --max-cpu-loras 64 --max-lora-rank 16
                    --lora-modules) ;;
            esac
            modules=()
            [ $run != base ] && for n in "${names[@]}"; do modules+=("$n=/tmp/lora8b/$n"); done
            start_server "$out/lora_${run}_server.log" --model /tmp/llama8b --load-format dummy \
                --dtype bfloat16 --max-model-len 8192 --served-model-name llama8b \
                "${largs[@]}" "${modules[@]}" || continue
            timeout 300 $py bench/serve.py --base-url http://127.0.0.1:8000 --model llama8b \
                --spread-models "${names[@]}" --vocab-size 128000 --input-len 512 \
                --output-len 128 --num-prompts 256 --users 32 --warmup-duration 15 \
                --duration "${LORA_DURATION:-60}" --result-json "$out/lora_$run.json" 2>&1 |
                tee "$out/lora_$run.txt"
            $py -c 'import urllib.request as r
print(r.urlopen("http://127.0.0.1:8000/metrics").read().decode())' >"$out/lora_${run}_metrics.txt"
            kill $server
            wait $server
        done
        $py bench/lora.py report --base "$out/lora_base.json" --lora "$out/lora_lora8.json" \
            --churn "$out/lora_lora64.json" --metrics "$out/lora_lora64_metrics.txt" |
            tee "$out/lora.txt"
        ;;
    structured-profile)
        # Issue 22's TPOT gap: one decode step of 32 Llama-3.1-8B rows (128k vocabulary), free
        # then every row under the bench's JSON schema, on one engine: wall, runner, bitmask.
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        timeout 300 $py bench/profile_step.py --model /tmp/llama8b --batch 32 --context 512 \
            --modes free,json --host-profile 30 --grammar-threads "${GRAMMAR_THREADS:-0}" \
            --bitmask-op "${BITMASK_OP:-engine}" --scheduling async,sync 2>&1 |
            tee "$out/structured_profile.txt"
        ;;
    async-ab)
        # The engine loop's cost: async scheduling (the default) against the synchronous loop,
        # same card, same call: batch-1 Llama-3.1-8B TPOT, then Llama-3-8B 1000 x 256/256.
        for loop in async no-async; do
            timeout 150 $py bench/latency.py --model bench/models/Llama-3.1-8B --repeats 3 \
                --$loop-scheduling 2>&1 | tee "$out/latency_$loop.txt"
        done
        for loop in async no-async; do
            timeout 200 $py bench/throughput.py --model bench/models/Meta-Llama-3-8B \
                --num-prompts 1000 --input-len 256 256 --output-len 256 256 --$loop-scheduling \
                --result-json "$out/llama3_requests_$loop.json" 2>&1 |
                tee "$out/llama3_requests_$loop.txt"
        done
        ;;
    tp-tests)
        # Two GPUs: N=2 against N=1 (fp32 greedy; bf16, and fp8 weights with an fp8 KV cache,
        # logprobs), and the too-big refusal.
        timeout 540 $py -m pytest -q -p no:cacheprovider tests/engine/test_gpu_tensor_parallel.py 2>&1 |
            tee "$out/tp_tests.txt"
        ;;
    tp-llama8b)
        # Llama-3.1-8B at N=1 and N=2 in the same call: throughput, then batch-1 TPOT.
        for tp in 1 2; do
            timeout 200 $py bench/throughput.py --model bench/models/Llama-3.1-8B --num-prompts 256 \
                --input-len 100 1024 --output-len 100 1024 --tensor-parallel-size $tp \
                --result-json "$out/tp${tp}_llama31_throughput.json" 2>&1 |
                tee "$out/tp${tp}_llama31_throughput.txt"
        done
        for tp in 1 2; do
            timeout 120 $py bench/latency.py --model bench/models/Llama-3.1-8B \
                --tensor-parallel-size $tp 2>&1 | tee "$out/tp${tp}_llama31_latency.txt"
        done
        ;;
    moe-fp8)
        # Qwen3-30B-A3B on one GPU in one call: bf16 against --quantization fp8 (every expert
        # per output channel) with --kv-cache-dtype fp8: throughput of 1000 x 256/256, then
        # batch-1 TPOT against the floor of the bytes a token reads (its 8 experts a layer).
        for mode in ${MOE_FP8_MODES:-bf16 fp8}; do
            q=()
            [ $mode = fp8 ] && q=(--quantization fp8 --kv-cache-dtype fp8)
            timeout 300 $py bench/throughput.py --model bench/models/Qwen3-30B-A3B --num-prompts 1000 \
                --input-len 256 256 --output-len 256 256 "${q[@]}" \
                --result-json "$out/moe_qwen3_30b_${mode}_throughput.json" 2>&1 |
                tee "$out/moe_qwen3_30b_${mode}_throughput.txt"
            q=()
            [ $mode = fp8 ] && q=(--quantization fp8)
            timeout 150 $py bench/latency.py --model bench/models/Qwen3-30B-A3B "${q[@]}" 2>&1 |
                tee "$out/moe_qwen3_30b_${mode}_latency.txt"
        done
        ;;
    moe-placement)
        # Two GPUs, N=2, in one call: each expert's intermediate dimension split over the ranks
        # (the default) against the experts placed whole per rank (--enable-expert-parallel),
        # for Qwen3-30B-A3B (128 narrow experts, top-8) and Mixtral-8x7B (8 wide ones, top-2):
        # throughput of 1000 x 256/256, then batch-1 TPOT (docs/architecture.md says what to
        # expect and why). MOE_PLACEMENT_MODELS / MOE_PLACEMENTS pick a part, so that each fits
        # one device call (a model and both placements take about as long as a call allows).
        for model in ${MOE_PLACEMENT_MODELS:-Qwen3-30B-A3B Mixtral-8x7B-v0.1}; do
            for placement in ${MOE_PLACEMENTS:-split experts}; do
                ep=()
                [ $placement = experts ] && ep=(--enable-expert-parallel)
                timeout 280 $py bench/throughput.py --model bench/models/$model --num-prompts 1000 \
                    --input-len 256 256 --output-len 256 256 --tensor-parallel-size 2 "${ep[@]}" \
                    --result-json "$out/moe_${model}_${placement}_throughput.json" 2>&1 |
                    tee "$out/moe_${model}_${placement}_throughput.txt"
                timeout 150 $py bench/latency.py --model bench/models/$model --tensor-parallel-size 2 \
                    "${ep[@]}" 2>&1 | tee "$out/moe_${model}_${placement}_latency.txt"
            done
        done
        ;;
    tp-70b)
        # Llama-2-70B (bf16 weights 128 GiB) does not fit one 80 GB GPU; served with N=2.
        timeout 240 $py bench/throughput.py --model bench/models/Llama-2-70b-hf --num-prompts 64 \
            --input-len 100 1024 --output-len 100 1024 --tensor-parallel-size 2 \
            --result-json "$out/tp2_llama2_70b_throughput.json" 2>&1 |
            tee "$out/tp2_llama2_70b_throughput.txt"
        ;;
    fleet-routing-*)
        # One engine per visible GPU, Llama-3.1-8B (dummy weights) at the engine's own defaults
        # (no --max-num-seqs), behind the real router and operator (bench/fleet): round robin vs
        # approximate (prefix) vs precise prefix scoring, the same requests each:
        # fleet-routing-RATES[-PROMPTS], RATES one rate or several joined by '_' (a sweep on the
        # same warm fleet, from which the harness reads each policy's rate at the p90 TTFT SLO
        # of 1 s), each for FLEET_SECONDS (60). FLEET_WORKLOAD chat (the default): multi-turn
        # chats of FLEET_TURNS (4) on PROMPTS (48) shared system prompts of FLEET_SYSTEM_WORDS
        # (2,000 words: ~4k tokens with the dummy Llama 3 tokenizer; issue 41's shape is 1,200
        # words, ~2.4k tokens, 5 turns); tenants: PROMPTS tenants each with a system prompt of 1,000 words
        # (~2k tokens), one 20-word question a request, 24 output tokens, Zipf popularity. Each
        # engine's KV cache is capped at 12 GB (~91k tokens) so that the working set exceeds one
        # engine's cache, as a production fleet's does. FLEET_POLICIES picks the policies (round
        # robin, prefix and precise by default); FLEET_ROUTERS the router replicas (1; "1,3"
        # runs each router policy through one and through three, on the same requests).
        spec=${step#fleet-routing-}
        rates=${spec%%-*}
        prompts=48
        [ "$spec" != "$rates" ] && prompts=${spec#*-}
        phases=""
        for r in ${rates//_/ }; do phases="$phases${phases:+;}${FLEET_SECONDS:-60}x$r"; done
        workload=${FLEET_WORKLOAD:-chat}
        if [ "$workload" = tenants ]; then
            shape=(--workload tenants --tenants "$prompts" --tenant-words 1000 --question-words 20)
        else
            shape=(--system-prompts "$prompts" --system-words "${FLEET_SYSTEM_WORDS:-2000}"
                   --turns "${FLEET_TURNS:-4}" --user-words 60 --reply-words 120 --max-tokens 100)
        fi
        # The device sends back only files named in letters, digits, '.', '_' and '-'.
        name="fleet_routing_${workload}_$spec${FLEET_POLICIES:+_${FLEET_POLICIES//,/-}}"
        name="$name${FLEET_ROUTERS:+_routers${FLEET_ROUTERS//,/-}}"
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        timeout 580 $py bench/fleet/run.py --model /tmp/llama8b --gpus "$gpus" \
            --engine-arg=--load-format=dummy --engine-arg=--kv-cache-memory-bytes=12000000000 \
            --max-model-len 8192 --min-replicas "$ngpus" --max-replicas "$ngpus" --settle 0 \
            --policies "${FLEET_POLICIES:-round-robin,prefix,precise}" \
            --router-replicas "${FLEET_ROUTERS:-1}" --phases "$phases" "${shape[@]}" \
            --ttft-slo 1.0 --log-dir "$out/fleet-routing-$spec-logs" \
            --result-json "$out/$name.json" 2>&1 | tee "$out/$name.txt"
        ;;
    router-overhead)
        # The router's added latency with precise prefix scoring (issue 41's goal: p99 under 2 ms
        # at 500 requests/s through one replica): a CPU measurement, on this host's dedicated
        # cores; stub engines publishing their blocks, ~2.4k-token prompts; twice, as a check.
        for i in 1 2; do
            timeout 280 $py bench/router_bench.py --latency-only --rate 500 --latency-requests 5000 \
                --result-json "$out/router_overhead_$i.json" 2>&1 | tee "$out/router_overhead_$i.txt"
        done
        ;;
    fleet-autoscale)
        # The builtin autoscaler from one replica to one per visible GPU: a ramp 2 -> PEAK -> 2
        # requests/s (FLEET_PEAK, 16; FLEET_PHASES replaces the whole ramp, e.g. a gradual rise
        # for the forecast), FLEET_QUEUE (4) requests in flight per replica targeted, prefix
        # routing; FLEET_LATENCY (e.g. ttft:0.9:0.5) adds the latency target as a third signal;
        # FLEET_SCALE_AHEAD=off turns the forecast off (spec.autoscaling.scaleAhead). Scale-ups
        # split into decision delay and engine start, the time from the rise to the new replicas
        # serving, TTFT per phase, failures on scale-down (goal: none), replica-seconds against
        # static replicas at the peak, the signal of each decision.
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        name="fleet_autoscale${FLEET_LATENCY:+_latency}${FLEET_SCALE_AHEAD:+_ahead-$FLEET_SCALE_AHEAD}"
        ahead=""
        [ "${FLEET_SCALE_AHEAD:-on}" = off ] && ahead=--no-scale-ahead
        timeout 580 $py bench/fleet/run.py --model /tmp/llama8b --gpus "$gpus" \
            --engine-arg=--load-format=dummy --max-model-len 8192 \
            --min-replicas 1 --max-replicas "$ngpus" --target-queue-depth "${FLEET_QUEUE:-4}" \
            --scale-down-window 30 $ahead ${FLEET_LATENCY:+--latency-target "$FLEET_LATENCY"} \
            --policies prefix --phases "${FLEET_PHASES:-30x2,120x${FLEET_PEAK:-16},60x2}" \
            --settle 90 --system-prompts 48 --system-words 2000 --turns 4 --user-words 60 \
            --reply-words 120 --max-tokens 100 --ttft-slo 1.0 --log-dir "$out/$name-logs" \
            --result-json "$out/$name.json" 2>&1 | tee "$out/$name.txt"
        ;;
    fleet-scale-zero)
        # A service of minReplicas 0 on one GPU, idle at zero; one request at a time through the
        # router, held until the engine the operator scales up serves it; FLEET_REPEATS (4)
        # trials, back to zero between them (10 s idle, 10 s window). The operator at its own
        # default interval (10 s). Each first token split into decision, reconcile, pod start,
        # engine start and ready to first token (goal: first token within 15 s plus the weight
        # read; dummy weights read none).
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        timeout 580 $py bench/fleet/run.py --scenario scale-from-zero --model /tmp/llama8b \
            --gpus 0 --engine-arg=--load-format=dummy --max-model-len 8192 \
            --min-replicas 0 --max-replicas 1 --scale-to-zero-delay 10 --scale-down-window 10 \
            --autoscale-interval 10 --repeats "${FLEET_REPEATS:-4}" --user-words 60 \
            --max-tokens 16 --log-dir "$out/fleet-scale-zero-logs" \
            --result-json "$out/fleet_scale_zero.json" 2>&1 | tee "$out/fleet_scale_zero.txt"
        ;;
    cpu-kv-tier)
        # Issue 42's goal for the host KV tier, off then on, on one engine (GPU 0) behind the
        # real router and operator: the fleet workload (48 system prompts of 2,000 words, ~4k
        # tokens each, 4 turns) at FLEET_RATE (4) requests/s for FLEET_SECONDS (90), the GPU
        # cache capped at 8 GB (~61k tokens) so that the working set is ~3x it; the tier holds
        # 32 GiB. Hit rates per tier and TTFT p90 in cpu_kv_tier_{off,on}.json; then batch-1
        # TPOT with prefix caching, tier off and on (the tier's cost to a decode step).
        [ -d /tmp/llama8b ] || $py bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
        for tier in 0 32Gi; do
            name=cpu_kv_tier_$([ "$tier" = 0 ] && echo off || echo on)
            timeout 200 $py bench/fleet/run.py --model /tmp/llama8b --gpus 0 \
                --engine-arg=--load-format=dummy --engine-arg=--kv-cache-memory-bytes=8000000000 \
                --cpu-kv-cache "$tier" --max-model-len 8192 --min-replicas 1 --max-replicas 1 \
                --settle 0 --policies round-robin --phases "${FLEET_SECONDS:-90}x${FLEET_RATE:-4}" \
                --system-prompts 48 --system-words 2000 --turns 4 --user-words 60 \
                --reply-words 120 --max-tokens 100 --ttft-slo 1.0 --log-dir "$out/$name-logs" \
                --result-json "$out/$name.json" 2>&1 | tee "$out/$name.txt"
        done
        for tier in 0 32Gi; do
            timeout 80 $py bench/latency.py --model bench/models/Llama-3.1-8B \
                --enable-prefix-caching --cpu-kv-cache-bytes "$tier" 2>&1 |
                tee -a "$out/cpu_kv_tier_tpot.txt"
        done
        ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
# A device call brings back at most 8 files: GPU_RUN_ARCHIVE=$OUT/run.tgz packs the whole output
# folder (logs, JSON, server logs) into one.
if [ -n "${GPU_RUN_ARCHIVE:-}" ]; then
    tar czf "$GPU_RUN_ARCHIVE" -C "$(dirname "$out")" "$(basename "$out")"
fi
