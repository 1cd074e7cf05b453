tar xJf .gpubin.tar.xz
export LD_LIBRARY_PATH=$PWD/.gpubin:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
timeout 240 .gpubin/dz_tests "CUDA MXFP4 GEMM*" > $OUT/p222_t1.log 2>&1
echo rc_t1=$?
tail -4 $OUT/p222_t1.log
cd $OUT
timeout 300 /usr/local/cuda/bin/ncu --kernel-name-base mangled -k regex:mxfp4_gemm_kernelILi128EE --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section SchedulerStats --import-source no -o prof $OLDPWD/.gpubin/dz bench moe --tokens 16384 --fp8-gemm auto --reps 1 --no-components > ncu_run.log 2>&1
echo rc=$?
/usr/local/cuda/bin/ncu -i prof.ncu-rep --page details > details.txt 2>&1
/usr/local/cuda/bin/ncu -i prof.ncu-rep --page source --print-source sass --csv > source.csv 2>&1
rm -f prof.ncu-rep
grep -E "Duration|Issued Warp|Eligible Warps|SM Frequency" details.txt | head
