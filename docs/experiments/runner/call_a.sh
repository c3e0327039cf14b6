# call A: the discard (main vs without it vs after a barrier); GPU tests on main and on the barrier tree
source .probe/common.sh   # the runner lives in .probe/ (git-ignored, carried): cp docs/experiments/runner/* .probe/
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv > $OUT/gpu.txt
stamp start
build . main & build .trees/nodiscard nodisc & build .trees/barrier barrier & wait
stamp built
(PYTHONPATH=$ROOT:/tmp/site timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_flash_mla.py tests/test_gpu_hardening.py > $OUT/pytest_main.log 2>&1; echo "pytest main rc=$?" >> $OUT/timeline.txt)
stamp pytest-main
sxs . main all 110
sxs .trees/nodiscard nodisc all 110
sxs .trees/barrier barrier all 110
sxs . main2 beyond 50
stamp sxs
(cd .trees/barrier && PYTHONPATH=$ROOT/.trees/barrier:/tmp/site timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_flash_mla.py > $OUT/pytest_barrier.log 2>&1; echo "pytest barrier rc=$?" >> $OUT/timeline.txt)
stamp done
tail -n 1 $OUT/sxs_*.log; tail -n 1 $OUT/pytest_*.log
