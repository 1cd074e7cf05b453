tar xJf .gpuboth.tar.xz; B=$PWD/.gpubin; export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64
mkdir -p $OUT/r; nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/r/gpu.txt
timeout 200 $B/dz_tests "CUDA MXFP4 GEMM*,CUDA MoE layer: fused W4A16*,CUDA MoE layer: the plain*" -r compact > $OUT/r/t.txt 2>&1; echo "rc=$?" >> $OUT/r/t.txt
tail -3 $OUT/r/t.txt; grep -B3 -A12 FAILED $OUT/r/t.txt | head -40
timeout 100 $B/dz bench moe --tokens 16384 --fp8-gemm auto,auto_nopair --out $OUT/r/comp.json > $OUT/r/comp.txt 2>&1
grep -E "whole-K|^moe" $OUT/r/comp.txt
timeout 90 $B/dz bench moe --tokens 4096,16384 --no-components --fp8-gemm auto,auto_nopair,auto_nowhole --out $OUT/r/moe120.json > $OUT/r/moe120.txt 2>&1
grep -E "^moe" $OUT/r/moe120.txt
timeout 60 $B/dz bench moe --experts 32 --no-components --tokens 2048,16384 --fp8-gemm auto,auto_nopair --out $OUT/r/moe20.json > $OUT/r/moe20.txt 2>&1
grep -E "^moe" $OUT/r/moe20.txt
for v in auto auto_nopair; do
timeout 100 ncu --clock-control none --kernel-name regex:mxfp4_gemm_kernel --launch-skip 6 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats $B/dz bench moe --tokens 16384 --no-components --fp8-gemm $v --reps 3 > $OUT/r/ncu_$v.txt 2>&1
echo "== $v"; grep -E "Duration|Throughput|Pipe|Issue|Eligible|Hit Rate|Busy" $OUT/r/ncu_$v.txt | head -40
done
