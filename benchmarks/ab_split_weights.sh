#!/usr/bin/env bash
# A/B on the H200 of the split-weight format change of issue 12 (round trip): the same tree with
# formats/split_weights.py as committed before the change (A) and as now (B). Per variant: the
# gradient-release peak-memory GPU test and the 16 x 2048^2 AdamW step (ordinary launches).
#   bash benchmarks/ab_split_weights.sh OUT
set -uo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
python -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
cp flash_inductor/formats/split_weights.py /tmp/split_weights_new.py
for variant in B A; do
  if [ "$variant" = A ]; then cp benchmarks/split_weights_before_issue12.py.txt flash_inductor/formats/split_weights.py; fi
  timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gradient_release.py 2>&1 | grep -v DEBUG | tail -5 \
    | tee "$out/ab_${variant}_gradient_release_h200.log"
  timeout 200 python benchmarks/optimizer_step.py --lists 16x2048x2048 --configs flashoptim \
    --out "$out/ab_${variant}_optimizer_step_h200.json" 2>&1 | grep -v "Warning\|warn" | tee "$out/ab_${variant}_optimizer_step_h200.log"
done
cp /tmp/split_weights_new.py flash_inductor/formats/split_weights.py
