# call B: lookahead / pair-ahead against main; the timeline probe; sanitizers on main
source .probe/common.sh   # the runner lives in .probe/ (git-ignored, carried): cp docs/experiments/runner/* .probe/
stamp start
build . main & build .trees/lookahead look & build .trees/pairahead pair & build .trees/probe probe & wait
stamp built
sxs . main all 110
sxs .trees/lookahead look all 110
sxs .trees/pairahead pair all 110
stamp sxs
(cd .trees/probe && PYTHONPATH=$ROOT/.trees/probe:/tmp/site timeout 90 python3 benchmarks/timeline_probe.py --anchors $ROOT/.anchors > $OUT/probe_main.log 2>&1; echo "probe rc=$?" >> $OUT/timeline.txt)
stamp probe
(PYTHONPATH=$ROOT:/tmp/site MEMCHECK_BACKENDS=cuda timeout 100 bash scripts/sanitize.sh > $OUT/sanitize_main.log 2>&1; echo "sanitize rc=$?" >> $OUT/timeline.txt)
stamp done
tail -n 1 $OUT/sxs_*.log; tail -n 6 $OUT/sanitize_main.log; tail -n 30 $OUT/probe_main.log
