#!/usr/bin/env bash
# The forward's levers on SmolLM2-135M, p = 2 ranks of 1 thread each (gloo) and one process on both cores: float32
# and bfloat16, eager and compiled (--compile), at 4k and 8k. Each setting is one kvr-bench world (its dtype and
# compilation are the world's), so the settings are interleaved by round, the order rotating: round r starts at
# setting r. Every kvr-bench run has one untimed warm-up per point first (where a compiled world compiles the
# chain's shape families), then one timed run. Resumable: a finished (setting, round) is skipped.
#   bash experiments/fast_forward/run.sh rounds [N]   # N rounds (default 3)
#   bash experiments/fast_forward/run.sh startup      # kvr-serve's start-up, eager / compiled cold / compiled warm
#   bash experiments/fast_forward/run.sh decode       # the batch decoder's step: 8 unequal rows against one
#   bash experiments/fast_forward/run.sh chunks       # a long prompt whole against chunked (500 ms budget)
#   bash experiments/fast_forward/run.sh vllm         # against vLLM CPU (serve_vs_vllm/install.sh first); FF_DTYPE,
#                                                     # FF_LENGTHS, FF_ROUNDS, FF_LOAD (load.py's parts)
#   python experiments/fast_forward/peak.py           # the GEMM peak on the run's shapes, fp32 and bf16 (1 thread)
#   python experiments/fast_forward/report.py         # summary.md: medians, ratios, FLOP/s against the peak
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/fast_forward
CTX=${FF_CTX:-4k,8k}
settings=("float32" "float32 --compile" "bfloat16" "bfloat16 --compile")
case "${1:?which part: rounds or startup}" in
  rounds)
    n=${2:-3}
    for ((r = 0; r < n; r++)); do
      for ((k = 0; k < ${#settings[@]}; k++)); do
        s=${settings[$(((r + k) % ${#settings[@]}))]}
        read -r dtype flag <<<"$s"
        name="${dtype}${flag:+-compiled}"
        dir="$out/rows/${name}_r$r"
        [ -s "$dir/summary.csv" ] && continue
        echo "round $r: $name" >&2
        kvr-bench --ctx "$CTX" --modes single-pt,kvr-default --nproc 2 --threads 1 --repeats 1 --warmup 1 \
          --timeout 1800 --dtype "$dtype" $flag --out "$dir" --resume
      done
    done ;;
  startup)
    python "$out/startup.py" --dtype float32 ;;
  decode)  # one decode step of 8 unequal rows against one row, unpadded and padded
    for d in float32 bfloat16; do python "$out/decode_step.py" --dtype "$d"; done
    python "$out/decode_step.py" --dtype float32 --compile ;;
  chunks)  # a prompt alone, whole against chunked at a 500 ms step budget
    python "$out/chunks.py" --rounds 2 --lengths 8184,16376 --dtype bfloat16
    python "$out/chunks.py" --rounds 2 --lengths 8184 --dtype float32 ;;
  vllm)  # against vLLM CPU on both cores, in one dtype (FF_DTYPE): one request at a time, then under load
    d=${FF_DTYPE:-bfloat16}
    python experiments/serve_vs_vllm/single.py --rows "$out/vs_vllm_single.jsonl" --rounds "${FF_ROUNDS:-2}" \
      --lengths "${FF_LENGTHS:-4096,8184,16376}" --servers kvr,vllm --dtype "$d"
    # shellcheck disable=SC2086  # the parts are words
    python experiments/serve_vs_vllm/load.py ${FF_LOAD:-concurrency sharegpt} --servers kvr,vllm --dtype "$d" \
      --out "$out/vs_vllm_load/$d" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
