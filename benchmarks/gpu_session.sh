#!/usr/bin/env bash
# One session's GPU work on the device machine (one H200), as named items run in order in one call.
#
# Device time is scarce (30 minutes a session, each call at most 10, the machine given back 30 s after a
# call ends), so the work is planned here, in the repository, and not rewritten each session:
#
#   bash ../shared/gpu/make_vllm_bundle.sh      # here, once: .gpu/a and .gpu/b (git-ignored)
#   call 1  carry [".gpu/a"]                     mkdir -p /tmp/stage && cp .gpu/a/* /tmp/stage/
# Since 12-05 the tracked tree (5 MB on disk) and .gpu/a (63 MB) pass the 64 MiB a call may carry: split part_aa
# (head -c 40000000 > .gpu/a1/p0, tail -c +40000001 > .gpu/a2/p1), carry each in its own call and join them there:
#   call 1a carry [".gpu/a1"]  mkdir -p /tmp/stage && cp .gpu/a1/p0 /tmp/stage/
#   call 1b carry [".gpu/a2"]  cat /tmp/stage/p0 .gpu/a2/p1 > /tmp/stage/part_aa && rm /tmp/stage/p0
#   call 2  carry [".gpu/b", ".bench_anchor"]    bash benchmarks/gpu_session.sh install anchors gputests torchtitan trainer
#   call 3  (within 30 s of call 2)              bash benchmarks/gpu_session.sh rlsystem
#   call 4  (within 30 s of call 3)              bash benchmarks/gpu_session.sh vllmalone respcost
#   call 5  (within 30 s of call 4)              bash benchmarks/gpu_session.sh gpue2e
#
# 12-05, third session: six refused starts (~90 s of device time each) before one H100 came; then 1a, 1b,
# `install anchors tokhead lmhead rlchat` (447 s: install 35, anchors 14, tokhead 13, lmhead 58, rlchat 327 - at its
# 330 s limit on the H100), rl_samples by hand (204 s) and vllmalone (143 s). Results: rl_system.md, lm_head.md.
# Since 6472f17 `rl`'s default route is samples (api = "auto"), so `rlsystem` / `rlsplit` / `rl8b` measure it;
# `rlchat` names chat for the A/B.
# 12-05, fourth session (H100, `nvidia-h100-x1`, no refusal): 1a, 1b, `install anchors rlcoloc` (432 s: rlcoloc 388),
# `gputests lmhead trainer torchtitan` (296 s: 136, 49, 75, 36), `gpue2e` (500 s), `rlsplit` (217 s), `packed` (82 s):
# 1,620 s of device time with the start. Results: rl_system.md, lm_head.md, trainer.md, rl_trainer.md.
# 12-05, fifth session (H100, no refusal, three machine starts): 1a, 1b, 1c (carry .gpu/c: vLLM's MoE ops), then
# `install anchors moeops trainerprof reshard` (339 s), later `install anchors moeops reshard moemismatch` (305 s),
# `gputests_more lmhead` (109 s), `rlsamples` (151 s), and on a third start `install anchors rlsamplesresh rlsamples`
# (455 s): 1,675 s with the starts. Results: rl_trainer.md, rl_system.md, moe_mismatch.md, lm_head.md.
# Next session: `moeops moemismatch` (#32: router/* was absent in `rl` because compiled blocks skipped the
# comparison; moe_mismatch.py --gpu now runs eager blocks), `kernels` (the grouped GEMM and Mamba-2 GPU tests), then
# `trainer torchtitan packed` (#31: one call for the anchor and both row kinds at the new defaults).
# Before (12-05, third session's plan): `rlsplit vllmalone` then `rlsamples` on an H200 (the issue's 1.2x is against vLLM alone with the
# same share, which the H100's 80 GB does not give), `gputests` (GPU parity through the samples route), then
# `trainer torchtitan packed` (#31, with the token-loss head) and `gputests_more lora`.
# Earlier plan (after 12-05's first sessions): `install anchors gputests` (GPU parity through the samples route too), then
# `rlsamples respcost` (the samples route against the chat rollouts of 12-05's rlsystem, 11.7k tok/s), then
# `rlsystem` (the engine's steps of a push, `worker_phases_s.engine`, and step 2 without the buffer allocation).
# No device was lent on 12-05 (second session), so that plan stands; `rlsystem` (split: the orchestrator's
# filesystem loads; colocated: the trainer's ipc pushes) also confirms #33's one fan-out (common.servers.ServerSet,
# 4a94802) changed nothing: same step walls, publish and load times as 12-05's 05:44 run within its spread.
# If time is left: `gputests_more lora` (the LoRA publisher on CUDA, and its loop's blocked time per step), and
# `trainer torchtitan packed` (#31: one call for the anchor and both row kinds).
#
# Measured on 2026-12-04 (one H200, warm machine): install 25 s, gputests ~240 s, torchtitan 33 s, trainer 74 s,
# rlsystem 531 s (split, colocated and vLLM alone), gpue2e ~500 s (its two colocated runs 155 s each): with the
# first call's start-up and the idle gaps the four calls take ~25 of the 30 minutes. On 2026-12-05: ipctests 102 s,
# split + colocated 493 s (vLLM alone then ran out of the item's limit, hence its own item), rl8b 295 s (killed
# early), and a machine taken back mid-call cost one restart (~2 minutes): plan for one lost call.
# Later on 12-05: install+anchors+ipctests+pinned 268 s, rlsystem 505 s, rl8b 395 s (ran to the end), vllmalone 100 s,
# respcost > 270 s (4 of its 5 rounds): with a failed first start (~90 s) the session used 1,778 s.
#
# The anchors (../shared/bench, which does not travel) go in .bench_anchor/ (git-ignored) with their wheels,
# beside the pure-Python wheels the project needs that neither the machine nor the vLLM bundle has (tomli_w):
#   mkdir -p .bench_anchor/whl && cp ../shared/bench/anchor_*.py .bench_anchor/
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .bench_anchor/whl \
#     torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0 liger-kernel==0.8.5 \
#     tomli_w==1.2.0
#
# `bash benchmarks/gpu_session.sh --list` prints the items with their time limits; `--dry-run ITEM...` prints
# what they would run. Each item runs under its own limit (a hung item costs its limit, not the call), its
# output goes to $OUT/<item>.log, and one JSON line per item (rc, seconds) to $OUT/items.jsonl and stdout.
# Items that need vLLM check that the bundle is installed on this machine (a fresh machine lost /tmp).
# Results are read from $OUT by hand into benchmarks/results/*.md (the benchmarks print JSON lines).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH=/tmp/site:$SRC${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
# --strict-markers is left out: without pytest-xdist (the GPU machine has none) `xdist_group` is unregistered
PYTEST="$PY -m pytest -q -s -p no:cacheprovider -o addopts=--import-mode=importlib -m gpu"

# name | seconds | command. Commands run with bash from the repository root, PYTHONPATH as above.
ITEMS=(
  "install|150|[ -d /tmp/site/vllm ] || bash .gpu/b/install_on_gpu.sh"
  # the wheels, then every entrypoint imported: a dependency the machine lacks fails here, in seconds
  "anchors|120|$PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .bench_anchor/whl/*.whl && $PY -c 'import prime_rl.launcher.rl, prime_rl.orchestrator.entrypoint, prime_rl.inference.server, prime_rl.trainer.rl.train, prime_rl.trainer.sft.train'"
  "kernels|240|$PYTEST packages/kernels/tests/test_lm_head_triton_gpu.py packages/kernels/tests/test_lm_head_ce.py packages/kernels/tests/test_grouped_gemm_gpu.py packages/trainer/tests/models/test_dense_attention.py packages/trainer/tests/models/test_gpu_attention.py packages/trainer/tests/models/test_gpu_nemotron_h.py packages/trainer/tests/test_colocate.py packages/trainer/tests/test_offload_gpu.py"
  # the fused heads on CUDA (the token-loss head's row kernel with its entropy output, and the NLL head)
  "tokhead|150|$PYTEST packages/kernels/tests/test_lm_head_token_loss.py packages/kernels/tests/test_lm_head_ce.py"
  "gputests|300|$PYTEST tests/test_weight_ipc.py tests/test_server_ipc.py tests/test_logprob_parity.py"
  # the ipc half of gputests alone, for a session whose changes touch only the weight update
  "ipctests|200|$PYTEST tests/test_weight_ipc.py tests/test_server_ipc.py"
  "gpue2e|580|$PYTEST tests/test_rl_e2e.py"
  "gputests_more|300|$PYTEST packages/trainer/tests/test_lora_rl.py packages/trainer/tests/parallel/test_scaling.py tests/test_router_replay_gpu.py"
  # split and colocated: ~500 s on 12-05, which left the vLLM-alone baseline no room in one item; it is its own item
  "rlsystem|560|$PY benchmarks/rl_system.py --colocated both --steps 3 --warmup 1 --no-baseline"
  "vllmalone|240|$PY benchmarks/rl_system.py --colocated none --baseline-timeout 200"
  # colocated with the samples route (api = "samples": ids and logprobs as arrays) against rlsystem's chat rollouts
  # the same run with the chat route, for an A/B of the two routes in one call (rlchat then rlsamples); named:
  # since 6472f17 the default (api = "auto") is the samples route for rl_system.py's one server
  "rlchat|400|$PY benchmarks/rl_system.py --colocated yes --steps 3 --warmup 1 --no-baseline --name rl_chat --extra --orchestrator.model.client.api chat"
  # split alone (the orchestrator's filesystem loads through common.servers.ServerSet)
  "rlsplit|330|$PY benchmarks/rl_system.py --colocated no --steps 3 --warmup 1 --no-baseline"
  # colocated (the default samples route) then vLLM alone with the share the launcher gave the colocated run's vLLM:
  # #29's like-for-like rollout rate on any card (the split share, 0.35, queues the 256 sequences on an 80 GB one)
  "rlcoloc|560|$PY benchmarks/rl_system.py --colocated yes --steps 3 --warmup 1 --baseline-timeout 200 --name rl_coloc"
  "rlsamples|400|$PY benchmarks/rl_system.py --colocated yes --steps 3 --warmup 1 --no-baseline --name rl_samples --extra --orchestrator.model.client.api samples"
  # the colocated rlsamples run with the weights resharded after every forward: the A/B for `reshard_after_forward
  # = "auto"` (kept gathered once a step) in the whole RL step
  "rlsamplesresh|400|$PY benchmarks/rl_system.py --colocated yes --steps 3 --warmup 1 --no-baseline --name rl_samples_resh --extra --orchestrator.model.client.api samples --trainer.model.reshard-after-forward true"
  "rl8b|560|$PY benchmarks/rl_system.py --shape qwen3-8b --colocated yes --steps 3 --warmup 1 --no-baseline --name rl8b"
  "trainer|300|$PY benchmarks/trainer.py --shape qwen3-1.7b && $PY benchmarks/rl_trainer.py --shape qwen3-1.7b"
  # packed-document rows (random sample lengths 2..seq_len/2 in 8192-token rows), RL and SFT alike (#31 item 3)
  "packed|300|$PY benchmarks/rl_trainer.py --shape qwen3-1.7b --generate-samples --with-sft"
  # the real loops profiled (steps 4-5): sft and the RL trainer on the same fake rows, kernels side by side (#31:
  # the RL trainer runs 0.81-0.86x sft on the same rows; is the gap device work or idle time?)
  "trainerprof|300|PRIME_RL_PROFILE_DIR=$OUT/prof_sft $PY benchmarks/trainer.py --shape qwen3-1.7b --steps 6 && PRIME_RL_PROFILE_DIR=$OUT/prof_rl $PY benchmarks/rl_trainer.py --shape qwen3-1.7b --steps 6 && rm -f $OUT/prof_*/trace.json && $PY benchmarks/trainer_profile.py compare $OUT/prof_sft $OUT/prof_rl"
  # real-shaped RL batches (256 rollouts, ~32 forwards of 8k tokens a step) at defaults (`reshard_after_forward =
  # "auto"`: kept gathered once a step where the plan fits, since 2026-12-05), then resharded after every forward
  "reshard|360|$PY benchmarks/rl_trainer.py --shape qwen3-1.7b --seq-len 2048 --rollouts 256 --defaults --steps 6 --warmup 2 && $PY benchmarks/rl_trainer.py --shape qwen3-1.7b --seq-len 2048 --rollouts 256 --defaults --steps 6 --warmup 2 --extra --model.reshard-after-forward true"
  # the LoRA RL loop's publish (0.41 s blocked on 12-02; the adapter's copy goes through HostStaging since 12-05)
  "lora|240|$PY benchmarks/rl_trainer.py --steps 10 --extra --model.offload none --model.ac-offloading None --model.lora.rank 16"
  "torchtitan|330|$PY .bench_anchor/anchor_torchtitan.py --config qwen3-1.7b"
  "liger|240|$PY .bench_anchor/anchor_liger.py qwen3-1.7b"
  # with the device time per kernel of the RL and SFT heads at 64k tokens (#31: the RL head's 1.135x there)
  "lmhead|200|$PY benchmarks/lm_head.py --anchor .bench_anchor/anchor_hf_train.py --profile token_loss nll_sum"
  "respcost|300|$PY benchmarks/response_cost.py --shape qwen3-1.7b --concurrent 32 --gpu-memory-utilization 0.35 --reps 3"
  # exact-size pinned host memory; the offload test's sft runs need pydantic and tomli_w (install, anchors)
  "pinned|240|$PYTEST packages/common/tests/test_weight_sync_pinned.py packages/trainer/tests/test_offload_gpu.py && $PY benchmarks/pinned_host_memory.py"
  # vLLM's MoE ops (left out of the bundle): staged as /tmp/stage/moe_C.so.xz by a call carrying .gpu/c (40 MB:
  #   python3 -c "import zipfile; zipfile.ZipFile('vllm-0.26.0-...whl').extract('vllm/_moe_C_stable_libtorch.abi3.so')"
  #   xz -9 -c vllm/_moe_C_stable_libtorch.abi3.so > .gpu/c/moe_C.so.xz), needed by MoE serving (router replay)
  "moeops|60|xz -d -c /tmp/stage/moe_C.so.xz > /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so && $PY -c 'import torch, vllm._moe_C_stable_libtorch'"
  # #32: a tiny Qwen3-MoE in rl on one GPU: mismatch_kl and the fraction of tokens routed differently, then replayed
  "moemismatch|420|$PY benchmarks/moe_mismatch.py --gpu --routed-experts --steps 6 && $PY benchmarks/moe_mismatch.py --gpu --router-replay --steps 6"
  "moe|240|$PY benchmarks/grouped_gemm.py && $PY benchmarks/grouped_gemm.py --experts 16 --tokens 2048"
)

item_field() {  # item_field NAME FIELD(1 name, 2 seconds, 3 command)
  local entry
  for entry in "${ITEMS[@]}"; do
    if [ "${entry%%|*}" = "$1" ]; then
      echo "$entry" | cut -d'|' -f"$2"-"$([ "$2" = 3 ] && echo 99 || echo "$2")"
      return 0
    fi
  done
  return 1
}

if [ "${1:-}" = "--list" ]; then
  for entry in "${ITEMS[@]}"; do echo "$entry" | awk -F'|' '{printf "%-14s %4ss\n", $1, $2}'; done
  exit 0
fi
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
[ $# -gt 0 ] || { echo "usage: gpu_session.sh [--list | --dry-run] ITEM [ITEM ...] (items: --list)" >&2; exit 2; }
for name in "$@"; do  # every name is checked before anything runs: a typo must not cost device time
  item_field "$name" 1 > /dev/null || { echo "unknown item '$name'; the items are: $(bash "$0" --list | awk '{print $1}' | tr '\n' ' ')" >&2; exit 2; }
done

BENCH=/tmp/prime-rl-bench  # the benchmarks' default workdir: models (GBs) stay there, pictures and log tails come back
save_bench_files() {
  mkdir -p "$OUT/bench"
  cp "$BENCH"/*.svg "$OUT/bench/" 2>/dev/null
  local f
  cp "$BENCH"/*.metrics.jsonl "$OUT/bench/" 2>/dev/null
  for f in "$BENCH"/*.log; do [ -f "$f" ] && tail -c 300000 "$f" > "$OUT/bench/$(basename "$f")"; done
  return 0
}

needs_vllm() { case "$1" in gputests | ipctests | vllmalone | pinned | gpue2e | gputests_more | rlsystem | rlchat | rlsplit | rlcoloc | rlsamples | rlsamplesresh | rl8b | respcost | moeops | moemismatch) return 0 ;; *) return 1 ;; esac; }

status=0
for name in "$@"; do
  limit=$(item_field "$name" 2)
  cmd=$(item_field "$name" 3)
  if [ $dry = 1 ]; then echo "$name (${limit}s): $cmd"; continue; fi
  if needs_vllm "$name" && [ ! -d /tmp/site/vllm ]; then
    echo "{\"item\": \"$name\", \"rc\": null, \"skipped\": \"no vLLM in /tmp/site: this machine is fresh; stage .gpu/a and run install first\"}" | tee -a "$OUT/items.jsonl"
    status=1
    continue
  fi
  start=$(date +%s)
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)" >&2
  timeout -k 15 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "{\"item\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start)), \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)}" | tee -a "$OUT/items.jsonl"
  tail -n 25 "$OUT/$name.log"
  save_bench_files
  [ $rc = 0 ] || status=1
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/hardware.txt" 2>/dev/null || true
exit $status
