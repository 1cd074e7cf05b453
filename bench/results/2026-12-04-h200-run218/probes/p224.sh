tar xJf .gpubin.tar.xz
export LD_LIBRARY_PATH=$PWD/.gpubin:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
timeout 120 .gpubin/dz_tests "CUDA MXFP4 GEMM*" > $OUT/p224_t1.log 2>&1
echo rc_t1=$?
tail -3 $OUT/p224_t1.log
timeout 200 .gpubin/dz bench moe --tokens 4096 --fp8-gemm auto --reps 3 --out $OUT/p224_c.json 2>$OUT/p224_c.log >/dev/null
grep -E "mxfp4 gemm" $OUT/p224_c.log
timeout 300 .gpubin/dz bench moe --tokens 2048,3072,4096,6144,8192,12288,16384 --fp8-gemm auto,auto_fold --no-components --reps 10 --out $OUT/p224_moe.json 2>$OUT/p224.log >/dev/null
grep -E "^moe T=" $OUT/p224.log | grep auto_fold
