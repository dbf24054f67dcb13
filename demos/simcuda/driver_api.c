/* Simulated CUDA driver API (libcuda.so.1): the allocation calls tracer probes. */
#include "simcuda.h"

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef uint64_t CUmemGenericAllocationHandle;
typedef struct { int type, requestedHandleTypes, location_type, location_id; } CUmemAllocationProp;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_DEVICE 101

#define API __attribute__((visibility("default")))

static CUresult status_of(int s) {
    switch (s) {
    case SIM_OK: return CUDA_SUCCESS;
    case SIM_OOM: return CUDA_ERROR_OUT_OF_MEMORY;
    case SIM_BAD_DEVICE: return CUDA_ERROR_INVALID_DEVICE;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

API CUresult cuInit(unsigned flags) { (void)flags; sim_delay("cuInit"); return CUDA_SUCCESS; }

/* Contexts: each device's primary context, made a thread's current one with cuCtxSetCurrent
 * (the thread's device is then that context's, as the runtime's calls see it). */
typedef struct sim_context { int device; } *CUcontext;
static struct sim_context primary[64];

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, int device) {
    sim_delay("cuDevicePrimaryCtxRetain");
    if (!pctx || device < 0 || device >= sim_device_count() || device >= 64) return CUDA_ERROR_INVALID_DEVICE;
    primary[device].device = device;
    *pctx = &primary[device];
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    sim_delay("cuCtxSetCurrent");
    if (!ctx) return CUDA_SUCCESS;
    if (ctx < &primary[0] || ctx >= &primary[64]) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_set_device(ctx->device));
}

API CUresult cuCtxGetDevice(int *device) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = sim_get_device();
    return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    sim_delay("cuMemAlloc_v2");
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_alloc(SIM_DEVICE, size, dptr));
}

API CUresult cuMemFree_v2(CUdeviceptr ptr) {
    sim_delay("cuMemFree_v2");
    return status_of(sim_free(SIM_DEVICE, ptr));
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
    (void)stream;
    sim_delay("cuMemAllocAsync");
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_alloc(SIM_DEVICE, size, dptr));
}

API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream stream) {
    (void)stream;
    sim_delay("cuMemAllocAsync");
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_alloc(SIM_DEVICE, size, dptr));
}

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
    (void)pool; (void)stream;
    sim_delay("cuMemAllocFromPoolAsync");
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_alloc(SIM_DEVICE, size, dptr));
}

API CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream stream) {
    (void)stream;
    sim_delay("cuMemFreeAsync");
    return status_of(sim_free(SIM_DEVICE, ptr));
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr ptr, CUstream stream) {
    (void)stream;
    sim_delay("cuMemFreeAsync");
    return status_of(sim_free(SIM_DEVICE, ptr));
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags) {
    (void)flags;
    sim_delay("cuMemAllocManaged");
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return status_of(sim_alloc(SIM_DEVICE, size, dptr));
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    sim_delay("cuMemGetInfo_v2");
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    sim_mem_info(free_bytes, total_bytes);
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags) {
    (void)addr; (void)flags;
    sim_delay("cuMemAddressReserve");
    return status_of(sim_va_reserve(size, alignment, ptr));
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    sim_delay("cuMemAddressFree");
    return status_of(sim_va_free(ptr, size));
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                         unsigned long long flags) {
    (void)flags;
    sim_delay("cuMemCreate");
    if (prop && prop->location_id != sim_get_device()) {
        int previous = sim_get_device();
        if (sim_set_device(prop->location_id) != SIM_OK) return CUDA_ERROR_INVALID_DEVICE;
        int s = sim_phys_create(size, handle);
        sim_set_device(previous);
        return status_of(s);
    }
    return status_of(sim_phys_create(size, handle));
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    sim_delay("cuMemRelease");
    return status_of(sim_phys_release(handle));
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags) {
    (void)offset; (void)flags;
    sim_delay("cuMemMap");
    return status_of(sim_map(ptr, size, handle));
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    sim_delay("cuMemUnmap");
    return status_of(sim_unmap(ptr, size));
}
