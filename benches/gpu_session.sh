#!/usr/bin/env bash
# A lent GPU session's measurements (issue 33), prepared: run it through benches/gpu_device.sh after its
# three staging calls (see benches/gpu_bundle.sh), each call within 30 s of the last:
#
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh bench" \
#       carry=[".gpu/p4", ".gpu/w", ".gpu/site_bytes"] timeout_s=540
#   run command="bash benches/gpu_device.sh go -- bash benches/gpu_session.sh suite" timeout_s=300
#
# bench (about 8 minutes, each step under its own time limit, everything into $OUT: 8 files at most come back:
# gpu.log, gpu.md, gpu.png, trace_1b.json, trace_3b.json, probe.md, settings.md (probe_3b.md until session 33)):
#   1. python -m benches gpu: item 4 beside plain mlx-lm (1B, then 3B: run 4 cut the 3B when the needle
#      rows went first), then 4 needles at 8K (run 5's 6 took 152 s: each trial's times are logged now, to find
#      why, before item 3's 20 a length can fit); the GPU actor's trace per geometry. Since run 4: the
#      cold table splits a turn's wait before admission (reached the actor / tokenized / admitted); an
#      overdue save copy waits for a prefill under way; a cache read from disk reaches the device by mx.load;
#      prompts are tokenized off the model's thread; the needle model's (and any model's) quantized projections
#      MLX's fast CUDA prefill kernel does not take are made float (run 4: 221 s for 10 needles at 8K);
#      Since run 4 too: each decode step's launch splits into building the graph in Python and MLX's
#      submit, with the model thread's CPU time over it (the step table: far below the launch, the thread
#      waited for the GIL or MLX's queue, not for work), and so does each prefill chunk's (a batch's
#      joint pass is one: its own table); a save's host copy reads a device copy, a part (at most 4 MiB of
#      one array) at a time, so a turn behind an idle copy waits for a part, not a layer (run 4's 1K turns
#      behind a 32K one waited 9-21 ms before admission); since session 23 the trace has a gc event per run of
#      Python's collector, a run event per decode run (its steps, why it ended) and the store's saves and reads,
#      tabulated per window: run 4's 4-12 ms gaps every 17-37 steps and its 2.6 vs 4 ms stretches are one of them,
#      or none; what a model load leaves is frozen out of full collections (runtime/heap.py);
#   2. python -m benches gpu_probe --gguf none, the sections still open (since run 5 the sdpa rows again, and with
#      the keys a slice of a longer buffer, as a cache hands them over: run 5's gpt-oss failures all attend over one) (run 4's GGUF rows did not finish), with
#      its new first rows: a save's host copy by either road, then the cache's next use on the device; and the
#      engine-alone decode rows now also on the runtime's MLX thread, quiet and posting to trio per step; and the
#      batch-of-8 attention row again with the keys one longer each call, as a decode's are (run 4's batch did better
#      with CUDA graphs off: a product whose captured kernels change with the length would build a graph a call);
#   (run 4's two tiny-gpt-oss failures are left to the suite: since run 4 loading a gpt-oss model on CUDA
#   turns MLX's compile off itself, runtime/model/cuda_compile.py, and the suite says whether that is enough;
#   the bench no longer spends 45 s of the 15 minutes on them first);
#   3. since run 5: the 3B's engine decode alone (no actors) beside mlx-lm, before and after a 32K turn and after
#      mx.clear_cache() (run 5's 3B decoded at 0.64-0.72x, faster in its first turn than after its 32K ones); run 5's
#      three tiny-gpt-oss failures down each road for the expert products (KVMEM_CUDA_MOE: unsorted, inputs
#      evaluated; runtime/model/cuda_moe.py), then with CUDA graphs off (which one they need)
#      (run 5's heap failure was Python 3.12's counting, reproduced and allowed for on the CPU since);
#   4. kvmem's short attention kernel (runtime/kv/short_attention.py, the short_attention_kernel setting, off by
#      default: a padded batch's decode steps, a hot turn's message and a batch's joins in one kernel a layer):
#      its tests on the device (against MLX's masked attention), then the 1B's batch and cold 1K turns with it on
#      (run 5: the batch of 8 made 4.38x one agent, 4.72x with CUDA graphs off; its masked attention had no fused
#      CUDA kernel); the probe's batch-attention rows time it beside the others;
#   5. since session 25: the bench pairs each cold turn of mlx-lm's with kvmem's on the same prompt, each from an
#      idle device, the order alternating by repeat (run 5 measured all of mlx-lm's first: one 1K turn of kvmem's
#      waited for the 32K turn before it, and its host ran 30% slower in some repeats); the probe's joint section
#      splits a batch's joint prefill pass (run 5: 32 ms of submit on the 1B, more than a 2048-token chunk) into
#      the rows' dequantization, their lining up, the pass over active rows, and one row's hot chunk, each piece
#      from an idle device (a CUDA wait inside the submit spins the host: its CPU time cannot tell work from wait);
#      the shapes section again (run 4's plain attention cost 4-9 ms at each new shape, 0.4-0.8 again, and every
#      hot turn is one), now also over the cache buffer's 256-token step with the tail masked (shapes that repeat
#      across turns) and in kvmem's kernel;
#   6. since session 26: the probe's gather section, tiny-gpt-oss's expert products alone by each road (unsorted,
#      sorted as mlx-lm sorts 64 or more (token, expert) pairs, the whole SwitchGLU; inputs lazy and evaluated first)
#      against the CPU stream: whether run 5's three gpt-oss failures are one of MLX's expert-product kernels;
#   7. since session 26: the needle model (SmolLM2-135M, small) loads with every quantized projection float on CUDA
#      (MLX compiles its quantized kernels at first use: run 5's 6 needles took 152 s), so each trial's logged
#      prefill and answer times say whether that was it; a batch's joins are tokenized in one hop and start in
#      one job; the first-token table
#      has each turn's checkout in its agent's actor (run 5's turns reached the GPU actor 5-7 ms after the send);
#      MLX's buffer cache is emptied once a prompt of several chunks has its first token, as mlx-lm's generate_step
#      does after each chunk (run 5's 3B steps slowed turn after turn; the 3B engine rows say whether this was it).
#   8. since session 27: the probe's joint section counts the operations each piece hands MLX's submit, beside
#      its times (submit µs an operation; the engine rows end with one decode step's, to read them against),
#      and runs the pass over kept float buffers as a hot round's is, and one row's chunk over a cache read ahead
#      (run 5: 13 ms of submit against a hot chunk's 5.6); and a products section: a layer's seven products at 1 to
#      2048 rows, the same shapes again and again (MLX cannot update a CUDA graph holding a kernel launched in a
#      cluster taller than one, and cuBLASLt's products of two or more rows are captured into it), then again in
#      processes without CUDA graphs and with graphs of up to 1000 operations (printed in the call's output): run 5's joint pass of 8 spent 29 ms in the submit against 5.6 for one
#      row's hot chunk; a per-operation cost near a decode step's says the pass is too big a graph, one far above
#      it says the submit waits or builds something (a CUDA graph, an allocation); the first-token table splits
#      the way from reaching the GPU actor to tokenized into rendering the chat, planning against the agent's
#      cache and tokenizing the rest (run 5's hot 16K turns: 4-6 ms of it).
#   9. since session 28: the products section also times a llama layer's seven products at the 1B's shapes beside
#      the four the fused_projections setting runs instead (MLX 0.32.1 builds each cuBLASLt product's CublasGemm
#      afresh: every product of two or more rows asks cuBLASLt for its algorithm again, host time a product), and
#      the 1B's turns and batch run once with --fused-projections, then once with the short attention kernel (two
#      repeats each; the two reports in settings.md), now right after the products: the 3B's engine rows and the
#      gpt-oss roads come last, where the call's time limit cuts first (the steps' limits add up to more than it).
#  10. since session 29: python -m benches gpu runs a pair of turns at each prompt size before its repeats, not
#      counted (run 5 counted each size's first turn, new shapes on both sides: mlx-lm's first 1K turn 430 ms against
#      18-21 after it, so a median of three was the slower of the other two); about 15 s more for both geometries.
#      The needle rows ask for item 3's whole set (20 needles at 8K, 4K, 2K, 1K) and stop between needles at the
#      deadline: the report names the lengths and formats cut short, and compares each format with float on the
#      needles it ran. The suite call writes its summary into the bench call's report (item 6: one gpu.md with
#      item 4, item 3's needles and the suite; `python -m benches gpu --suite-log FILE --into REPORT`) and returns it.
#  11. since session 30 (after run 6): fused projections and, on CUDA, the short attention kernel are the GPU policy's
#      defaults (run 6's products section: a 1B layer's four fused products submitted in 0.17 ms at 8 rows against the
#      seven's 0.26; the kernel's batch of 8 stepped in 3.5 ms against 6.6 through the masked fallback), the kernel
#      only for short passes over at most 2,048 keys (it took 1.31 ms a layer at 16K keys against plain operations'
#      0.51-0.58); so the settings runs now turn each off (--no-fused-projections, --no-short-attention-kernel) to say
#      what each buys. Each decoding turn on either side and each batch round records which threads ran during it
#      (/proc: run 6's kvmem cold steps cost the model's thread 3.5 ms of CPU against mlx-lm's 2.3 in the same
#      seconds, and 2.1 in kvmem's batch rounds later: the table says whether other threads or the hypervisor took
#      the cores). Code that builds caches without an engine no longer writes them through NumPy views on a GPU (run
#      6's two tiny-gpt-oss batch failures are such tests): the gpt-oss tests run alone first, on the default road.
#      The needle rows add Q8 at rest (derived from float's prefill as Q4's is; run 6: Q4 at rest lost 2 of float's
#      75 hits). A settings run with kvmem's small products kernel (runtime/model/small_products.py, off by default:
#      products of 2 to 16 rows in one kernel of kvmem's instead of cuBLASLt), its device tests, and its rows in the
#      probe's products section; the products' runs without CUDA graphs and with 1000-operation graphs are dropped.
#  12. since session 31: kvmem's two CUDA kernels are used only after a check at the model's load holds them to MLX's
#      results (else one warning line and MLX's way: grep the gpu.log for "check at load failed"); the small products
#      kernel is the GPU policy's default too (16-byte loads where the rows allow), so its settings run turns it off.
#      A save's host copy after a turn makes the kept floats' pending writes, so a hot turn's first pass (and a batch
#      of 8 hot rows' joint pass) no longer builds them; an agent arriving while another with its system prompt
#      decodes starts from that prompt (parked from the batch row then). The needle rows add Q4 in groups of 32 and,
#      as an experiment, keys in Q8 with values in Q4 (about 2 s a needle in all now: the deadline may cut 1K).
#      Since session 32 the keys-Q8 row is kvmem's own format (kv_key_bits 8), through the disk like the others,
#      and the GPU policy's default (the main run's turns save k8v4g64: 1.44x Q4's bytes, so a warm turn read at the
#      turn reads 1.44x more; the needle section says whether it kept every one of float's hits);
#      a finished batch row's park launches 12 operations a layer, not 24 (its float copy one pad, not a gather);
#      the probe's engine rows count one decode step's operations by kind, mlx-lm's beside kvmem's.
#      A lone row's short pass through plain operations (a hot turn over more than 2,048 keys) attends over its
#      cache's buffer up to the next 256 keys, the rest masked (run 6's probe: no new-shape cost across turns).
#      The threads table adds each busy thread's wait for a core, its minor page faults and the threads that last
#      shared a physical core. The kernels' device tests left the bench call (the suite call runs them).
#  13. since session 33: a hot turn's message over more than 2,048 keys (the 16K hot and warm rows) attends in the
#      short attention kernel's two passes (runtime/kv/short_attention.py long_attention: MLX's two-pass vector
#      kernel, the keys split over 32 blocks, a warp for a key head's whole query head group), once the load's
#      check_long_keys holds them to MLX's attention, where run 6 took plain operations (0.51-0.58 ms a 1B layer at
#      16 queries over 16K keys); grep the gpu.log for "over long keys is off". The probe's shapes rows time the two
#      passes beside the others, its batch-attention rows (now at 1K and 16K keys) for a padded step too (the runtime keeps steps on the one
#      pass until those rows say otherwise); the suite call runs the new device tests. The 3B's engine rows (probe_3b.md)
#      give their time to the 1B's whole plan again with glibc's allocator tuned as the CPU policy tunes it
#      (benches/gpu/gpu.py --keep-freed-memory): whether run 6's model thread, 1.6x slower in its cold turns than in its
#      batch rounds, was faulting its heap in again (the main run's threads table counts its faults). The whole plan:
#      run 6's settings runs (1K turns alone) decoded at par with mlx-lm, the main run's cold turns between 4K, 16K
#      and 32K ones at 0.60x. Then the whole plan once more with the process kept to one logical CPU of each physical
#      core (--one-cpu-a-core): whether the model thread shared a core with a busy hyperthread (its steps took 2.0-2.2
#      ms in some turns, 3.5-3.8 in others). Those two take the time of the settings runs with fused projections and
#      the short attention kernel off, which run 6 measured against the other road already. The main run repeats
#      its cold pairs 4 times, not 3: each side first as often as second (run 6: the order mattered).
# suite: the test suite on the device (pytest -n 8 --dist loadfile, as .ci/test), its log into $OUT; 150 s a test (run 3's 60 s
# stopped a first quantized-kernel compile and two tests that start servers in subprocesses). 285 s in all (run 5's
# took 254 s, and the suite has grown since): since session 29 the bench call gives it 20 s of its 560.
set -u
out=${OUT:-/tmp/kvmem-out}
mkdir -p "$out"
case "${1:-bench}" in
  bench)
    # geometries first (1B, 3B), then item 3's 20 needles at 8K, 4K, 2K, 1K with what is left (run 4: 10 needles took
    # 221 s, run 5: 6 took 152 s, before the needle model's projections were made float on CUDA): since session 29
    # no needle starts past the deadline, so the rows hold what ran, and a needle under way (25 s at run 5's pace)
    # ends within the limit; the probes after it grew since run 5 and the call has 540 s in all
    timeout -s INT 330 python3 -m benches gpu --out "$out" --needle-model "$KVMEM_NEEDLE_GGUF" --needles 20 \
      --needle-lengths 8192 4096 2048 1024 --deadline-s 280 > "$out/gpu.log" 2>&1
    echo "benches gpu: exit $?"; tail -n 25 "$out/gpu.log"
    grep -h "check at load failed" "$out/gpu.log" | sort | uniq -c | head -n 4  # a kernel of kvmem's left off
    mkdir -p /tmp/kvmem-report && cp "$out/gpu.md" /tmp/kvmem-report/ 2>/dev/null  # the suite call adds its summary
    # where decode steps' time went (the trace's StepTiming), in the call's own output too
    grep -A 12 "decode steps' time went" "$out/gpu.md" | head -n 40
    grep -A 20 "first tokens went" "$out/gpu.md" | head -n 40
    grep -A 12 "prefill chunks' time went" "$out/gpu.md" | head -n 30
    grep -A 12 "decode runs ended" "$out/gpu.md" | head -n 30
    grep -A 12 "collector during" "$out/gpu.md" | head -n 30
    grep -A 12 "disk jobs that ended" "$out/gpu.md" | head -n 30
    # full float32 products, as the suite runs (tests/conftest.py): MLX's CUDA default is TF32. No GGUF rows:
    # run 4 answered them (the needle GGUF's first forward at 1000 tokens did not end in a minute).
    # only the probes still open (run 4 answered the fused attention's accuracy, tiny-gpt-oss's layers and the
    # attention shapes): run 4's whole probe took 54 s, and the engine rows come last
    MLX_ENABLE_TF32=0 timeout -s INT 100 python3 -m benches gpu_probe --gguf none \
      --sections host-copy sdpa gather shapes products batch-attention decode-row engine joint > /tmp/probe.log 2>&1
    echo "gpu_probe: exit $?"; tail -n 12 /tmp/probe.log
    cp benches/results/gpu_probe.md "$out/probe.md"
    # the 1B's decode (run 6: 0.60x mlx-lm at 1K, its cold turns' steps 2.9-3.8 ms of the model thread's CPU against
    # 2.0-2.2 in its batch rounds after mlx-lm left): the main run's whole 1B plan again (the slowdown showed there,
    # not in run 6's settings runs of 1K turns alone, whose kvmem decoded at 405-449 tokens/s against mlx-lm's
    # 372-476), with glibc's allocator tuned as the CPU policy tunes it (freed memory kept, one arena: the model
    # thread no longer faults its heap in again), against the main run's threads table (the model thread's minor
    # faults). Since session 33 in place of the 3B's engine rows (run 6's 3B decoded at 1.02x mlx-lm)
    timeout -s INT 80 python3 -m benches gpu --geometries 1b --needles 0 --keep-freed-memory --out /tmp/alloc \
      > /tmp/alloc.log 2>&1
    echo "allocator tuned: exit $?"; cat /tmp/alloc/gpu.md >> "$out/settings.md"
    grep -iE "batch|decode" /tmp/alloc.log | tail -n 8; grep -A 12 "decode steps' time went" /tmp/alloc/gpu.md | head -n 12
    # the other half of the 1B's decode question: the whole plan again with the process kept to one logical CPU of
    # each physical core (benches/gpu/gpu.py --one-cpu-a-core): run 6's model thread stepped in 2.0-2.2 ms in some turns
    # and 3.5-3.8 in others, its CPU time itself grown, as a thread's is beside a busy hyperthread of its core (the
    # main run's threads table names the threads that last shared one). Since session 33 in place of the settings runs
    # with fused projections and the short attention kernel off: run 6 measured each against the other road already
    # (its main run had both off, its settings runs each on)
    timeout -s INT 80 python3 -m benches gpu --geometries 1b --needles 0 --one-cpu-a-core --out /tmp/cores \
      > /tmp/cores.log 2>&1
    echo "one cpu a core: exit $?"; cat /tmp/cores/gpu.md >> "$out/settings.md"
    grep -iE "cpus:|batch|decode" /tmp/cores.log | tail -n 8; grep -A 12 "decode steps' time went" /tmp/cores/gpu.md | head -n 12
    # (the kernels' device tests run in the suite call: since session 31 each model load also checks its kernels)
    # kvmem's small products kernel (runtime/model/small_products.py, on by default since session 31 once the load's
    # check holds it to MLX's product): a batch's steps and a hot turn's message without cuBLASLt's host cost a
    # product (run 6: about 37 µs of submit a product of 2+ rows, 11 for one); here turned off, to say what it buys
    timeout -s INT 40 python3 -m benches gpu --geometries 1b --sizes 1024 --decode-sizes 1024 --needles 0 --repeats 2 \
      --no-small-products-kernel --out /tmp/small > /tmp/small.log 2>&1
    echo "small products kernel off: exit $?"; cat /tmp/small/gpu.md >> "$out/settings.md"
    grep -iE "batch|decode" /tmp/small.log | tail -n 8; grep -A 12 "decode steps' time went" /tmp/small/gpu.md | head -n 12
    # run 5's three tiny-gpt-oss failures (compile off was not enough; float32, so not cuDNN's attention) down each
    # of runtime/model/cuda_moe.py's roads for the expert products, then with CUDA graphs off
    # (run 6: the three roads passed alone, and the suite's default road failed two batch tests: the default alone first;
    # an empty KVMEM_CUDA_MOE is the default road)
    for env in KVMEM_CUDA_MOE= KVMEM_CUDA_MOE=unsorted KVMEM_CUDA_MOE=inputs-evaluated MLX_USE_CUDA_GRAPHS=0; do
      echo "tiny-gpt-oss with $env:"; env "$env" timeout -s INT 30 python3 -m pytest -q -p no:benchmark -p no:cacheprovider \
        tests/kv/test_cache_correctness.py -k "gpt-oss and (suffix or warm_cache or batched)" 2>&1 | tail -n 3
    done
    ;;
  suite)
    timeout -s INT 285 python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 --dist loadfile --timeout 150 > "$out/suite.log" 2>&1
    echo "suite: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -n 40
    # the bench call's report (kept in /tmp while the machine stays warm) with this suite's summary (item 6)
    if [ -f /tmp/kvmem-report/gpu.md ]; then
      python3 -m benches gpu --suite-log "$out/suite.log" --into /tmp/kvmem-report/gpu.md && cp /tmp/kvmem-report/gpu.md "$out/"
    fi
    ;;
  *)
    echo "usage: gpu_session.sh bench|suite" >&2; exit 2 ;;
esac
