tar xJf .gpuboth.tar.xz; B=$PWD/.gpubin; export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64
mkdir -p $OUT/r; nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/r/gpu.txt
timeout 100 $B/dz bench moe --tokens 16384 --fp8-gemm auto --out $OUT/r/comp.json > $OUT/r/comp.txt 2>&1
grep -E "whole-K|^moe" $OUT/r/comp.txt
timeout 150 ncu --clock-control none --kernel-name regex:mxfp4_gemm_kernel --launch-skip 6 --launch-count 2 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum" $B/dz bench moe --tokens 16384 --no-components --fp8-gemm auto --reps 3 > $OUT/r/ncu.txt 2>&1
grep -vE " 0(\.0+)?$|n/a" $OUT/r/ncu.txt | grep -E "stalled|gmma|issue_active|duration" | head -60
