#!/usr/bin/env bash
# One batched GPU session on the H200 (through the device tool): set up, then run the
# named steps, each under its own time limit, logging to $OUT. Usage:
#   bash scripts/h200.sh kernels store tests-gpu ttft ...
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "== $(date +%T) $*"; }

# The package in .base (a git archive of an older tree) installed into /tmp/base, and
# /tmp/base.sh, which runs a command with it in a folder holding the benchmarks given
# (.base/benchmarks: the older tree's own; benchmarks: this tree's, interleaved calls).
use_base() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/base ./.base >"$OUT/base-install.log" 2>&1 || tail -5 "$OUT/base-install.log"
  rm -rf /tmp/bwd && mkdir -p /tmp/bwd && cp -r "$1" /tmp/bwd/
  printf '#!/bin/sh\ncd /tmp/bwd && export PYTHONPATH="/tmp/base${PYTHONPATH:+:$PYTHONPATH}" && exec "$@"\n' >/tmp/base.sh && chmod +x /tmp/base.sh
}

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  # The package maps server/ into cacheseek.server: install it (no network there).
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
  python3 -c "import torch, triton, cacheseek.kernels; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
}

# BUDGET=SECONDS caps the whole run (the device tool's per-call limit): a step starts only
# with 45 s left, under whichever limit is shorter, so what finished still comes back.
T0=$(date +%s)
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  if [ -n "${BUDGET:-}" ]; then
    local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
    if [ "$left" -lt 45 ]; then log "$name skipped (budget spent)"; return; fi
    if [ "$left" -lt "$secs" ]; then secs=$left; fi
  fi
  log "$name (limit ${secs}s)"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  log "$name rc=$rc"
}

setup
for s in "$@"; do
  case $s in
    kernels)     step kernels 150 python3 -m benchmarks.kernels --out "$OUT" ;;
    sweep)       step sweep 200 python3 -m benchmarks.kernels --quick --sweep --out /tmp/sweep ;;
    sweep-v)     step sweep-v 240 python3 -m benchmarks.kernels --sweep-v --out "$OUT" ;;
    # V quantize with KIVI's range search (v_clip 0/1/2/3/6): GB/s against plain min/max, bit-exactness on the GPU.
    kernels-clip) step kernels-clip 200 python3 -m benchmarks.kernels --clip --out "$OUT" ;;
    # KIVI's V rotation (v_rotate: signed Hadamard in torch around the V kernels): encode/decode cost against
    # the plain kernels and codec, codes and decodes equal to the torch reference on the GPU (exact column).
    kernels-rotate) step kernels-rotate 240 python3 -m benchmarks.kernels --rotate --out "$OUT" ;;
    # v_rotate's tests natively (kernels compiled): the codec, the layer-table, paged and layer-wise paths.
    tests-rotate) step tests-rotate 300 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_kivi_rotate.py tests/test_paged.py tests/test_layerwise.py -k "rot" ;;
    breakdown)   step breakdown-int4 90 python3 -m benchmarks.store_breakdown --codec int4 --profile --out "$OUT/breakdown"
                 step breakdown-raw 90 python3 -m benchmarks.store_breakdown --codec raw --profile --out "$OUT/breakdown" ;;
    host)        step host-int4 90 python3 -m benchmarks.store_breakdown --codec int4 --reps 2 --host --out "$OUT/host"
                 step host-raw 90 python3 -m benchmarks.store_breakdown --codec raw --reps 2 --host --out "$OUT/host" ;;
    trace)       step trace-int4 90 python3 -m benchmarks.store_breakdown --codec int4 --reps 2 --trace /tmp/trace --out "$OUT/trace"
                 step trace-raw 90 python3 -m benchmarks.store_breakdown --codec raw --reps 2 --trace /tmp/trace --out "$OUT/trace" ;;
    store-quick) step store-quick 150 python3 -m benchmarks.store --codecs raw,int4 --tiers gpu,cpu --reps 8 --out /tmp/sq
                 cp /tmp/sq/store.json "$OUT/store_16blocks_raw_int4.json" ;;
    store-64)    step store-64 150 python3 -m benchmarks.store --blocks 64 --codecs raw,int4 --tiers cpu --reps 6 --out /tmp/s64
                 cp /tmp/s64/store.json "$OUT/store_64blocks.json" ;;
    batch-bytes) for b in 1GiB 256MiB 128MiB; do
                   step batch-$b 80 python3 -m benchmarks.store --codecs raw,int4 --tiers gpu,cpu --reps 4 --batch-bytes $b --out /tmp/b$b
                 done ;;
    paged)       step paged 240 python3 -m benchmarks.store --paged --blocks 16,64 --codecs raw,int4 --reps 6 --out "$OUT" ;;
    # DeepSeek-V3's MLA latent pages (cs.KVPages.mla, pages of 64) against the same latents contiguous.
    paged-mla)   step paged-mla 240 python3 -m benchmarks.store --paged --mla --blocks 16,64 --codecs raw,int8 --reps 6 --out "$OUT" ;;
    batches)     step batches 200 python3 -m benchmarks.store --batches --codecs raw,int4 --reps 6 --out "$OUT" ;;
    # The eviction policies' cost on the hot path (issue 19: ARC within 2% of LRU): a full CPU tier per
    # policy, fresh prompts, calls taking turns.
    policies)    step policies 200 python3 -m benchmarks.store --fresh --policy arc,lru --blocks 16,64 --codecs raw,int4 --reps 10 --out "$OUT" ;;
    fresh)       step fresh 240 python3 -m benchmarks.store --fresh --blocks 16,64 --codecs raw,int4 --reps 8 --out "$OUT" ;;
    # Layer-wise saves (each layer into reserved CPU-tier slots through kernels.store_ranges) against a whole
    # ingest after a stand-in forward of GEMMs; and their tests natively.
    layerwise-save) step layerwise-save 400 python3 -m benchmarks.layerwise_save --programs 2,4,16 --out "$OUT" ;;
    layerwise-save-paged) step layerwise-save-paged 300 python3 -m benchmarks.layerwise_save --paged --out "$OUT" ;;
    tests-save)  step tests-save 240 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_copy_ranges.py tests/test_layerwise.py -k "ranges or save or ingest_layerwise or prefill" ;;
    # Direct launches (cacheseek/kernels/launch.py): bit-exact against Triton's path and the reference, then the kernels and in-place ingest.
    tests-launch) step tests-launch 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernel_launch.py tests/test_kernels.py tests/test_ingest_in_place.py tests/test_paged_kernels.py ;;
    fresh-host)  step fresh-host 150 python3 -m benchmarks.store_breakdown --codec int4 --reps 3 --host --fresh --out "$OUT/fresh-host" ;;
    # A chain under a precision policy (first block int8) vs the uniform low-bit codec: ingest and materialize ratio.
    mixed)       step mixed 150 python3 -m benchmarks.store --mixed --blocks 16 --reps 8 --tiers gpu,cpu --out "$OUT" ;;
    # A precision policy's chain vs the uniform codec's: device time of encode and decode (16 and 64 blocks).
    kernels-mixed) step kernels-mixed 200 python3 -m benchmarks.kernels --mixed --out "$OUT" ;;
    # A pinned CPU tier's first fill (each new chunk page-locked inside an ingest) against a refill.
    first-fill)  step first-fill 200 python3 -m benchmarks.first_fill --gib 8 --blocks 64 --out "$OUT" ;;
    # Precision policies natively: mixed chains through every tier and the decoders' shared staging.
    tests-policy) step tests-policy 200 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_policy.py tests/test_encode_decode.py tests/test_device_staging.py ;;
    mixed-64)    step mixed-64 200 python3 -m benchmarks.store --mixed --blocks 64 --reps 8 --tiers gpu,cpu --out /tmp/m64
                 cp /tmp/m64/store_mixed.json "$OUT/store_mixed_64.json" ;;
    store)       step store 240 python3 -m benchmarks.store --codecs raw,int8,int4,int2 --reps 4 --disk-dir /tmp --out "$OUT" ;;
    tests-gpu)   step tests-gpu 420 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_paged_kernels.py tests/test_paged.py tests/test_store.py tests/test_encode_decode.py tests/test_ingest_in_place.py tests/test_streams.py ;;
    # Every test file with CUDA-only cases (those CI skips on its CPU box), without -x; not the slow model tests.
    # Four workers, a file to each (pytest-xdist from .whl): on one process it ran past the device's
    # 10-minute call on an H100.
    tests-cuda)  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >"$OUT/whl-install.log" 2>&1
                 step tests-cuda 560 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 -m "not slow" -n 4 --dist loadfile --durations=15 tests/test_device_staging.py tests/test_drain.py tests/test_ingest_in_place.py tests/test_kernel_launch.py tests/test_kernels.py tests/test_kivi_rotate.py tests/test_layerwise.py tests/test_pins.py tests/test_policy.py tests/test_remote.py tests/test_streams.py tests/test_suffix_attention.py tests/test_threads.py tests/test_vllm_pages.py tests/test_write_behind.py tests/test_paged.py tests/test_paged_kernels.py ;;
    # fp8 KV (Raw, bytes moved by the copy kernels) natively: pages, layer-wise, tiers.
    tests-fp8)   step tests-fp8 200 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_fp8.py tests/test_kernels.py -k "fp8 or sm90" ;;
    tests-native) step tests-native 480 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 -m "not slow" tests/test_paged_kernels.py tests/test_paged.py tests/test_paged_contract.py tests/test_kernels.py tests/test_ingest_in_place.py tests/test_streams.py tests/test_capacity.py tests/test_pins.py tests/test_vllm_pages.py tests/test_encode_decode.py tests/test_store.py tests/test_kernel_backend.py tests/test_layerwise.py tests/test_policy.py ;;
    # Not the slow model tests: the H200 machine has no network to fetch SmolLM2 (CI runs them).
    # The whole suite but its slow files, 8 workers. Its servers run `cacheseek serve` in
    # subprocesses that see the interpreter's own site-packages only, so the wheels in .whl go
    # there (the server extra's, with httptools and uvicorn 0.54 for Python 3.12, and
    # pytest-xdist, trustme, jsonschema, websocket-client). Without redis-server,
    # kubernetes-validate or chromium on the image, their tests skip or fail to import.
    tests-all)   python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >"$OUT/whl-install.log" 2>&1
                 step tests-all 560 python3 -m pytest -q -ra -p no:cacheprovider --timeout 300 -m "not slow" -n 8 tests/ ;;
    tests-new)   step tests-new 180 python3 -m pytest -q -ra -p no:cacheprovider --timeout 60 -m "not slow" tests/test_layerwise.py tests/test_policy.py tests/test_leases.py tests/test_threads.py tests/test_suffix_attention.py tests/test_copy_ranges.py tests/test_kivi_clip.py tests/test_device_staging.py ;;
    # prefill_with_reuse on a tiny Llama spread over the GPU and the CPU by accelerate (needs
    # accelerate and psutil wheels in .whl).
    tests-device-map) step tests-device-map 150 python3 -m pytest -q -ra -p no:cacheprovider tests/test_transformers_integration.py -k "spread_over_devices or device_map" ;;
    tests-paged) step tests-paged 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_paged_kernels.py tests/test_paged.py ;;
    streams)     step streams 60 python3 -m benchmarks.streams --out "$OUT" ;;
    # A remote save from vLLM's pages: the caller's wait with wait=True against wait=False (loopback server).
    write-behind) step write-behind 240 python3 -m benchmarks.write_behind --tokens 4096,16384 --codecs int4,raw --reps 5 --out "$OUT" ;;
    # The background writes' tests with the KV on the GPU (frames copied to host memory within the call).
    tests-behind) step tests-behind 200 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_write_behind.py tests/test_vllm_pages.py ;;
    # Leased device staging (store/device_staging.py) against a plain buffer per use (a pool of
    # cap 0): host us per buffer, and ingest / materialize of 16 and 64 blocks through the CPU tier.
    device-staging) step device-staging-16 150 python3 -m benchmarks.device_staging --blocks 16 --out "$OUT/ds16"
                 step device-staging-64 200 python3 -m benchmarks.device_staging --blocks 64 --reps 5 --out "$OUT/ds64" ;;
    tests-fast)  step tests-fast 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_ingest_in_place.py tests/test_store.py tests/test_encode_decode.py tests/test_kernels.py -k "not test_matches_reference and not sm90 and not fp32_stats" ;;
    tests-store) step tests-store 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_store.py tests/test_encode_decode.py tests/test_ingest_in_place.py tests/test_remote.py ;;
    tests-all)   step tests-all 420 python3 -m pytest -q -p no:cacheprovider -m "not slow" ;;
    # RemoteCache with the KV on the GPU: host buffers kept (page-locked) against fresh ones per frame,
    # and the HTTP transports on loopback (needs the server wheels).
    client)      step client 240 python3 -m benchmarks.client --device cuda --frames 16 --reps 5 --out "$OUT" ;;
    ttft)        step ttft 420 python3 -m benchmarks.ttft --out "$OUT" ;;
    # Layer-wise reuse from the CPU tier against the plain one, int4, 16K and 32K, with the
    # per-layer timeline (load ready vs compute); goal 12x at 16K, 16x at 32K.
    ttft-layerwise) step ttft-layerwise 400 python3 -m benchmarks.ttft --contexts 16384,32768 --tiers gpu,cpu,cpu-layerwise --codecs int4 --timeline --repeats 5 --out /tmp/ttft-lw
                 cp /tmp/ttft-lw/ttft.json "$OUT/ttft_layerwise.json" ;;
    # The same cells under transformers' own sdpa attention (a mask and repeated K/V heads
    # for the suffix): what the suffix attention changes.
    ttft-sdpa)   step ttft-sdpa 300 python3 -m benchmarks.ttft --contexts 16384,32768 --tiers gpu,cpu,cpu-layerwise --codecs int4 --repeats 5 --attention sdpa --out /tmp/ttft-sdpa
                 cp /tmp/ttft-sdpa/ttft.json "$OUT/ttft_sdpa.json" ;;
    # Layer-wise rows under the other ways of issuing the later layer groups (the default,
    # eager, is in ttft-layerwise): a thread of the load's own, and lazily from the waits.
    ttft-issue)  for mode in background lazy; do
                   step ttft-issue-$mode 200 python3 -m benchmarks.ttft --contexts 16384,32768 --tiers cpu-layerwise --codecs int4 --timeline --repeats 5 --layerwise-issue $mode --out /tmp/ttft-$mode
                   cp /tmp/ttft-$mode/ttft.json "$OUT/ttft_layerwise_$mode.json"
                 done
                 step ttft-copies 200 python3 -m benchmarks.ttft --contexts 16384,32768 --tiers cpu-layerwise --codecs int4 --timeline --repeats 5 --layerwise-copies --out /tmp/ttft-copies
                 cp /tmp/ttft-copies/ttft.json "$OUT/ttft_layerwise_copies.json" ;;
    # Kernel loads/stores on pinned host memory against the copy engine.
    host-access) step host-access 150 python3 -m benchmarks.host_access --ranges --mb 256 --blocks 4096 --out "$OUT" ;;
    # Host time of a layer-wise load until its handle (the gap before the forward's layer 0),
    # 16K and 32K tokens, int4 from the CPU tier; then the TTFT rows with the timeline again.
    layerwise-host) step layerwise-host-16k 200 python3 -m benchmarks.layerwise_host --device cuda --blocks 64 --repeats 9 --out "$OUT/lwh16k"
                 step layerwise-host-32k 250 python3 -m benchmarks.layerwise_host --device cuda --blocks 128 --repeats 9 --out "$OUT/lwh32k" ;;
    layerwise-profile) step layerwise-profile 150 python3 -m benchmarks.layerwise_host --device cuda --blocks 64 --repeats 5 --profile --out "$OUT/lwh-profile" ;;
    suffix-attention) step suffix-attention 300 python3 -m benchmarks.suffix_attention --out "$OUT" ;;
    ttft-quick)  step ttft 300 python3 -m benchmarks.ttft --quick --out "$OUT" ;;
    server)      step server 240 python3 -m benchmarks.server --out "$OUT" ;;
    redis)       step redis 240 python3 -m benchmarks.redis_tier --out "$OUT" ;;
    # The cost of the server's own counting, on a quiet host (CPU only; needs the server wheels)
    metrics)     step metrics-cost 200 python3 -m benchmarks.metrics_cost --calls 3000 --rounds 10 --out "$OUT"
                 step server-metrics 400 python3 -m benchmarks.server --frames 24 --reps 5 --compare-metrics --out "$OUT" ;;
    # The disk tier against the disk (cold reads vs sequential O_DIRECT and dd; group commit vs
    # one commit per frame), 64 blocks = 16K tokens per codec; drop_caches on this machine only.
    disk)        step disk 300 python3 -m benchmarks.disk --blocks 64 --codecs raw,int4,int2 --reps 3 --disk-dir /tmp --drop-caches --out "$OUT" ;;
    # The Redis tier with decode on the GPU: Debian's redis-server unpacked from .debs
    # (scripts/fetch_redis_debs.sh, carried by the lead) into /tmp/redis; needs the redis wheel.
    redis-gpu)   url=$(bash scripts/redis_from_debs.sh /tmp/redis 6390 | tail -n 1)
                 step redis-gpu 240 python3 -m benchmarks.redis_tier --url "$url" --device cuda --blocks 16 --reps 5 --out "$OUT"
                 kill "$(cat /tmp/redis/redis.pid)" 2>/dev/null ;;
    # TTFT at 16K from a cold disk tier and with a prefetch 200 ms ahead (int4, int2; Raw for reference)
    ttft-disk)   step ttft-disk 420 python3 -m benchmarks.ttft --contexts 16384 --tiers cpu,disk,disk-prefetch --codecs raw,int4,int2 --disk-path /tmp/ttft-disk --out /tmp/ttft-disk-out
                 cp /tmp/ttft-disk-out/ttft.json "$OUT/ttft_disk.json" ;;
    tests-capacity) step tests-capacity 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_capacity.py tests/test_crash.py ;;
    pins-gpu)    step pins-gpu 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_pins.py ;;
    vllm-pages)  step vllm-pages 420 python3 -m benchmarks.vllm_pages --tokens 4096,16384 --codecs raw,int4 --requests 1,8 --reps 5 --out "$OUT" ;;
    tests-vllm-save) step tests-vllm-save 200 python3 -m pytest -q -ra -p no:cacheprovider --timeout 120 tests/test_vllm_pages.py -k "layerwise" ;;
    tests-vllm)  step tests-vllm 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_vllm_pages.py ;;
    # The connector's layer-wise loads on the GPU: the tests (event waits on the forward's
    # stream, same bytes as a whole load), then int4 at 4K and 16K tokens: the layer-wise load
    # alone and under a stand-in forward, against the whole load then the forward.
    vllm-layerwise) step tests-vllm-layerwise 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_vllm_pages.py tests/test_layerwise.py -k "layerwise_step or layerwise_load or from_start or never_waited"
                 step vllm-layerwise 300 python3 -m benchmarks.vllm_pages --tokens 4096,16384 --codecs int4 --requests 1,8 --reps 5 --out "$OUT" ;;
    # Fresh-prompt ingest (store --fresh, int4, 16 and 64 blocks) before (.base) and after, alternating.
    fresh-ab)    use_base .base/benchmarks
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-fresh-$r 120 /tmp/base.sh python3 -m benchmarks.store --fresh --blocks 16,64 --codecs int4 --reps 10 --out "$OUT/before-fresh-$r"
                   step after-fresh-$r 120 python3 -m benchmarks.store --fresh --blocks 16,64 --codecs int4 --reps 10 --out "$OUT/after-fresh-$r"
                 done ;;
    # The kernels benchmark under the package in .base and under this tree, alternating (a kernel
    # change's cost measured against its own machine's noise).
    kernels-ab)  use_base .base/benchmarks
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-kernels-$r 120 /tmp/base.sh python3 -m benchmarks.kernels --out "$OUT/before-kernels-$r"
                   step after-kernels-$r 120 python3 -m benchmarks.kernels --out "$OUT/after-kernels-$r"
                 done ;;
    # MLA latent pages (16 blocks: a full tier whose reserve holds one call) under the package in
    # .base and under this tree, alternating; both run this tree's benchmark.
    paged-mla-ab) use_base benchmarks
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-paged-mla-$r 120 /tmp/base.sh python3 -m benchmarks.store --paged --mla --blocks 16 --codecs raw,int8 --reps 8 --out "$OUT/before-paged-mla-$r"
                   step after-paged-mla-$r 120 python3 -m benchmarks.store --paged --mla --blocks 16 --codecs raw,int8 --reps 8 --out "$OUT/after-paged-mla-$r"
                 done ;;
    # Layer-wise saves of 16K tokens (4 store programs) under the package in .base and under this
    # tree, alternating; both run this tree's benchmark: the host's time in put_layer, a full tier.
    layerwise-save-ab) use_base benchmarks
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-layerwise-save-$r 150 /tmp/base.sh python3 -m benchmarks.layerwise_save --programs 4 --tokens 16384 --out "$OUT/before-layerwise-save-$r"
                   step after-layerwise-save-$r 150 python3 -m benchmarks.layerwise_save --programs 4 --tokens 16384 --out "$OUT/after-layerwise-save-$r"
                 done ;;
    # A mixed chain vs its uniform codec (64 blocks, GPU and CPU tiers) under the package in .base
    # and under this tree, alternating; both run this tree's benchmark (interleaved calls).
    mixed-ab)    use_base benchmarks
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-mixed-$r 150 /tmp/base.sh python3 -m benchmarks.store --mixed --blocks 64 --reps 10 --tiers gpu,cpu --out "$OUT/before-mixed-$r"
                   step after-mixed-$r 150 python3 -m benchmarks.store --mixed --blocks 64 --reps 10 --tiers gpu,cpu --out "$OUT/after-mixed-$r"
                 done ;;
    # Before/after a restructuring, in one call: the tree in .base (git archive of the older
    # commit, carried by the lead) installed apart and run from outside any checkout, then this
    # tree; store and kernels, alternated twice so drift hits both alike.
    before-after)
                 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/base ./.base >"$OUT/base-install.log" 2>&1 || tail -5 "$OUT/base-install.log"
                 rm -rf /tmp/bwd && mkdir -p /tmp/bwd && cp -r .base/benchmarks /tmp/bwd/
                 cat >/tmp/base.sh <<'EOS'
#!/bin/sh
cd /tmp/bwd && export PYTHONPATH="/tmp/base${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import cacheseek; print("before: cacheseek from", cacheseek.__file__)' && exec "$@"
EOS
                 chmod +x /tmp/base.sh
                 for r in $(seq 1 "${BA_ROUNDS:-2}"); do
                   step before-store-$r 150 /tmp/base.sh python3 -m benchmarks.store --codecs raw,int4 --tiers gpu,cpu --reps 8 --out "$OUT/before-store-$r"
                   step after-store-$r 150 python3 -m benchmarks.store --codecs raw,int4 --tiers gpu,cpu --reps 8 --out "$OUT/after-store-$r"
                 done
                 if [ "${BA_KERNELS:-1}" = 1 ]; then
                   step before-kernels 150 /tmp/base.sh python3 -m benchmarks.kernels --out "$OUT/before-kernels"
                   step after-kernels 150 python3 -m benchmarks.kernels --out "$OUT/after-kernels"
                 fi ;;
    *) echo "unknown step $s" ;;
  esac
done
# The device tool brings back only a few files per call: everything goes home as one archive.
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz .)
