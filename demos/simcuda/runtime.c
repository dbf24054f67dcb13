/* Simulated CUDA runtime API (libcudart.so.12). Like the real runtime it keeps a current device
 * per thread and reports cudaError_t codes; memory comes from the model in libcuda.so.1. */
#include "simcuda.h"

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaMemPool_t;

#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorMemoryAllocation 2
#define cudaErrorInvalidDevice 101

#define API __attribute__((visibility("default")))

static cudaError_t status_of(int s) {
    switch (s) {
    case SIM_OK: return cudaSuccess;
    case SIM_OOM: return cudaErrorMemoryAllocation;
    case SIM_BAD_DEVICE: return cudaErrorInvalidDevice;
    default: return cudaErrorInvalidValue;
    }
}

static cudaError_t device_alloc(const char *op, void **ptr, size_t size) {
    sim_delay(op);
    if (!ptr) return cudaErrorInvalidValue;
    uint64_t out = 0;
    int s = sim_alloc(SIM_DEVICE, size, &out);
    if (s == SIM_OK) *ptr = (void *)(uintptr_t)out;
    return status_of(s);
}

static cudaError_t device_free(const char *op, void *ptr) {
    sim_delay(op);
    return status_of(sim_free(SIM_DEVICE, (uint64_t)(uintptr_t)ptr));
}

static cudaError_t host_alloc(const char *op, void **ptr, size_t size) {
    sim_delay(op);
    if (!ptr) return cudaErrorInvalidValue;
    uint64_t out = 0;
    int s = sim_alloc(SIM_HOST, size, &out);
    if (s == SIM_OK) *ptr = (void *)(uintptr_t)out;
    return status_of(s);
}

API cudaError_t cudaMalloc(void **ptr, size_t size) { return device_alloc("cudaMalloc", ptr, size); }
API cudaError_t cudaFree(void *ptr) { return device_free("cudaFree", ptr); }
API cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t s) { (void)s; return device_alloc("cudaMallocAsync", ptr, size); }
API cudaError_t cudaMallocAsync_ptsz(void **ptr, size_t size, cudaStream_t s) { (void)s; return device_alloc("cudaMallocAsync", ptr, size); }
API cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t s) {
    (void)pool; (void)s;
    return device_alloc("cudaMallocFromPoolAsync", ptr, size);
}
API cudaError_t cudaFreeAsync(void *ptr, cudaStream_t s) { (void)s; return device_free("cudaFreeAsync", ptr); }
API cudaError_t cudaFreeAsync_ptsz(void *ptr, cudaStream_t s) { (void)s; return device_free("cudaFreeAsync", ptr); }
API cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned flags) { (void)flags; return device_alloc("cudaMallocManaged", ptr, size); }
API cudaError_t cudaMallocHost(void **ptr, size_t size) { return host_alloc("cudaMallocHost", ptr, size); }
API cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned flags) { (void)flags; return host_alloc("cudaHostAlloc", ptr, size); }
API cudaError_t cudaFreeHost(void *ptr) {
    sim_delay("cudaFreeHost");
    return status_of(sim_free(SIM_HOST, (uint64_t)(uintptr_t)ptr));
}

API cudaError_t cudaMallocPitch(void **ptr, size_t *pitch, size_t width, size_t height) {
    sim_delay("cudaMallocPitch");
    if (!ptr || !pitch) return cudaErrorInvalidValue;
    size_t p = (width + 511) & ~(size_t)511;
    uint64_t out = 0;
    int s = sim_alloc(SIM_DEVICE, p * height, &out);
    if (s == SIM_OK) { *ptr = (void *)(uintptr_t)out; *pitch = p; }
    return status_of(s);
}

API cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    sim_delay("cudaMemGetInfo");
    if (!free_bytes || !total_bytes) return cudaErrorInvalidValue;
    sim_mem_info(free_bytes, total_bytes);
    return cudaSuccess;
}

API cudaError_t cudaSetDevice(int device) { sim_delay("cudaSetDevice"); return status_of(sim_set_device(device)); }
API cudaError_t cudaGetDevice(int *device) { if (!device) return cudaErrorInvalidValue; *device = sim_get_device(); return cudaSuccess; }
API cudaError_t cudaGetDeviceCount(int *count) { if (!count) return cudaErrorInvalidValue; *count = sim_device_count(); return cudaSuccess; }
API cudaError_t cudaDeviceSynchronize(void) { sim_delay("cudaDeviceSynchronize"); return cudaSuccess; }
API cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; sim_delay("cudaStreamSynchronize"); return cudaSuccess; }
API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) { (void)s; sim_delay("cudaStreamSynchronize"); return cudaSuccess; }
