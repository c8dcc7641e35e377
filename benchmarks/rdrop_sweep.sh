# The R-Drop sweep's device script (benchmarks/results/2026-11-27-h200-rdrop/NOTES.md): run
# from the repository root as `bash .m30k/go.sh`, .m30k/sweep.py being a copy of
# benchmarks/multi30k_sweep.py (its arms R, S, T). As run:
# call 1: GPU tests beside a 12-run R-Drop sweep under MPS; everything under $OUT in <= 8 files
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .m30k/whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi; lscpu | grep 'Model name'; python3 -c 'import torch; print(torch.__version__)'; git log -1 --format=%H 2>/dev/null; } > $OUT/env.txt 2>&1
nvidia-cuda-mps-control -d
(timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "rc=$?" >> $OUT/gpu_tests.log) &
ORDER="${ORDER:-R1 S1 T1 R2 S2 T2 R3 S3 T3 R4 S4 T4}" BUDGET_S=${BUDGET:-470} timeout ${HARD:-560} python3 .m30k/sweep.py /tmp/s ${WINDOW:-470} adapt
wait
tar czf $OUT/sweep.tgz --exclude='*.pt' --exclude=checkpoints -C /tmp s -C $PWD/.m30k runs
ls -la $OUT; cat $OUT/gpu_tests.log | tail -15
