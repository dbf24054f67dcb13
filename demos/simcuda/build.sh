#!/usr/bin/env bash
# Builds the simulated CUDA runtime and the test driver into $1 (default: target/simcuda).
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
out=${1:-$src/../../target/simcuda}
mkdir -p "$out"
# Frame-pointer prologues on every entry point, as in the real libcudart: -O2 would turn
# `return alloc_in(...)` into a tail jump whose first instruction (mov) uprobes single-step,
# about 12x dearer than the `push %rbp` they emulate.
cflags=(-O2 -g -fno-omit-frame-pointer -fno-optimize-sibling-calls -Wall -Wextra -fPIC)
cc "${cflags[@]}" -shared -fvisibility=hidden -o "$out/libcuda.so.1" -Wl,-soname,libcuda.so.1 \
  -Wl,--version-script="$src/libcuda.map" "$src/model.c" "$src/driver_api.c" -lpthread
# The model's sim_* functions are exported by libcuda.so.1 for the runtime; the runtime links it.
cc "${cflags[@]}" -shared -fvisibility=hidden -o "$out/libcudart.so.12" -Wl,-soname,libcudart.so.12 \
  -Wl,--version-script="$src/libcudart.map" "$src/runtime.c" -L"$out" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
# PyTorch's own probes (USDT, sys/sdt.h) for the simulated caching allocator.
cc "${cflags[@]}" -shared -fvisibility=hidden -o "$out/libsimtorch.so" "$src/torchprobes.c" \
  -L"$out" -l:libcudart.so.12 -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
# Libraries that take device memory past the runtime (cuBLAS's workspaces, NCCL's buffers).
# libsimnccl.so also has NCCL's ncclMemAlloc / ncclMemFree (an NCCL MemPool's segments).
for lib in simcublas:simcublasWorkspace: simnccl:simncclBuffer:-DNCCL_MEM; do
  IFS=: read -r name entry extra <<<"$lib"
  cc "${cflags[@]}" -shared -fvisibility=hidden -DENTRY="$entry" ${extra:+"$extra"} -o "$out/lib$name.so" "$src/extlib.c" \
    -L"$out" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN'
done
# The management library PyTorch's out-of-memory message asks which processes use the device.
cc "${cflags[@]}" -shared -fvisibility=hidden -o "$out/libnvidia-ml.so.1" -Wl,-soname,libnvidia-ml.so.1 "$src/nvml.c"
cc "${cflags[@]}" -o "$out/simdriver" "$src/simdriver.c" -ldl -lpthread
# The long training job (demos/workloads/long_job.py in C, for the flight recorder's benchmark).
cc "${cflags[@]}" -o "$out/simjob" "$src/simjob.c" -ldl
# A short program that loads the runtime it is given and allocates at once (discovery's tests).
cc "${cflags[@]}" -o "$out/burst" "$src/burst.c" -ldl
# The same runtime linked into an executable, as statically linked CUDA programs do.
cc "${cflags[@]}" -o "$out/staticapp" "$src/staticapp.c" "$src/runtime.c" "$src/model.c" "$src/driver_api.c" -lpthread
echo "$out"
