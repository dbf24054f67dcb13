/* A library that takes device memory past the CUDA runtime, as cuBLAS takes its workspaces and
 * NCCL its buffers: cuMemAlloc_v2 from its own code, so a traced call's stack names it.
 * Built twice (build.sh): libsimcublas.so with ENTRY=simcublasWorkspace and libsimnccl.so with
 * ENTRY=simncclBuffer. */
#include <stddef.h>
#include <stdint.h>

#ifndef ENTRY
#error "build with -DENTRY=<the function's name>"
#endif

typedef uint64_t CUdeviceptr;
int cuMemAlloc_v2(CUdeviceptr *dptr, size_t size);

/* Takes `bytes` of device memory for the library's own use; returns the CUDA status. */
__attribute__((visibility("default"), noinline)) int ENTRY(size_t bytes, CUdeviceptr *out) {
    return cuMemAlloc_v2(out, bytes);
}
