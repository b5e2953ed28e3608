#!/usr/bin/env bash
# Build the release wheel users install without Rust, and prove it needs none:
#
#   scripts/build-wheel.sh OUTDIR
#
# 1. `maturin build --release --zig --compatibility manylinux2014`: one abi3 wheel (CPython
#    3.9 and later) for this machine's architecture, linked by zig against glibc 2.17, so
#    any manylinux2014 system loads it. maturin, ziglang and auditwheel come from PyPI into
#    a throwaway venv.
# 2. `auditwheel show` must find it consistent with manylinux2014 (glibc <= 2.17), else fail.
# 3. A fresh venv with no Rust toolchain on PATH (~/.cargo/bin and rustup's folders removed,
#    `command -v cargo` checked to fail) installs it (binary wheels only, nothing built) and
#    runs `stcast demo`.
# Then the wheel is copied into OUTDIR. Cargo builds in $CARGO_TARGET_DIR/wheel (default
# target/wheel), apart from the development build, so neither rebuilds the other.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/wheel"

work=$(mktemp -d "${TMPDIR:-/tmp}/stcast-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== build tools (maturin, ziglang, auditwheel) in a throwaway venv"
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q "maturin>=1.9.4,<2" ziglang auditwheel
"$work/tools/bin/pip" list --format=freeze | grep -iE '^(maturin|ziglang|auditwheel)=' | tr '\n' ' '
echo

echo "== maturin build --release --zig --compatibility manylinux2014"
t0=$SECONDS
# maturin runs zig as `python3 -m ziglang` from the venv first on PATH.
PATH="$work/tools/bin:$PATH" maturin build --release --zig --compatibility manylinux2014 \
    -o "$work/dist"
shopt -s nullglob
wheels=("$work"/dist/*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "expected one wheel, got: ${wheels[*]}" >&2; exit 1; }
wheel=${wheels[0]}
name=$(basename "$wheel")
echo "built $name ($(du -k "$wheel" | cut -f1) KiB) in $((SECONDS - t0)) s"
case "$name" in
    *-abi3-manylinux*) ;;
    *) echo "$name: not an abi3 manylinux wheel" >&2; exit 1 ;;
esac

echo "== auditwheel show"
show=$("$work/tools/bin/auditwheel" show "$wheel")
echo "$show"
# "... is consistent with the following platform tag: "manylinux_2_17_x86_64"." (wrapped)
tag=$(tr -s '\n ' '  ' <<<"$show" | grep -o 'consistent with the following platform tag: "[^"]*"' |
    cut -d'"' -f2)
if [[ ! "$tag" =~ ^manylinux_2_([0-9]+)_ ]] || [ "${BASH_REMATCH[1]}" -gt 17 ]; then
    echo "auditwheel: $name is not manylinux2014 (glibc <= 2.17): ${tag:-no manylinux tag}" >&2
    exit 1
fi

echo "== the extension's libc symbols are all in glibc 2.17"
# zig links against glibc 2.17's symbol list: a function glibc added later (renameat2 in 2.28,
# getrandom in 2.25) is left unversioned, which auditwheel does not see, and Python's import
# fails on an older glibc with "undefined symbol". The engine calls such functions through
# syscall(2) instead; weak ones (`w`, looked up at run time by Rust's std) are fine.
(cd "$work" && python3 -m zipfile -e "$wheel" unpacked)
so=$(find "$work/unpacked" -name '_core*.so')
[ -n "$so" ] || { echo "no _core*.so in $name" >&2; exit 1; }
unversioned=$(nm -D --undefined-only "$so" | awk '$1 == "U" && $2 !~ /@/ && $2 !~ /^_?Py/ {print $2}')
if [ -n "$unversioned" ]; then
    echo "$name needs libc functions glibc 2.17 lacks: ${unversioned//$'\n'/ }" >&2
    exit 1
fi
echo "none beyond glibc 2.17 (undefined and unversioned: only Python's C API)"

echo "== a fresh venv, no Rust on PATH: pip install the wheel, stcast demo"
python3 -m venv "$work/run"
no_rust=$(tr ':' '\n' <<<"$PATH" | grep -v -e '\.cargo/bin' -e 'rustup' | paste -sd: -)
# shellcheck disable=SC2016 # expanded by the inner shell, from its environment
env -u CARGO_HOME -u RUSTUP_HOME -u RUSTUP_TOOLCHAIN PATH="$work/run/bin:$no_rust" \
    WHEEL="$wheel" DEMO_DIR="$work" bash -euo pipefail -c '
    if command -v cargo; then echo "cargo is still on PATH" >&2; exit 1; fi
    if command -v rustc; then echo "rustc is still on PATH" >&2; exit 1; fi
    echo "no cargo, no rustc on PATH"
    cd "$DEMO_DIR"
    pip install -q --only-binary :all: "$WHEEL"
    stcast --version
    stcast demo --dir "$DEMO_DIR"
'

cp "$wheel" "$out/"
echo "== $out/$name"
