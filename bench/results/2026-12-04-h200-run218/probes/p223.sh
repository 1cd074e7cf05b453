tar xJf .gpubin.tar.xz
export LD_LIBRARY_PATH=$PWD/.gpubin:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
for pr in 0 1 2 3; do
  echo "probe $pr"
  DZ_MG_PROBE=$pr timeout 200 .gpubin/dz bench moe --tokens 16384 --fp8-gemm auto --reps 3 --out $OUT/p223_$pr.json 2>$OUT/p223_$pr.log >/dev/null
  grep -E "mxfp4 gemm" $OUT/p223_$pr.log
done
timeout 300 .gpubin/dz bench moe --tokens 1024,1536,2048,3072,4096,6144,8192,12288,16384 --fp8-gemm auto,auto_fold --no-components --reps 10 --out $OUT/p223_moe.json 2>$OUT/p223.log >/dev/null
grep -E "^moe T=" $OUT/p223.log
