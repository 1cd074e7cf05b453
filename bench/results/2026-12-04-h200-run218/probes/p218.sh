tar xJf .gpubin.tar.xz
export LD_LIBRARY_PATH=$PWD/.gpubin:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
DZ_FP8_GROUPED_DEBUG=1 timeout 240 .gpubin/dz_tests "CUDA MXFP4 GEMM*" > $OUT/p218_t1.log 2>&1
echo rc_t1=$?
tail -30 $OUT/p218_t1.log
timeout 240 .gpubin/dz_tests "CUDA MoE layer: fused W4A16 and FP8 paths*" > $OUT/p218_t2.log 2>&1
echo rc_t2=$?
tail -15 $OUT/p218_t2.log
timeout 240 .gpubin/dz bench moe --tokens 1024,2048,4096,8192,16384 --fp8-gemm auto,auto_fold --reps 10 --out $OUT/p218_moe.json 2>$OUT/p218.log >/dev/null
echo rc_b=$?
grep -E "^moe T=|mxfp4 gemm|grouped gemm|auto_fold" $OUT/p218.log | head -60
