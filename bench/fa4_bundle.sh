#!/usr/bin/env bash
# FlashAttention-4 and its libraries for a machine with no network, as one xz archive (~56 MB).
# Python 3.12, x86-64, CUDA 13. Usage: bash bench/fa4_bundle.sh OUTDIR
#
#   bash bench/fa4_bundle.sh .fa4            # here (needs PyPI): writes .fa4/fa4.tar.xz
#   S=/tmp/site4; mkdir -p $S; xz -d < .fa4/fa4.tar.xz | tar xf - -C $S       # there
#   export PYTHONPATH=$S:$S/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
#
# The wheels are unpacked (not installed) and re-packed with xz's x86 filter, which compresses the
# 193 MB compiler library ~10% better than plain xz. Left out, as not needed to compile and run the
# kernels: torch-c-dlpack-ext (no build for torch >= 2.10, which exchanges DLPack natively), the
# aarch64 stubs, tvm-ffi's third-party texts and the CuTe DSL profiler's injection library.
set -euo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,12p' "$0" | cut -c3-; [ -n "${1:-}" ]; exit;; esac
out=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$work/wheels" \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
rm -rf "$work/site/tvm_ffi/3rdparty" "$work/site/nvidia_cutlass_dsl/cu13/lib/stubs" \
  "$work/site/nvidia_cutlass_dsl/dsl_packages/iket/profiler/libiket_injection.so"
mkdir -p "$out"
tar cf - -C "$work/site" . | xz --x86 --lzma2=preset=9e,dict=192MiB > "$out/fa4.tar.xz"
ls -l "$out/fa4.tar.xz"
