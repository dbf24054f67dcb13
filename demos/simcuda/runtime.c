/* Simulated CUDA runtime API (libcudart.so.12). Like the real runtime it keeps a current device
 * per thread and reports cudaError_t codes; memory comes from the model in libcuda.so.1. With
 * SIMCUDA_EVENTS set, every call is also logged (for demos on machines without eBPF rights). */
#include "simcuda.h"

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaMemPool_t;

#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorMemoryAllocation 2
#define cudaErrorInvalidDevice 101

#define API __attribute__((visibility("default")))

/* Entry timestamps of the call in progress; RECORD logs it with its result. */
#define BEGIN(op)                        \
    const char *op_ = (op);              \
    uint64_t ts_ = sim_realtime_ns();    \
    uint64_t mono_ = sim_mono_ns();      \
    sim_delay(op_)
#define RECORD(ret, size, ptr, aux0, aux1) \
    (sim_record(op_, ts_, mono_, (ret), (size), (ptr), (aux0), (aux1)), (ret))

static cudaError_t status_of(int s) {
    switch (s) {
    case SIM_OK: return cudaSuccess;
    case SIM_OOM: return cudaErrorMemoryAllocation;
    case SIM_BAD_DEVICE: return cudaErrorInvalidDevice;
    default: return cudaErrorInvalidValue;
    }
}

static cudaError_t alloc_in(enum sim_space space, const char *op, void **ptr, size_t size) {
    BEGIN(op);
    if (!ptr) return RECORD(cudaErrorInvalidValue, size, SIM_NONE, SIM_NONE, SIM_NONE);
    uint64_t out = 0;
    cudaError_t r = status_of(sim_alloc(space, size, &out));
    if (r == cudaSuccess) *ptr = (void *)(uintptr_t)out;
    return RECORD(r, size, r == cudaSuccess ? out : SIM_NONE, SIM_NONE, SIM_NONE);
}

static cudaError_t free_in(enum sim_space space, const char *op, void *ptr) {
    BEGIN(op);
    cudaError_t r = status_of(sim_free(space, (uint64_t)(uintptr_t)ptr));
    return RECORD(r, SIM_NONE, (uint64_t)(uintptr_t)ptr, SIM_NONE, SIM_NONE);
}

API cudaError_t cudaMalloc(void **ptr, size_t size) { return alloc_in(SIM_DEVICE, "cudaMalloc", ptr, size); }
API cudaError_t cudaFree(void *ptr) { return free_in(SIM_DEVICE, "cudaFree", ptr); }
API cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t s) { (void)s; return alloc_in(SIM_DEVICE, "cudaMallocAsync", ptr, size); }
API cudaError_t cudaMallocAsync_ptsz(void **ptr, size_t size, cudaStream_t s) { (void)s; return alloc_in(SIM_DEVICE, "cudaMallocAsync", ptr, size); }
API cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t s) {
    (void)pool; (void)s;
    return alloc_in(SIM_DEVICE, "cudaMallocFromPoolAsync", ptr, size);
}
API cudaError_t cudaFreeAsync(void *ptr, cudaStream_t s) { (void)s; return free_in(SIM_DEVICE, "cudaFreeAsync", ptr); }
API cudaError_t cudaFreeAsync_ptsz(void *ptr, cudaStream_t s) { (void)s; return free_in(SIM_DEVICE, "cudaFreeAsync", ptr); }
API cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned flags) { (void)flags; return alloc_in(SIM_DEVICE, "cudaMallocManaged", ptr, size); }
API cudaError_t cudaMallocHost(void **ptr, size_t size) { return alloc_in(SIM_HOST, "cudaMallocHost", ptr, size); }
API cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned flags) { (void)flags; return alloc_in(SIM_HOST, "cudaHostAlloc", ptr, size); }
API cudaError_t cudaFreeHost(void *ptr) { return free_in(SIM_HOST, "cudaFreeHost", ptr); }

API cudaError_t cudaMallocPitch(void **ptr, size_t *pitch, size_t width, size_t height) {
    BEGIN("cudaMallocPitch");
    if (!ptr || !pitch) return RECORD(cudaErrorInvalidValue, SIM_NONE, SIM_NONE, SIM_NONE, width);
    size_t p = (width + 511) & ~(size_t)511;
    uint64_t out = 0;
    cudaError_t r = status_of(sim_alloc(SIM_DEVICE, p * height, &out));
    if (r == cudaSuccess) { *ptr = (void *)(uintptr_t)out; *pitch = p; }
    return RECORD(r, r == cudaSuccess ? p * height : SIM_NONE, r == cudaSuccess ? out : SIM_NONE, p, width);
}

API cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    BEGIN("cudaMemGetInfo");
    if (!free_bytes || !total_bytes) return RECORD(cudaErrorInvalidValue, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE);
    sim_mem_info(free_bytes, total_bytes);
    return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, *free_bytes, *total_bytes);
}

API cudaError_t cudaSetDevice(int device) {
    BEGIN("cudaSetDevice");
    return RECORD(status_of(sim_set_device(device)), SIM_NONE, SIM_NONE, (uint64_t)device, SIM_NONE);
}
API cudaError_t cudaGetDevice(int *device) { if (!device) return cudaErrorInvalidValue; *device = sim_get_device(); return cudaSuccess; }
API cudaError_t cudaGetDeviceCount(int *count) { if (!count) return cudaErrorInvalidValue; *count = sim_device_count(); return cudaSuccess; }
API cudaError_t cudaDeviceSynchronize(void) { BEGIN("cudaDeviceSynchronize"); return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE); }
/* Not through the exported symbol: that call would be probed as a second cudaStreamSynchronize. */
static cudaError_t stream_sync(cudaStream_t s) {
    BEGIN("cudaStreamSynchronize");
    return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)s, SIM_NONE);
}
API cudaError_t cudaStreamSynchronize(cudaStream_t s) { return stream_sync(s); }
API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) { return stream_sync(s); }
