export FLASH_ATTN_EXT_HEAD_DIMS=64,128,256 FLASH_ATTN_EXT_CUDA_ARCHS=90a
bash bench/gpu_check.sh build > /dev/null || { echo BUILD FAILED; exit 1; }
cd tests && FAE_EXP_BWD=5 timeout 120 python3 -m pytest -m gpu -q -x -p no:cacheprovider test_sm90_bwd.py 2>&1 | tail -2; cd ..
for e in 1 5 0 4 5 1; do echo "== FAE_EXP_BWD=$e"; FAE_EXP_BWD=$e timeout 150 python3 bench/bench_attention.py --pass bwd --hdims 64,128,256 --backends ours,cudnn --seqlens 2048,8192,16384 --causal 0,1 --rounds 2 --no-roofline 2>/dev/null | grep -E "^bwd|geomean" | awk -F'|' '/geomean/{print;next}{print $4,$7,$9,$11,$12,$13}' | tee -a $OUT/exp.log | tr '\n' ';'; echo; done
