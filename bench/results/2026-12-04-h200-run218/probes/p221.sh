tar xJf .gpubin.tar.xz
export LD_LIBRARY_PATH=$PWD/.gpubin:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
CUDA_LAUNCH_BLOCKING=1 timeout 120 .gpubin/dz_tests "CUDA MXFP4 GEMM*" > $OUT/p221_t1.log 2>&1
echo rc_t1=$?
grep -B2 -A6 "FAILED" $OUT/p221_t1.log | head -30
timeout 300 /usr/local/cuda/bin/compute-sanitizer --print-limit 5 .gpubin/dz_tests "CUDA MXFP4 GEMM*" > $OUT/p221_san.log 2>&1
echo rc_san=$?
head -60 $OUT/p221_san.log
