#!/usr/bin/env bash
# The GPU check of issue #9, run by hand on the device machine (never by CI), as one prepared
# script of about 9 minutes. Here, first (see ../shared/reference/device.md):
#   echo /.devrun/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .devrun/whl soundfile cffi pycparser nvidia-nvimgcodec-cu12
#   python3 -m pip wheel -q --no-deps . -w .devrun/whl
# Then: run(command="bash .ci/gpu-check.sh", carry=[".devrun"], timeout_s=600)
set -uo pipefail
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg RECIPES_TUNE_DIR=/tmp/tune
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devrun/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
cd /tmp  # no source folders here: the installed package is the one imported
python3 -m recipes doctor > "$OUT/doctor.txt" 2>&1
timeout 120 python3 -m recipes bench vision --images 1600 --workers 8 2>&1 | tee "$OUT/bench_vision.txt"
timeout 360 python3 -m recipes bench train --domain vision --steps 60 --autotune --autotune-seconds 50 \
  --json "$OUT/train_vision.json" 2>&1 | tee "$OUT/train_vision.txt"
timeout 150 python3 -m recipes bench step --images 1600 2>&1 | tee "$OUT/bench_step.txt"
timeout 90 python3 -m recipes bench train --domain nlp --steps 60 --json "$OUT/train_nlp.json" 2>&1 | tee "$OUT/train_nlp.txt"
timeout 90 python3 -m recipes bench train --domain lm --steps 40 --json "$OUT/train_lm.json" 2>&1 | tee "$OUT/train_lm.txt"
timeout 90 python3 -m recipes bench train --domain audio --steps 40 --json "$OUT/train_audio.json" 2>&1 | tee "$OUT/train_audio.txt"
mkdir -p /tmp/gputests && cp -r "$OLDPWD/tests" "$OLDPWD/pyproject.toml" /tmp/gputests/
(cd /tmp/gputests && timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt")
