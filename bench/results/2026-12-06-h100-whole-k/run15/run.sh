tar xJf .gpuboth.tar.xz; B=$PWD/.gpubin; export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/r/gpu.txt
for i in 1 2; do for v in dz dz_old; do
timeout 60 $B/$v bench moe --tokens 4096,16384 --no-components --fp8-gemm auto --out $OUT/r/moe120_${v}_$i.json > $OUT/r/moe120_${v}_$i.txt 2>&1
echo "$v $i: $(grep -E '^moe' $OUT/r/moe120_${v}_$i.txt | tr '\n' ' ')"
done; done
for v in dz dz_old; do
timeout 60 $B/$v bench moe --experts 32 --tokens 2048,16384 --no-components --fp8-gemm auto --out $OUT/r/moe20_${v}.json > $OUT/r/moe20_${v}.txt 2>&1
echo "$v e32: $(grep -E '^moe' $OUT/r/moe20_${v}.txt | tr '\n' ' ')"
done
timeout 100 $B/dz_tests "CUDA MXFP4*,CUDA MoE layer*" -r compact > $OUT/r/t.txt 2>&1; echo "rc=$?" >> $OUT/r/t.txt
tail -2 $OUT/r/t.txt; grep -B3 -A10 FAILED $OUT/r/t.txt | head -30
