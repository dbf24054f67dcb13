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

#ifdef NCCL_MEM
/* NCCL's ncclMemAlloc / ncclMemFree (the memory PyTorch's NCCL MemPool takes its segments from,
 * through a pluggable allocator): as NCCL makes it, with the driver's virtual memory calls from
 * NCCL's own code (a physical allocation, an address range, the one mapped into the other), no
 * cudaMalloc. Sizes rounded to the 2 MiB granularity. */
typedef uint64_t CUmemGenericAllocationHandle;
int cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop, unsigned long long flags);
int cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
int cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
int cuMemUnmap(CUdeviceptr ptr, size_t size);
int cuMemRelease(CUmemGenericAllocationHandle handle);
int cuMemAddressFree(CUdeviceptr ptr, size_t size);

#define GRANULARITY ((size_t)2 << 20)
#define MAX_ALLOCS 1024
static struct { CUdeviceptr ptr; size_t size; CUmemGenericAllocationHandle handle; } allocs[MAX_ALLOCS];

/* ncclResult_t: 0 success, 1 unhandled CUDA error (here: the device had no room). */
__attribute__((visibility("default"), noinline)) int ncclMemAlloc(void **ptr, size_t size) {
    size = (size + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    int slot = -1;
    for (int i = 0; i < MAX_ALLOCS && slot < 0; i++)
        if (!allocs[i].ptr) slot = i;
    if (slot < 0) return 1;
    CUmemGenericAllocationHandle handle;
    if (cuMemCreate(&handle, size, 0, 0)) return 1;
    CUdeviceptr va;
    if (cuMemAddressReserve(&va, size, GRANULARITY, 0, 0)) {
        cuMemRelease(handle);
        return 1;
    }
    if (cuMemMap(va, size, 0, handle, 0)) {
        cuMemAddressFree(va, size);
        cuMemRelease(handle);
        return 1;
    }
    allocs[slot].ptr = va;
    allocs[slot].size = size;
    allocs[slot].handle = handle;
    *ptr = (void *)(uintptr_t)va;
    return 0;
}

__attribute__((visibility("default"), noinline)) int ncclMemFree(void *ptr) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].ptr != (CUdeviceptr)(uintptr_t)ptr) continue;
        cuMemUnmap(allocs[i].ptr, allocs[i].size);
        cuMemRelease(allocs[i].handle);
        cuMemAddressFree(allocs[i].ptr, allocs[i].size);
        allocs[i].ptr = 0;
        return 0;
    }
    return 4; /* ncclInvalidArgument */
}
#endif
