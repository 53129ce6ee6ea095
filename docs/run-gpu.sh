#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the bundled test and bench binaries from `.gpu/`
# (built by `cargo xtask gpu-bundle`). Usage, from the repository root on that machine:
#
#   bash .gpu/run-gpu.sh [steps...]     steps: info tests fills portable quick peers sweep probe entropy tp active keep exhaustive sanitize ncu plans sass (default: info tests quick)
#
# Logs go to $OUT (or ./gpu-out when OUT is unset). Each step has a time limit so that one hung
# step cannot eat the whole session. Set FILTER to pass a test-name filter to the test binaries,
# BUDGET to give the sweep a time budget in seconds.
set -u
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LMHEAD_GPU_TESTS=1 LMHEAD_COMMIT=$(cat "$B/COMMIT" 2>/dev/null || echo unknown)
export LMHEAD_TUNE_CACHE=${LMHEAD_TUNE_CACHE:-$OUT/tune-cache.json}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# libnccl ships in the nvidia-nccl wheel of the machine's python, not on the default path.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -n "$nccl_dir" ] && [ -d "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && ln -sf "$nccl_dir/libnccl.so.2" "$nccl_dir/libnccl.so" 2>/dev/null
# One test binary ($1) with the test-name filter $3, its output appended to $OUT/$2; prints the
# summary and the panics; the tests step's per-case records also go to $OUT/records.txt.
run_tests() {
  timeout ${TEST_TIMEOUT:-280} "$B/$1" --test-threads=1 --nocapture ${3:-} > "$OUT/test.tmp" 2>&1
  cat "$OUT/test.tmp" >> "$OUT/$2"
  grep -E "^test .*(FAILED|ok)$|test result|panicked|SKIP" "$OUT/test.tmp" | head -60
  grep -A3 "panicked" "$OUT/test.tmp" | grep -v "^stack\|^ *[0-9]*:" | head -40
  [ "$2" = tests.log ] && grep -hE "^\[.*\] (fwd|bwd|tp|cp|rel) " "$OUT/test.tmp" >> "$OUT/records.txt"
  rm -f "$OUT/test.tmp"
}
# The four compute-sanitizer tools over gpu_reliability's sanitizer_* test; summary to
# $OUT/sanitize.log.
run_sanitizers() {
  for tool in memcheck racecheck initcheck synccheck; do
    echo "== compute-sanitizer $tool"
    timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool "$tool" --error-exitcode 7 "$B/gpu_reliability" --test-threads=1 --nocapture sanitizer_ > "$OUT/san.tmp" 2>&1
    echo "exit $? (7 = errors found, 124 = timed out)" >> "$OUT/san.tmp"
    { echo "== $tool"; grep -E "ERROR SUMMARY|========= (Invalid|Race|Uninit|Barrier)|test result|panicked|exit " "$OUT/san.tmp" | head -20; } | tee -a "$OUT/sanitize.log"
    rm -f "$OUT/san.tmp"
  done
}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(info tests quick)
echo "commit $LMHEAD_COMMIT, steps: ${steps[*]}"
for s in "${steps[@]}"; do
  t0=$(date +%s)
  case "$s" in
    info) nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/info.txt" ;;
    tests)
      for t in ${TESTS:-gpu_units gpu_fwd gpu_bwd gpu_active gpu_keep gpu_capture tp gpu_reliability tuner reference}; do
        [ -x "$B/$t" ] || continue
        echo "== $t"
        run_tests "$t" tests.log "${FILTER:-}"
      done ;;
    fills)
      # Every Hopper plan forced to carry fillers (two vocab splits in raster groups of one token
      # tile and a one-tile filler each; one column group per backward block, one-tile fillers):
      # the tile-boundary tests, then the sanitizers, on those plans (the test binaries read the
      # plan overrides from the environment; the library alone never does).
      (
        export LMHEAD_FWD_SPLITS=2 LMHEAD_FWD_RASTER=1 LMHEAD_FWD_FILL=1 LMHEAD_BWD_TILES=64 LMHEAD_BWD_RASTER=1 LMHEAD_BWD_FILL=1
        for t in gpu_fwd gpu_bwd; do
          echo "== $t (forced fillers)"
          run_tests "$t" fills.log tile_boundaries
        done
        echo "== sanitizers (forced fillers)" | tee -a "$OUT/sanitize.log"
        run_sanitizers
      ) ;;
    portable)
      # The portable module (sm_80 PTX, the mma.sync kernels) forced on this GPU and loaded by the
      # driver's JIT (LMHEAD_TEST_MODULE=portable: read by the library only in its `testing`
      # builds, the bundled tests and bench): the GPU parity suite, the reliability and bad-input
      # suite, the sanitizers, then `quick` as a sanity figure (mma.sync on Hopper does not show
      # the speed of the portable module's real targets). Logs: portable.log, sanitize.log (its
      # "(portable)" part), bench-portable.md; records: bench-portable.jsonl. The first test
      # binary JIT-compiles what it launches (the driver caches it for the others).
      (
        export LMHEAD_TEST_MODULE=portable LMHEAD_TUNE_CACHE="$OUT/tune-cache-portable.json" TEST_TIMEOUT=${TEST_TIMEOUT:-600}
        for t in ${TESTS:-gpu_units gpu_fwd gpu_bwd gpu_active gpu_keep gpu_capture tp gpu_reliability}; do
          [ -x "$B/$t" ] || continue
          echo "== $t (portable module, JIT)"
          run_tests "$t" portable.log "${FILTER:-}"
        done
        echo "== sanitizers (portable module, JIT)" | tee -a "$OUT/sanitize.log"
        SAN_TIMEOUT=${SAN_TIMEOUT:-600} run_sanitizers
        echo "== bench quick (portable module, JIT)"
        timeout ${BENCH_TIMEOUT:-500} "$B/lmhead-bench" quick --out "$OUT/bench-portable.jsonl" ${BENCH_ARGS:-} 2>>"$OUT/bench.err" | tee -a "$OUT/bench-portable.md"
        tail -3 "$OUT/bench.err"
      ) ;;
    quick|peers|sweep|entropy|probe|tp|active|keep|exhaustive)
      echo "== bench $s"
      # tp, active and exhaustive records are other kinds: their own files (`cargo xtask
      # heuristics` replays the rules against exhaustive ones).
      res="$OUT/bench.jsonl"; [ "$s" = tp ] && res="$OUT/bench-tp.jsonl"; [ "$s" = active ] && res="$OUT/bench-active.jsonl"; [ "$s" = keep ] && res="$OUT/bench-keep.jsonl"; [ "$s" = exhaustive ] && res="$OUT/exhaustive.jsonl"
      timeout ${BENCH_TIMEOUT:-500} "$B/lmhead-bench" "$s" --out "$res" ${BUDGET:+--budget-s $BUDGET} ${BENCH_ARGS:-} 2>>"$OUT/bench.err" | tee -a "$OUT/bench-$s.md"
      tail -3 "$OUT/bench.err" ;;
    sanitize) run_sanitizers ;;
    ncu)
      # The per-kernel account (docs/PERFORMANCE.md, *What limits each kernel*) at each sweep case
      # named in the file NCU_CASES (one per line; `bench/scripts/ncu_table.py --cases`), into
      # $OUT/ncu.txt, one "== <case>" line before each: one unprofiled run fills the tuning cache,
      # so that nothing is tuned under the profiler (NCU_FILL=0: not run, when the cache already
      # holds the cases' keys); cases also named in NCU_APP_REPLAY run with
      # application replay and without the XU metric (kernel replay backs their buffers up in host
      # memory, minutes per kernel). BUDGET: stop before a case once that many seconds are spent;
      # NCU_SKIP=<n> resumes after the first n cases.
      m='gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed'
      n=0
      for c in $(tail -n +$(( ${NCU_SKIP:-0} + 1 )) "${NCU_CASES:?NCU_CASES: a file of sweep case names}"); do
        if [ -n "${BUDGET:-}" ] && [ $(( $(date +%s) - t0 )) -ge "$BUDGET" ]; then
          echo "budget spent: stopped before $c; resume with NCU_SKIP=$(( ${NCU_SKIP:-0} + n ))"; break
        fi
        c0=$(date +%s)
        [ "${NCU_FILL:-1}" = 0 ] || "$B/lmhead-bench" sweep --filter "$c" --reps 1 --no-check --out "$OUT/ncu-fill.jsonl" > /dev/null 2>> "$OUT/bench.err"
        if [[ " ${NCU_APP_REPLAY:-} " == *" $c "* ]]; then
          args=(--replay-mode application --metrics "$m")
        else
          args=(--metrics "$m,regex:sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active")
        fi
        echo "== $c" >> "$OUT/ncu.txt"
        timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --print-summary per-kernel --launch-count 16 \
          -k regex:'lm_head_fwd_t|lm_head_fwd_ent_t|lm_head_bwd_dlogits|lm_head_bwd_dh|lm_head_bwd_dw|nvjet' "${args[@]}" \
          "$B/lmhead-bench" sweep --filter "$c" --reps 1 --no-check --out /dev/null >> "$OUT/ncu.txt" 2>&1
        echo "$c: exit $?, $(( $(date +%s) - c0 )) s"
        n=$(( n + 1 ))
      done ;;
    plans)
      # Forward launch plans side by side in the steady state (docs/PERFORMANCE.md, *The forward's
      # plan at 131072 tokens*). Each line of the file PLAN_CASES is `<sweep case> <S>x<G> ...`:
      # one run fills the tuning cache, then the planner's own plan and each plan of S splits in
      # raster groups of G token tiles (LMHEAD_FWD_SPLITS, LMHEAD_FWD_RASTER), each in a process of
      # its own, in the order planner, A, B, …, B, A, planner: `sweep --filter <case> --reps
      # ${PLAN_REPS:-3}` into $OUT/plans.jsonl, with the check of the timed log-probs against
      # the f64 reference (a plan that fails it leaves no record; each record names its plan,
      # `fwd_plan`, and the forced ones their `plan_overrides`; `cargo xtask heuristics` compares
      # the rules' plans with them). A variant `chunk=<N>` instead times the library's plans with
      # the backward's vocab chunk forced to N columns (`--bwd-chunk N`; records carry
      # `bwd_chunk`) against the library's own chunk; `dw-after-dh` the backward with `dW` after
      # `dh` on the call's stream (`--dw-after-dh`; records carry `dw_after_dh`); a variant
      # `LMHEAD_<NAME>=<value>[,LMHEAD_<NAME>=<value>…]` runs the bench with those plan overrides
      # set (e.g. LMHEAD_BWD_TILES=2). BUDGET: stop before a case once that many seconds are
      # spent.
      while read -r c vars; do
        [ -z "${c:-}" ] && continue
        if [ -n "${BUDGET:-}" ] && [ $(( $(date +%s) - t0 )) -ge "$BUDGET" ]; then
          echo "budget spent: stopped before $c"; break
        fi
        c0=$(date +%s)
        "$B/lmhead-bench" sweep --filter "$c" --reps 1 --no-check --out /dev/null < /dev/null > /dev/null 2>> "$OUT/bench.err"
        order=(planner $vars)
        for (( i = ${#order[@]} - 1; i >= 0; i-- )); do order+=("${order[i]}"); done
        for p in "${order[@]}"; do
          env=(env); args=()
          case "$p" in
            planner) ;;
            chunk=*) args=(--bwd-chunk "${p#chunk=}") ;;
            dw-after-dh) args=(--dw-after-dh) ;;
            LMHEAD_*=*) IFS=, read -ra kv <<< "$p"; env=(env "${kv[@]}") ;;
            *) env=(env "LMHEAD_FWD_SPLITS=${p%x*}" "LMHEAD_FWD_RASTER=${p#*x}") ;;
          esac
          "${env[@]}" timeout ${PLAN_TIMEOUT:-150} "$B/lmhead-bench" sweep --filter "$c" --reps ${PLAN_REPS:-3} \
            ${args[@]+"${args[@]}"} --out "$OUT/plans.jsonl" < /dev/null >> "$OUT/plans.log" 2>&1
          echo "$c $p: exit $?"
        done
        echo "$c: $(( $(date +%s) - c0 )) s"
      done < "${PLAN_CASES:?PLAN_CASES: a file of lines <sweep case> <S>x<G> ...}" ;;
    sass)
      # A cubin assembled here by `cargo xtask build-ptx` (target/kernels/lmhead_kernels.cubin),
      # copied into .gpu/: per wgmma kernel, the count of HGMMA and of local-memory accesses.
      f=$(ls "$B"/*.cubin 2>/dev/null | head -1)
      [ -n "$f" ] && cuobjdump --dump-sass "$f" > "$OUT/sass.txt" && awk '/Function :/{f=$3} /HGMMA/{h[f]++} /LDL|STL/{l[f]++} /UTMALDG/{t[f]++} END{for(k in h) print k, "HGMMA", h[k], "UTMALDG", t[k]+0, "LDL/STL", l[k]+0}' "$OUT/sass.txt" | sort ;;
    *) echo "unknown step $s" ;;
  esac
  echo "-- $s took $(( $(date +%s) - t0 )) s"
done
