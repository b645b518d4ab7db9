export FLASH_ATTN_EXT_HEAD_DIMS=64,128,256 FLASH_ATTN_EXT_CUDA_ARCHS=90a
bash bench/gpu_check.sh build > /dev/null || { echo BUILD FAILED; exit 1; }
cd tests && FAE_EXP_BWD=3 timeout 120 python3 -m pytest -m gpu -q -x -p no:cacheprovider test_sm90_bwd.py 2>&1 | tail -2; cd ..
for e in 0 1 2 3 0; do echo "== FAE_EXP_BWD=$e"; FAE_EXP_BWD=$e timeout 150 python3 bench/bench_attention.py --pass bwd --hdims 64,128 --backends ours,cudnn --seqlens 2048,8192,16384 --rounds 2 --no-roofline 2>/dev/null | grep -E "^bwd|geomean" | awk -F'|' '/geomean/{print;next}{print $4,$7,$9,$11,$12,$13}' | tee -a $OUT/exp.log; done
M="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for d in 64 128; do for be in ours cudnn; do timeout 120 ncu --clock-control none -k regex:"bprop|flash_bwd_sm90" --launch-count 1 --metrics "$M" --csv --page raw python3 bench/profile_attention.py --plain --pass bwd --backend $be --hdim $d --seqlen 4096 --warmup 0 --iters 1 2>/dev/null | sed "s/^/$be,$d,/" >> $OUT/ncu.csv; done; done
wc -l $OUT/ncu.csv
