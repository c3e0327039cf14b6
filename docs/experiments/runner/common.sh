# sourced by the call scripts: wheel install, build helper
set -u
export PYTHONUNBUFFERED=1 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/timeline.txt; }
build() {  # build TREE NAME
  (cd $1 && PYTHONPATH=/tmp/site python3 setup.py build_ext --inplace > $OUT/build_$2.log 2>&1; echo "build $2 rc=$?" >> $OUT/timeline.txt)
}
sxs() {  # sxs TREE NAME WHAT [TIMEOUT_S]
  (cd $ROOT/.anchors && PYTHONPATH=$ROOT/$1:/tmp/site timeout ${4:-300} python3 sxs.py --only $3 --csv $OUT/sxs_$3_$2.csv > $OUT/sxs_$3_$2.log 2>&1; echo "sxs $3 $2 rc=$?" >> $OUT/timeline.txt)
}
