#!/usr/bin/env bash
# A lent GPU session's measurements (issue 33), prepared: run it through benches/gpu_device.sh after its
# three staging calls (see benches/gpu_bundle.sh), each call within 30 s of the last:
#
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh bench" \
#       carry=[".gpu/p4", ".gpu/w", ".gpu/site_bytes"] timeout_s=590
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh suite" timeout_s=280
#
# bench (about 9 minutes, each step under its own time limit, everything into $OUT):
#   1. python -m benches gpu: item 4 beside plain mlx-lm (1B, 3B), the needle rows (20 per length),
#      the GPU actor's trace per geometry (the turn's end now leaves its save's copy for later; the
#      batch decodes in runs of 16 steps per MLX job, decode_run_steps, since run 2's 0.71x / 0.78x);
#   2. python -m benches gpu_probe: attention alone at new shapes (fused against plain ops), a new
#      shape's first forward, tiny-gpt-oss twice and layer by layer against the CPU stream (which
#      block parts them: attention or the MoE block), one decode row per cache kind;
#   3. the 1B again (1K turns, the batch of 8, the restart) with --plain-attention-queries 64: short
#      passes (hot turns, a batch's join) attend with plain MLX operations, no cuDNN graph per shape.
#      Does the join stop costing 600-760 ms a round? If so, make it the GPU policy's default.
# suite: the test suite on the device (pytest -n 8), its log into $OUT.
set -u
out=${OUT:-/tmp/kvmem-out}
mkdir -p "$out"
case "${1:-bench}" in
  bench)
    timeout -s INT 390 python3 -m benches gpu --out "$out" --needle-model "$KVMEM_NEEDLE_GGUF" --needles 20 \
      --deadline-s 370 > "$out/gpu.log" 2>&1
    echo "benches gpu: exit $?"; tail -n 25 "$out/gpu.log"
    # full float32 products, as the suite runs (tests/conftest.py): MLX's CUDA default is TF32
    MLX_ENABLE_TF32=0 timeout -s INT 80 python3 -m benches gpu_probe > "$out/probe.log" 2>&1
    echo "gpu_probe: exit $?"; cp benches/results/gpu_probe.md "$out/" 2>/dev/null; grep -A12 "Attention alone" "$out/probe.log"
    mkdir -p "$out/plain"
    timeout -s INT 90 python3 -m benches gpu --geometries 1b --sizes 1024 --decode-sizes 1024 --needles 0 \
      --plain-attention-queries 64 --out "$out/plain" > "$out/plain/gpu.log" 2>&1
    echo "plain short passes: exit $?"; grep -iE "batch|hot|warm|FAIL|PASS" "$out/plain/gpu.log" | tail -n 16
    ;;
  suite)
    timeout -s INT 260 python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 --timeout 60 > "$out/suite.log" 2>&1
    echo "suite: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -n 40
    ;;
  *)
    echo "usage: gpu_session.sh bench|suite" >&2; exit 2 ;;
esac
