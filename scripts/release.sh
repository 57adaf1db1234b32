#!/usr/bin/env bash
# Build the release: a wheel and an sdist of each of the six packages, all at one version, into dist/.
#
#   scripts/release.sh                 # build into dist/ (the wheel is built from the sdist, so a file
#                                      # missing from the sdist fails here, not on a user's machine)
#   DIST=/tmp/d scripts/release.sh     # elsewhere
#   python -m twine upload dist/*      # publish (not done here); upload prime-rl-common first
#
# The packages are released in lockstep: every pyproject.toml carries the same version, and siblings
# depend on each other with `>=X.Y.0,<X.(Y+1)` bounds (tests/test_packaging.py checks both). To release
# a new version, change `version` in packages/*/pyproject.toml and the sibling bounds together.
#
# Env: PYTHON (default .venv/bin/python; needs `build`), DIST (default dist/),
#      ISOLATED=1 builds in isolated environments (downloads hatchling) instead of the venv's hatchling.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DIST="${DIST:-$ROOT/dist}"
PACKAGES=(common kernels trainer inference orchestrator launcher)

version_of() { "$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$1"; }

VERSION="$(version_of "$ROOT/packages/common/pyproject.toml")"
for p in "${PACKAGES[@]}"; do
  v="$(version_of "$ROOT/packages/$p/pyproject.toml")"
  [[ "$v" == "$VERSION" ]] || { echo "release: prime-rl-$p is at $v, prime-rl-common at $VERSION; release them together" >&2; exit 2; }
done

isolation=(--no-isolation)
[[ "${ISOLATED:-0}" == 1 ]] && isolation=()
mkdir -p "$DIST"
for p in "${PACKAGES[@]}"; do
  rm -f "$DIST"/prime_rl_"$p"-"$VERSION"{-*.whl,.tar.gz}
  if ! log="$("$PYTHON" -m build --sdist --wheel "${isolation[@]}" --outdir "$DIST" "$ROOT/packages/$p" 2>&1)"; then
    echo "$log" >&2
    echo "release: building prime-rl-$p failed" >&2
    exit 1
  fi
  echo "built $DIST/prime_rl_$p-$VERSION.tar.gz and its wheel"
done
echo "release $VERSION: $(ls "$DIST"/prime_rl_*-"$VERSION"* | wc -l) files in $DIST"
