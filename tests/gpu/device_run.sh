#!/bin/bash
# One call on the GPU machine: GPU tests on a tiny synth model, then the 8B benchmark.
# Build .gpu/ first with the tests' extras: ../shared/gpu/prepare.sh openai pytest-asyncio llguidance
# jsonschema (the constraints' GPU tests import jsonschema and openai).
#   source .gpu/activate.sh && bash tests/gpu/device_run.sh [tests] [bench64] [sweep] [procs]
#     [bare1] [compare] [comparewt] [comparegcoff] [compareinproc] [serveauto] [procs1] [procs2]
#     [placement] [placement12] (the multi-turn chat table, placement off/on, 1-4 processes)
# BENCH_ARGS (environment): more flags for the exl3 matrix and turns steps' benchgpu.
# LEVELS / ROUNDS (exllamav2) and LEVELS3 / ROUNDS3 (exllamav3): the turns steps' levels and rounds.
# An option against the defaults, in turns (both workers and the bare loop loaded): `abwt`,
# `abgcoff` (issue 15), `abq4stock` (issue 17).
# exllamav3 (issue 17): `tests3` (its GPU tests alone), `exl3bench` (bare exllamav3 loop vs
# genq's exllamav3 worker vs genq's exllamav2 worker, fp16 and EXL3 4.0 bpw, 1-256 streams; the
# EXL3 8B written with random trellis bits, or `exl3conv` first to convert the fp16 one, ~500 s)
# -- or its halves `exl3fp16` and `exl3q4` in two calls if one runs out of time; `turnsq4`
# (the turns of issue 15 on the EXL3 8B); `exl3probe` (time in
# exllamav3's per-job sampler launches), `exl3sched` (prefill cooldown x shared chunk).
# Step logs and JSON figures go to $OUT/res.tgz, process logs to $OUT/logs.tgz (default
# OUT=/tmp/genq-out); each step's summary lines are printed as well.
# Constraints (issue 32): `constraints` (the constrained jobs' GPU tests on the tiny fp16 model,
# both engines, beside the sampling tests the mask hook shares, and the OpenAI SDK test through
# a worker on exllamav2), `schema` (exllamav2, the fp16 8B) and `schema3` (exllamav3, the EXL3
# 8B): the same jobs unconstrained and under one JSON schema in turns at SCHEMA_LEVELS
# (1,64,256), ROUNDS rounds (2).
# Every feature at full speed: `table2` (exllamav2, the fp16 8B) and `table3`
# (exllamav3, the EXL3 8B) measure the table, one call each (~6 min): one stream
# (table3: and 64, 128, warmed) against the bare loop in turns, then the same jobs plain,
# with min_tokens = max_tokens and under the schema at 64 and 256 streams in turns, with the
# engine's step profile (GENQ_STEP_PROFILE_S) printed; `burst3` (another call, ~4 min): a
# fresh exllamav3 worker's first burst of 64 and 128 against a fresh bare loop's. `mintok`
# and `mintok3` alone: min_tokens against plain at MINTOK_LEVELS (64,256). burst3 then times the
# constrained jobs' host side on the GPU host's CPUs (tests.bench.masks).
set -x
FINAL=${OUT:-/tmp/genq-out}
OUT=/tmp/genq-res
mkdir -p "$FINAL" "$OUT" /tmp/genq-logs
steps=${*:-tests bench64}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, exllamav2, flash_attn; print(torch.__version__, exllamav2.__version__, flash_attn.__version__)" >> "$OUT/gpu.txt" 2>&1
python3 -c "import exllamav3.version as v; print('exllamav3', v.__version__)" >> "$OUT/gpu.txt" 2>&1
lscpu | grep -E 'Model name|^CPU\(s\)' >> "$OUT/gpu.txt"
W="-W ignore::DeprecationWarning -W ignore::UserWarning -W ignore::FutureWarning"
END=$((SECONDS + ${DEVICE_BUDGET_S:-570}))
left() { local l=$((END - SECONDS - 20)); echo $((l > 10 ? l : 10)); }  # leave time to pack up
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)
EXL3_LEVELS=1,8,64,128,256
exl3_matrix() {  # ENGINE MODEL NAME [bare]: the levels on that engine and model, 2 gateways;
  # bare: the bare loop at each level first, then the worker (--compare: a ratio row per level)
  local t=$(left); t=$((t < 280 ? t : 280))
  local levels="--sweep $EXL3_LEVELS"; [ "$4" = bare ] && levels="--compare $EXL3_LEVELS"
  timeout $t python3 -m genq.benchgpu --engine "$1" --model "$2" $levels $BENCH_ARGS \
    --max-batch 256 --requests-per-stream 1 --gateways 2 \
    --json-out "$OUT/$3.json" --logs /tmp/genq-logs/$3 > "$OUT/$3.log" 2>&1
  grep -h "^{" "$OUT/$3.log" | cut -c1-300
}
for step in $steps; do
  # GPU load, once a second, beside every step
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader -l 1 \
    > "$OUT/$step.gpu.csv" 2>/dev/null &
  smi=$!
  case $step in
    tests|tests3)  # tests3: the exllamav3 engine's tests alone
      [ -e /tmp/tiny/config.json ] || python3 -m genq synth-model /tmp/tiny --shape tiny
      [ -e /tmp/tiny-exl3/config.json ] || python3 -m genq synth-model /tmp/tiny-exl3 \
        --quantize exl3 --bits 4 --source /tmp/tiny > "$OUT/tiny-exl3.log" 2>&1
      sel=(tests/gpu)
      [ $step = tests3 ] && sel=(-k "test_exl3_gpu or exllamav3" tests/gpu/test_exl3_gpu.py
        tests/gpu/test_openai_gpu.py)
      exl3=$([ -e /tmp/tiny-exl3/config.json ] && echo GENQ_TEST_TINY_EXL3_MODEL=/tmp/tiny-exl3)
      env GENQ_TEST_TINY_MODEL=/tmp/tiny $exl3 timeout $(left) \
        python3 -m pytest -q -m gpu $W -p no:cacheprovider --basetemp=/tmp/genq-logs/pytest \
        "${sel[@]}" > "$OUT/gpu-$step.log" 2>&1
      echo "gpu tests rc=$?" >> "$OUT/gpu-$step.log"; tail -n 15 "$OUT/gpu-$step.log" ;;
    constraints)
      [ -e /tmp/tiny/config.json ] || python3 -m genq synth-model /tmp/tiny --shape tiny
      cap=${TESTS_CAP_S:-600}  # leave the rest of the call to the steps after this one
      t() { local l=$(left); env GENQ_TEST_TINY_MODEL=/tmp/tiny timeout $((l < cap ? l : cap)) \
        python3 -m pytest -q $W -p no:cacheprovider "$@"; }
      t --basetemp=/tmp/genq-logs/pytest-u tests/unit/test_dyngen_constraints.py \
        tests/unit/test_exl3_batch_sampling.py tests/unit/test_batched_path.py \
        > "$OUT/constraints-unit.log" 2>&1
      echo "unit tests rc=$?" >> "$OUT/constraints-unit.log"; tail -n 4 "$OUT/constraints-unit.log"
      t -m gpu --basetemp=/tmp/genq-logs/pytest-g tests/gpu/test_constraints_gpu.py \
        tests/gpu/test_sampling_gpu.py tests/gpu/test_exl3_gpu.py tests/gpu/test_openai_gpu.py \
        -k "not distribution and not top_p_keeps and (not test_exl3_gpu or (batched and fp16)) and (not test_openai_gpu or (json_schema and exllamav2))" \
        > "$OUT/constraints-gpu.log" 2>&1
      echo "gpu tests rc=$?" >> "$OUT/constraints-gpu.log"; tail -n 25 "$OUT/constraints-gpu.log" ;;
    bench64*|bare*|sweep*|procs*|gpus*|g[12]n*|exl3*|compare*|diag15*|turns*|ab*|serveauto|batchcompare|schema|table2|mintok|placement*)
      [[ $step == *q4* ]] || [ -e /tmp/m8b/config.json ] || { /usr/bin/time -v python3 -m genq synth-model /tmp/m8b --shape 8b > "$OUT/synth8b.log" 2>&1; } ;;&
    schema|schema3)  # issue 32: all jobs under one JSON schema against the same jobs
      # unconstrained, in turns, one system (2 gateways: 256 streams)
      eng=""; model=/tmp/m8b; [ $step = schema3 ] && { eng="--engine exllamav3"; model=/tmp/m8b-exl3; }
      [ -e $model/config.json ] || python3 -m genq synth-model $model --shape 8b --quantize exl3 \
        --random-trellis --bits 4 > "$OUT/synth8b-exl3.log" 2>&1
      timeout $(left) python3 -m genq.benchgpu --model $model $eng \
        --schema-compare ${SCHEMA_LEVELS:-1,64,256} --rounds ${ROUNDS:-2} --max-batch 256 \
        --requests-per-stream 1 --gateways 2 --json-out "$OUT/$step.json" \
        --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h '"run": "ratio\|"run": "system' "$OUT/$step.log" | cut -c1-400 ;;
    table3|burst3|mintok3)  # the EXL3 8B (random trellis bits: seconds) unless there is one
      [ -e /tmp/m8b-exl3/config.json ] || python3 -m genq synth-model /tmp/m8b-exl3 --shape 8b \
        --quantize exl3 --random-trellis --bits 4 > "$OUT/synth8b-exl3.log" 2>&1 ;;&
    table2|table3)  # the full-speed table on one engine: the bare loop against a warmed worker in
      # turns (one stream; table3: 64 and 128 too), then plain / min_tokens / schema in turns
      # EXL2_PROCS=auto: exllamav2 as `genq serve --model` runs it (one worker process a GPU)
      # the bare loop and the worker are both loaded: their caches sized for the levels alone
      # (two caches of 256 jobs and two fp16 8Bs do not fit an 80 GB H100)
      if [ $step = table2 ]; then eng=""; model=/tmp/m8b; lv=${TABLE_LEVELS:-1}; cap=200; mb=8
        [ "${EXL2_PROCS:-1}" = auto ] && eng="--worker-arg=--procs-per-gpu=auto --workers 2"
      else eng="--engine exllamav3"; model=/tmp/m8b-exl3; lv=${TABLE_LEVELS:-1,64,128}; cap=300
        mb=128; fi
      t=$(left); t=$((t < cap ? t : cap))
      timeout $t python3 -m genq.benchgpu --model $model $eng --compare $lv --max-batch $mb \
        --requests-per-stream 2 --rounds ${ROUNDS:-2} --json-out "$OUT/$step-compare.json" \
        --logs /tmp/genq-logs/$step-compare > "$OUT/$step-compare.log" 2>&1
      grep -h '"run": "ratio.*median' "$OUT/$step-compare.log" | cut -c1-400
      timeout $(left) python3 -m genq.benchgpu --model $model $eng \
        --schema-compare ${VARIANT_LEVELS:-64,256} --min-tokens-compare ${VARIANT_LEVELS:-64,256} \
        --rounds ${VARIANT_ROUNDS:-1} --max-batch 256 --requests-per-stream 1 --gateways 2 \
        --worker-env GENQ_STEP_PROFILE_S=${PROFILE_S:-4} --json-out "$OUT/$step-variants.json" \
        --logs /tmp/genq-logs/$step-variants > "$OUT/$step-variants.log" 2>&1
      grep -h '"run": "ratio' "$OUT/$step-variants.log" | cut -c1-400
      grep -h '"engine profile"' /tmp/genq-logs/$step-variants/worker.log | cut -c1-700 | tail -n 12 ;;
    burst3)  # a fresh exllamav3 worker's first burst against a fresh bare loop's, per level
      timeout $(left) python3 -m genq.benchgpu --engine exllamav3 --model /tmp/m8b-exl3 \
        --first-burst ${BURST_LEVELS:-64,128} --max-batch 256 --gateways 2 \
        --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h '"run": "ratio\|first burst' "$OUT/$step.log" | cut -c1-400
      # the constrained jobs' host side on this host's CPUs: masks, consumes one by one and together
      timeout 120 python3 -m tests.bench.masks --tokenizer /tmp/m8b-exl3/tokenizer.json \
        --vocab 128256 --rows 64,256 --steps 40 2>&1 | tee "$OUT/masks-bench.log" | tail -n 2 ;;
    mintok|mintok3)  # min_tokens = max_tokens against the same jobs plain, in turns
      eng=""; model=/tmp/m8b; [ $step = mintok3 ] && { eng="--engine exllamav3"; model=/tmp/m8b-exl3; }
      timeout $(left) python3 -m genq.benchgpu --model $model $eng \
        --min-tokens-compare ${MINTOK_LEVELS:-64,256} --rounds ${ROUNDS:-2} --max-batch 256 \
        --requests-per-stream 1 --gateways 2 --worker-env GENQ_STEP_PROFILE_S=${PROFILE_S:-4} \
        --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h '"run": "ratio' "$OUT/$step.log" | cut -c1-400
      grep -h '"engine profile"' /tmp/genq-logs/$step/worker.log | cut -c1-500 | tail -n 6 ;;
    bench64)
      timeout 200 python3 -m genq.benchgpu --model /tmp/m8b --streams 64 --bare --system \
        --genq-bench --json-out "$OUT/bench64.json" --logs /tmp/genq-logs/bench64 > "$OUT/bench64.log" 2>&1 ;;
    bench64gil)  # the same system run with CPython's default 5 ms GIL switch interval
      timeout 200 python3 -m genq.benchgpu --model /tmp/m8b --streams 64 --system \
        --worker-env GENQ_GIL_SWITCH_INTERVAL_S=0.005 --json-out "$OUT/bench64gil.json" \
        --logs /tmp/genq-logs/bench64gil > "$OUT/bench64gil.log" 2>&1 ;;
    bare[0-9]*)  # the bare generator at N streams, e.g. bare128 (its best with exllamav2's CPU
      # sampler, per ../shared/gpu/README.md); bare128cpu: that CPU sampler, as exllamav2 comes
      n=${step//[!0-9]/}; cpu=$([[ $step == *cpu ]] && echo --cpu-sampling)
      timeout 90 python3 -m genq.benchgpu --model /tmp/m8b --streams $n --bare $cpu \
        --requests-per-stream 1 --json-out "$OUT/$step.json" > "$OUT/$step.log" 2>&1
      grep -h "^{" "$OUT/$step.log" | tail -n 1 ;;
    sweep)
      timeout 330 python3 -m genq.benchgpu --model /tmp/m8b --sweep 1,8,32,64,128,192,256 \
        --max-batch 256 --requests-per-stream 1 --json-out "$OUT/sweep.json" \
        --logs /tmp/genq-logs/sweep > "$OUT/sweep.log" 2>&1 ;;
    sweep256)  # one gateway process's Redis pool (256 connections) can't carry 256 streams
      timeout 90 python3 -m genq.benchgpu --model /tmp/m8b --sweep 256 --max-batch 256 \
        --requests-per-stream 1 --gateways 2 --json-out "$OUT/sweep256.json" \
        --logs /tmp/genq-logs/sweep256 > "$OUT/sweep256.log" 2>&1 ;;
    gpus1)  # issue 5 on a 2-GPU machine: 4 processes on one GPU at 256 streams...
      timeout 110 python3 -m genq.benchgpu --model /tmp/m8b --sweep 256 --max-batch 256 \
        --requests-per-stream 1 --worker-arg=--gpus=0 --worker-arg=--procs-per-gpu=4 --workers 4 \
        --gateways 2 --json-out "$OUT/gpus1.json" --logs /tmp/genq-logs/gpus1 > "$OUT/gpus1.log" 2>&1 ;;
    gpus2)  # ...and 4 on each of two GPUs at 256 and 512 streams
      timeout 170 python3 -m genq.benchgpu --model /tmp/m8b --sweep 256,512 --max-batch 256 \
        --requests-per-stream 1 --worker-arg=--gpus=0,1 --worker-arg=--procs-per-gpu=4 --workers 8 \
        --gateways 4 --json-out "$OUT/gpus2.json" --logs /tmp/genq-logs/gpus2 > "$OUT/gpus2.log" 2>&1 ;;
    gpus2n3)  # 3 per GPU on two GPUs at 512 streams, with a CPU snapshot mid-run
      timeout 170 python3 -m genq.benchgpu --model /tmp/m8b --sweep 512 --max-batch 256 \
        --requests-per-stream 1 --worker-arg=--gpus=0,1 --worker-arg=--procs-per-gpu=3 --workers 6 \
        --gateways 4 --json-out "$OUT/gpus2n3.json" --logs /tmp/genq-logs/gpus2n3 \
        > "$OUT/gpus2n3.log" 2>&1 &
      bench=$!
      until grep -q "# starting" "$OUT/gpus2n3.log" || ! kill -0 $bench 2>/dev/null; do sleep 1; done
      sleep 12; top -b -n1 -w 200 | head -45 > "$OUT/top.txt"; wait $bench ;;
    g[12]n[1-4]*)  # issue 5: G GPUs x N processes, 256 streams per GPU; suffixes: off (no CPU
      # placement; default: as `auto` chooses), wide (off, thread pools as wide as the host),
      # cpu (exllamav2's CPU sampler) -- e.g. g1n4 g1n4cpu g2n3 g2n4off g2n4wide
      g=${step:1:1}; n=${step:3:1}; rest=${step:4}; gpus=$([ "$g" = 2 ] && echo 0,1 || echo 0)
      aff=$([[ $rest == *off* || $rest == *wide* ]] && echo off || echo auto)
      wide=$([[ $rest == *wide* ]] && echo "--worker-env GENQ_SAMPLING_THREADS=16 --worker-env OMP_NUM_THREADS=$(nproc)")
      cpu=$([[ $rest == *cpu* ]] && echo --cpu-sampling)
      timeout 200 python3 -m genq.benchgpu --model /tmp/m8b --sweep $((256 * g)) --max-batch 256 \
        --requests-per-stream 1 --worker-arg=--gpus=$gpus --worker-arg=--procs-per-gpu=$n \
        --worker-arg=--cpu-affinity=$aff $wide $cpu --workers $((g * n)) --gateways $((2 * g)) \
        --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h "^{" "$OUT/$step.log" | tail -n 3 ;;
    exl3bench|exl3fp16)  # fp16: bare exllamav3 loop + genq's exllamav3 worker; genq's exllamav2 worker
      exl3_matrix exllamav3 /tmp/m8b exl3fp16 bare
      exl3_matrix exllamav2 /tmp/m8b exl2fp16 ;;&
    exl3conv)  # the 8B converted to EXL3 4.0 bpw (~500 s; resumable: run again if cut off)
      [ -e /tmp/m8b-exl3/config.json ] || { timeout $(left) python3 -m genq synth-model \
        /tmp/m8b-exl3 --quantize exl3 --bits 4 --source /tmp/m8b --gpus "$GPUS" \
        --calibration-rows ${EXL3_CAL_ROWS:-16} \
        >> "$OUT/exl3conv.log" 2>&1; tail -n 3 "$OUT/exl3conv.log"; } ;;
    exl3bench|exl3q4|turnsq4*|exl3probeq4|exl3schedq4|abq4*)  # the 8B as EXL3 4.0 bpw storage with random bits (seconds;
      # the same kernels and speed as a conversion) unless exl3conv made one
      [ -e /tmp/m8b-exl3/config.json ] || { /usr/bin/time -v python3 -m genq synth-model \
        /tmp/m8b-exl3 --shape 8b --quantize exl3 --random-trellis --bits 4 \
        > "$OUT/synth8b-exl3.log" 2>&1; tail -n 1 "$OUT/synth8b-exl3.log"; } ;;&
    exl3bench|exl3q4)  # EXL3 4.0 bpw (exllamav2 cannot read it): bare exllamav3 loop + worker
      [ -e /tmp/m8b-exl3/config.json ] && exl3_matrix exllamav3 /tmp/m8b-exl3 exl3q4 bare ;;
    exl3probe|exl3probeq4)  # how long each step spends launching exllamav3's per-job samplers
      # (bare loop); exl3probeq4: on the EXL3 8B alone
      models="m8b m8b-exl3"; [ $step = exl3probeq4 ] && models=m8b-exl3
      # (--bare runs at --streams alone: one run per level, nothing else loaded)
      for m in $models; do for n in 1 64 256; do
        [ -e /tmp/$m/config.json ] || continue
        timeout 120 python3 -m genq.benchgpu --engine exllamav3 --model /tmp/$m --bare \
          --sampler-probe --streams $n --requests-per-stream 1 \
          --json-out "$OUT/exl3probe-$m-$n.json" > "$OUT/exl3probe-$m-$n.log" 2>&1
        grep -h "^{" "$OUT/exl3probe-$m-$n.log" | cut -c1-400
      done; done ;;
    exl3sched|exl3schedq4)  # exllamav3's prefill scheduling: cooldown x shared chunk, worker,
      # 64 and 128 streams; exl3schedq4: on the EXL3 8B (random trellis), no fp16 model needed
      model=/tmp/m8b; [ $step = exl3schedq4 ] && model=/tmp/m8b-exl3
      for cd in 0 4; do for sc in 512 2048; do
        timeout 140 python3 -m genq.benchgpu --engine exllamav3 --model $model --sweep 64,128 \
          --max-batch 128 --requests-per-stream 1 --worker-env GENQ_PREFILL_COOLDOWN=$cd \
          --worker-env GENQ_SHARED_CHUNK_SIZE=$sc --json-out "$OUT/exl3sched-$cd-$sc.json" \
          --logs /tmp/genq-logs/exl3sched-$cd-$sc > "$OUT/exl3sched-$cd-$sc.log" 2>&1
        grep -h '"run": "system' "$OUT/exl3sched-$cd-$sc.log" | cut -c1-200
      done; done ;;
    turns|turnsexl3|turnsreplay|turnsreplayexl3|turnsq4|turnsreplayq4|turnsq4batched*|turnsq4stock)
      # issue 15 (…exl3, …q4: issue 17, the 8B in fp16 / EXL3 4.0 bpw; the worker samples in
      # one batched pass by default, GENQ_BATCHED_SAMPLING; the bare loop is the stock one:
      # turnsq4stock: the worker with exllamav3's own sampler too; turnsq4batchedboth: the
      # bare loop with the batched pass too; turnsq4batched: the worker's default said aloud):
      # the bare loop and one worker (defaults), both loaded, take turns at each level, the first to go
      # flipping each round; a ratio row per turn and the median per level. This host drifts
      # by tens of percent within one call (docs/performance.md): turns put both under the
      # same drift. turnsreplay: the bare loop takes each job when the system's last turn
      # sent it (--replay), so the decode rates compare under the same arrivals.
      model=/tmp/m8b
      if [[ $step != *exl3 && $step != *q4* ]]; then eng=""; lv=${LEVELS:-1,8,64,128}; rounds=${ROUNDS:-3}; cap=340
      else eng="--engine exllamav3"; lv=${LEVELS3:-8,64,128}; rounds=${ROUNDS3:-2}; cap=600; fi
      [[ $step == *q4* ]] && model=/tmp/m8b-exl3
      batched=$([[ $step == *batched* ]] && echo "--worker-env GENQ_BATCHED_SAMPLING=true")
      [[ $step == *stock ]] && batched="--worker-env GENQ_BATCHED_SAMPLING=false"
      both=$([[ $step == *both ]] && echo GENQ_BATCHED_SAMPLING=true)  # the bare loop's too
      replay=$([[ $step == *replay* ]] && echo --replay)
      t=$(left); t=$((t < cap ? t : cap))
      env $both timeout $t python3 -m genq.benchgpu --model $model $eng --compare $lv \
        --max-batch ${MAXB:-128} --requests-per-stream 2 --rounds $rounds $replay $batched \
        $BENCH_ARGS --json-out "$OUT/$step.json" \
        --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h '"ratio' "$OUT/$step.log" | cut -c1-330 ;;
    abwt|abgcoff|abq4stock|abexl3stock)  # an option against the defaults, in turns: the bare loop, the
      # defaults' worker and the option's worker, all loaded, take turns at each level (none
      # always first); per round `ratio alt/system`, and its median. abwt: GENQ_DETOKENIZE=worker,
      # abgcoff: GENQ_ENGINE_GC_IN_STEPS=false (issue 15, exllamav2 fp16); abq4stock: exllamav3's
      # own sampler on every job, GENQ_BATCHED_SAMPLING=false (issue 17, the EXL3 8B;
      # abexl3stock: the same on the fp16 8B, exllamav3's unquantized path, default 1 stream)
      case $step in
        abwt) opt=GENQ_DETOKENIZE=worker ;; abgcoff) opt=GENQ_ENGINE_GC_IN_STEPS=false ;;
        abq4stock|abexl3stock) opt=GENQ_BATCHED_SAMPLING=false ;;
      esac
      model=/tmp/m8b; eng=""; lv=${COMPARE_LEVELS:-1,8,64,128}
      [[ $step == *q4* ]] && { model=/tmp/m8b-exl3; eng="--engine exllamav3"; lv=${LEVELS3:-1,8,256}; }
      [[ $step == *exl3* ]] && { eng="--engine exllamav3"; lv=${LEVELS3:-1}; }
      timeout $(left) python3 -m genq.benchgpu --model $model $eng --compare $lv \
        --max-batch ${MAXB:-128} --requests-per-stream 2 --rounds ${ROUNDS:-2} \
        --ab-worker-env $opt $BENCH_ARGS --json-out "$OUT/$step.json" \
        --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h '"ratio alt/system' "$OUT/$step.log" | cut -c1-330 ;;
    diag15b*)  # issue 15's ratios as the issue defines them: the engine on a core of its own
      # (--pin-engine), the bare loop before the system, after it, and with each job arriving
      # when the system's client sent it; py-spy (3 s, non-blocking) of the bare loop and of
      # the engine process at the first level. diag15bexl3: exllamav3.
      eng=$([[ $step == *exl3* ]] && echo "--engine exllamav3")
      levels=${COMPARE_LEVELS:-8,64}; first=${levels%%,*}; log="$OUT/$step.log"
      python3 -m genq.benchgpu --model /tmp/m8b $eng --compare $levels --max-batch 128 \
        --requests-per-stream 2 --bare-again --pin-engine --json-out "$OUT/$step.json" \
        --logs /tmp/genq-logs/$step > "$log" 2>&1 &
      bench=$!
      spy() { sleep 1; timeout 10 /tmp/site/bin/py-spy record --pid "$1" -d 3 -r 250 --nonblocking \
        --format raw -o "$OUT/$step.$2.raw.txt" > /dev/null 2>&1; }
      until grep -q "# bare generator at $first streams" "$log" || ! kill -0 $bench 2>/dev/null; do sleep 0.2; done
      spy $bench bare
      until grep -q "# starting $first streams" "$log" || ! kill -0 $bench 2>/dev/null; do sleep 0.2; done
      spy "$(pgrep -f worker.engine_process | head -n 1)" engine
      timeout $(left) tail --pid=$bench -f /dev/null; kill $bench 2>/dev/null
      grep -h '"ratio' "$log" ;;
    diag15*)  # issue 15's gap at 8 and 64 streams: what slows the engine's step? One call:
      # the bare loop alone, with 4 busy processes beside it, the system, the bare loop again
      # after it; then the same with the engine on a core of its own (--pin-engine: bare loop
      # and engine process on one CPU, everything else off that core). diag15exl3: exllamav3.
      lscpu -e > "$OUT/lscpu.txt" 2>&1
      eng=$([[ $step == *exl3* ]] && echo "--engine exllamav3")
      for pin in "" --pin-engine; do
        name=$step$([ -n "$pin" ] && echo pin)
        load=$([ -z "$pin" ] && echo "--bare-load 4")
        timeout $(left) python3 -m genq.benchgpu --model /tmp/m8b $eng \
          --compare ${COMPARE_LEVELS:-8,64} --max-batch 128 --requests-per-stream 2 \
          --bare-again $load $pin --json-out "$OUT/$name.json" --logs /tmp/genq-logs/$name \
          > "$OUT/$name.log" 2>&1
        grep -h '^{' "$OUT/$name.log" | python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line); keys = ("run", "streams", "tokens_per_s", "decode_tok_s_p50",
        "step_ms", "engine_step_ms", "worker_step_ms", "ttft_ms_p50", "ttft_p50_overhead_ms", "cpu")
    print(json.dumps({k: r[k] for k in keys if k in r}))'
      done ;;
    compare*)  # issue 15: the bare generator, then one worker (its engine process), at 1, 8, 64
      # and 128 streams in one call, genq's GPU sampling in both; a ratio row per level.
      # Suffixes (A/B of the engine process's options): wt (GENQ_DETOKENIZE=worker: text and
      # stop strings in the I/O process), gcoff (GENQ_ENGINE_GC_IN_STEPS=false), inproc
      # (GENQ_ENGINE_PROCESS=false: the engine on a thread of the worker, as before issue 15)
      # -- e.g. compare comparewt comparegcoff compareinproc compareexl3
      env=""
      [[ $step == *wt* ]] && env="$env --worker-env GENQ_DETOKENIZE=worker"
      [[ $step == *gcoff* ]] && env="$env --worker-env GENQ_ENGINE_GC_IN_STEPS=false"
      [[ $step == *inproc* ]] && env="$env --worker-env GENQ_ENGINE_PROCESS=false"
      [[ $step == *exl3* ]] && env="$env --engine exllamav3"  # compareexl3: issue 17's engine
      timeout $(left) python3 -m genq.benchgpu --model /tmp/m8b --compare ${COMPARE_LEVELS:-1,8,64,128} --max-batch 128 \
        --requests-per-stream 2 $env --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step \
        > "$OUT/$step.log" 2>&1
      grep -h '"ratio' "$OUT/$step.log" ;;
    serveauto)  # issue 15: `genq serve --model` defaults (--procs-per-gpu auto: 1 process per
      # GPU today, AUTO_MAX_PROCS in genq/launcher.py; change --workers with it) at 1..256
      timeout $(left) python3 -m genq.benchgpu --model /tmp/m8b --sweep 1,8,64,128,256 --max-batch 256 \
        --requests-per-stream 1 --worker-arg=--procs-per-gpu=auto --workers 2 --gateways 2 \
        --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h "^{" "$OUT/$step.log" | cut -c1-400 ;;
    batchcompare)  # issue 14: a 2,000-line batch on the 8B synth against the same requests as
      # 256 live streams, with a shared 512-word system prompt and a distinct one per line
      python3 -m genq serve --model /tmp/m8b --port 8000 --max-batch 256 \
        > /tmp/genq-logs/batchcompare-serve.log 2>&1 &
      serve=$!
      models() { python3 -c 'import json, urllib.request as u
print(json.load(u.urlopen("http://127.0.0.1:8000/v1/models"))["data"][0]["id"])' 2>/dev/null; }
      for _ in $(seq 240); do models > /dev/null && break; sleep 1; done
      model=$(models)
      timeout $(left) python3 -m tests.bench.batch --url http://127.0.0.1:8000 --model "$model" \
        --redis-url "$GENQ_REDIS_URL" --sections compare --lines ${BATCH_LINES:-2000} --max-tokens 128 \
        --system-tokens 512 --live-concurrency 256 > "$OUT/$step.log" 2>&1
      kill -INT $serve; sleep 5; kill -9 $serve 2>/dev/null
      tail -n 20 "$OUT/$step.log" ;;
    exl3profile*)  # where the exllamav3 engine process spends a 64-stream run: its threads'
      # CPU (top -H), three py-spy dumps and a 10 s py-spy record (collapsed stacks);
      # exl3profile1t: the same with OMP_NUM_THREADS=1 in the worker and its engine process
      omp=$([[ $step == *1t ]] && echo "--worker-env OMP_NUM_THREADS=1")
      python3 -m genq.benchgpu --engine exllamav3 --model /tmp/m8b --streams 64 --system \
        --max-batch 128 --requests-per-stream 3 --logs /tmp/genq-logs/$step $omp \
        > "$OUT/$step.log" 2>&1 &
      bench=$!
      for _ in $(seq 120); do
        pid=$(pgrep -f worker.engine_process | head -n 1)
        [ -n "$pid" ] && grep -q "starting 64" "$OUT/$step.log" && break; sleep 1
      done
      sleep 8
      top -H -b -n 1 -p "$pid" | head -n 30 > "$OUT/$step.top.txt"
      for i in 1 2 3; do /tmp/site/bin/py-spy dump --pid "$pid" >> "$OUT/$step.dump.txt" 2>&1; sleep 1; done
      /tmp/site/bin/py-spy record --pid "$pid" -d 10 -r 200 --format raw -o "$OUT/$step.raw.txt" > /dev/null 2>&1
      top -H -b -n 1 -p "$pid" | head -n 30 >> "$OUT/$step.top.txt"
      timeout $(left) tail --pid=$bench -f /dev/null
      head -n 25 "$OUT/$step.top.txt"; grep -h '"run"' "$OUT/$step.log" | cut -c1-300 ;;
    placement|placement[1-4]*)  # the multi-turn chat table: `genq serve --model` with 1-4
      # processes (PROCS, or the digits after the step's name), placement off and on for N > 1;
      # 200 conversations x 5 turns, 64 at once, a shared ~1,000-token system prompt
      # (PLACEMENT_RUNS=on: placement on alone; PLACEMENT_ARGS=--unrelated: every job a new prompt)
      procs=${PROCS:-1,2,3,4}; [ $step != placement ] && procs=$(echo ${step#placement} | sed 's/./&,/g; s/,$//')
      timeout $(left) python3 -m tests.bench.placement --model /tmp/m8b --procs $procs \
        --concurrency 64 --shared-system --new-tokens 64 --ready-s 240 \
        --placement-runs ${PLACEMENT_RUNS:-off,on} $PLACEMENT_ARGS \
        > "$OUT/$step.log" 2>&1
      grep -h '^{"procs' "$OUT/$step.log" | cut -c1-700 ;;
    procs[1-4]|procs[1-4]cpu)  # N worker processes on the one GPU, total concurrency 64..256
      n=${step:5:1}; cpu=$([[ $step == *cpu ]] && echo --cpu-sampling)
      timeout 170 python3 -m genq.benchgpu --model /tmp/m8b --sweep 64,128,192,256 \
        --max-batch 256 --requests-per-stream 1 --worker-arg=--procs-per-gpu=$n --workers $n \
        --gateways 2 $cpu \
        --json-out "$OUT/$step.json" --logs /tmp/genq-logs/$step > "$OUT/$step.log" 2>&1
      grep -h "^{" "$OUT/$step.log" | cut -c1-400 ;;
  esac
  kill $smi 2>/dev/null
done
# $OUT takes at most 8 files: step results and process logs go back as two archives
mv "$OUT/gpu.txt" "$FINAL/" 2>/dev/null
tar czf "$FINAL/res.tgz" -C /tmp genq-res 2>/dev/null
tar czf "$FINAL/logs.tgz" -C /tmp genq-logs 2>/dev/null
