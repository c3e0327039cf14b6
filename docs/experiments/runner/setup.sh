#!/usr/bin/env bash
# Prepares the device runner in this checkout (run from the repository root, on the CPU machine):
#   .whl/     the nvidia-cutlass wheel for the device's Python 3.12 (CUTLASS headers; the device has no internet)
#   .anchors/ the referee (../shared/anchors)
#   .trees/   each candidate as a plain export: main with docs/experiments/NAME.patch applied (git am), or
#             main with the discard commit reverted (nodiscard)
#   .probe/   these scripts
# All four are git-ignored; name them in the run's carry: [".whl", ".anchors", ".probe", ".trees"].
# Then: run `bash .probe/call_a.sh`, later `bash .probe/call_b.sh` (each well under the 600 s limit).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.whl/ /.anchors/ /.probe/ /.trees/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .anchors .probe .trees
ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl nvidia-cutlass==4.2.0.0
cp ../shared/anchors/* .anchors/
cp docs/experiments/runner/common.sh docs/experiments/runner/call_*.sh .probe/

export_tree() {  # export_tree NAME COMMAND...: main plus the commits COMMAND makes, in a scratch branch
  local name=$1; shift
  git branch -f "runner/$name" HEAD >/dev/null
  git checkout -q "runner/$name"
  "$@" >/dev/null
  rm -rf ".trees/$name" && mkdir -p ".trees/$name" && git archive HEAD | tar -x -C ".trees/$name"
  git checkout -q -
  git branch -q -D "runner/$name"
}
tmp=$(mktemp -d)
cp docs/experiments/*.patch "$tmp"/
export_tree lookahead git am -q "$tmp/lookahead.patch"
export_tree pairahead git am -q "$tmp/lookahead.patch" "$tmp/pair-ahead.patch"
export_tree probe git am -q "$tmp/timeline-probe.patch"
export_tree barrier git am -q "$tmp/discard-after-barrier.patch"
export_tree nodiscard git revert --no-edit 0a55f06
rm -rf "$tmp"
du -sh .whl .anchors .trees
