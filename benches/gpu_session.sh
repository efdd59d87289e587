#!/usr/bin/env bash
# A lent GPU session's measurements (issue 33), prepared: run it through benches/gpu_device.sh after its
# three staging calls (see benches/gpu_bundle.sh), each call within 30 s of the last:
#
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh bench" \
#       carry=[".gpu/p4", ".gpu/w", ".gpu/site_bytes"] timeout_s=590
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh suite" timeout_s=280
#
# bench (about 9 minutes, each step under its own time limit, everything into $OUT: 8 files at most come back):
#   1. python -m benches gpu: item 4 beside plain mlx-lm (1B, 3B), 10 needles at 8K (run 3: 20 needles
#      at 8K took 232 s, and the 3B was cut), the GPU actor's trace per geometry. Since run 3: short
#      passes attend with plain MLX operations by default (the batch's joins), an idle actor's save
#      copy stops between two layers for a new turn (run 3's cold 1K/4K turns waited behind copies);
#   2. python -m benches gpu_probe: as in run 3, plus the needle GGUF's forward at new lengths,
#      packed (float16) and unpacked: is MLX compiling its quantized kernels what made the needles slow?
#      And tiny-gpt-oss layer by layer with each block's input evaluated first, and with compile off;
#   3. the 1B's batch and cold 1K turns again with MLX_USE_CUDA_GRAPHS=0: every new batch makes new
#      graph topologies, and CUDA graphs are instantiated per topology. Do the 263 ms joins shrink?
# Since session 20 each report has a table of where decode steps' time went (launch / wait for the
# device / host / elsewhere, from the trace): printed after step 1 as well.
# suite: the test suite on the device (pytest -n 8), its log into $OUT; 150 s a test (run 3's 60 s
# stopped a first quantized-kernel compile and two tests that start servers in subprocesses).
set -u
out=${OUT:-/tmp/kvmem-out}
mkdir -p "$out"
case "${1:-bench}" in
  bench)
    timeout -s INT 370 python3 -m benches gpu --out "$out" --needle-model "$KVMEM_NEEDLE_GGUF" --needles 10 \
      --needle-lengths 8192 --deadline-s 350 > "$out/gpu.log" 2>&1
    echo "benches gpu: exit $?"; tail -n 25 "$out/gpu.log"
    # where decode steps' time went (the trace's StepTiming), in the call's own output too
    grep -A 12 "decode steps' time went" "$out/gpu.md" | head -n 40
    # full float32 products, as the suite runs (tests/conftest.py): MLX's CUDA default is TF32
    MLX_ENABLE_TF32=0 timeout -s INT 90 python3 -m benches gpu_probe > /tmp/probe.log 2>&1
    echo "gpu_probe: exit $?"; tail -n 12 /tmp/probe.log
    cp benches/results/gpu_probe.md "$out/probe.md"  # written before its last probe too: kept if that runs out of time
    # the report and trace only (8 files come back in all)
    MLX_USE_CUDA_GRAPHS=0 timeout -s INT 70 python3 -m benches gpu --geometries 1b --sizes 1024 --decode-sizes 1024 \
      --needles 0 --out /tmp/nographs > /tmp/nographs.log 2>&1
    echo "no CUDA graphs: exit $?"; cp /tmp/nographs/gpu.md "$out/nographs.md"; cp /tmp/nographs/trace_1b.json "$out/trace_nographs.json"
    grep -iE "batch|decode" /tmp/nographs.log | tail -n 8
    grep -A 12 "decode steps' time went" /tmp/nographs/gpu.md | head -n 20
    ;;
  suite)
    timeout -s INT 260 python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 --timeout 150 > "$out/suite.log" 2>&1
    echo "suite: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -n 40
    ;;
  *)
    echo "usage: gpu_session.sh bench|suite" >&2; exit 2 ;;
esac
