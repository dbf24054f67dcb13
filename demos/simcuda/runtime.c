/* Simulated CUDA runtime API (libcudart.so.12). Like the real runtime it keeps a current device
 * per thread and reports cudaError_t codes; memory comes from the model in libcuda.so.1. With
 * SIMCUDA_EVENTS set, every call is also logged (for demos on machines without eBPF rights). */
#define _GNU_SOURCE
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
static void wait_device(void);
static void wait_stream(cudaStream_t s);
API cudaError_t cudaDeviceSynchronize(void) {
    BEGIN("cudaDeviceSynchronize");
    wait_device();
    return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE);
}
/* Not through the exported symbol: that call would be probed as a second cudaStreamSynchronize. */
static cudaError_t stream_sync(cudaStream_t s) {
    BEGIN("cudaStreamSynchronize");
    wait_stream(s);
    return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)s, SIM_NONE);
}
API cudaError_t cudaStreamSynchronize(cudaStream_t s) { return stream_sync(s); }
API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) { return stream_sync(s); }

/* Streams and events. A stream's work ends at `busy_until` (monotonic ns); cudaMemsetAsync
 * queues work that takes count / SIMCUDA_MEMSET_BPS seconds (default 2e12 bytes/s, an H100's
 * order of memory bandwidth). An event recorded on a stream completes when the work queued
 * before it does, as on a GPU: cudaEventQuery says cudaErrorNotReady until then,
 * cudaEventSynchronize waits for it. */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef void *cudaEvent_t;
#define cudaErrorNotReady 600

/* A stream under capture carries its capture's id (0: none); an event recorded on it carries
 * it too, and a stream that waits on such an event joins that capture (as CUDA does). */
struct sim_stream { uint64_t busy_until; uint64_t capture; };
struct sim_event { uint64_t complete_at; int recorded; uint64_t capture; };

static struct sim_stream default_stream;
/* The latest end of any stream's work, for cudaDeviceSynchronize. */
static uint64_t device_busy_until;

/* Streams this runtime made; any other handle (the legacy or per-thread default stream, or a
 * value a test passes) is the default stream. */
enum { MAX_STREAMS = 64 };
static struct sim_stream *streams[MAX_STREAMS];
static struct sim_stream *stream_of(cudaStream_t s) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (s && __atomic_load_n(&streams[i], __ATOMIC_ACQUIRE) == s) return s;
    return &default_stream;
}

static void wait_until(uint64_t t) {
    while (sim_mono_ns() < t) {
    }
}

static double memset_bytes_per_ns(void) {
    static double rate;
    if (rate == 0) {
        const char *v = getenv("SIMCUDA_MEMSET_BPS");
        double bps = v ? strtod(v, NULL) : 0;
        rate = (bps > 0 ? bps : 2e12) / 1e9;
    }
    return rate;
}

/* 1 when the caller's return address lies in the simulated PyTorch allocator's library (what
 * tracer tells from the address itself when it traces with eBPF). */
static uint64_t from_allocator(void *ret_addr) {
    Dl_info info;
    if (!dladdr(ret_addr, &info) || !info.dli_fname) return 0;
    return strstr(info.dli_fname, "libsimtorch") ? 1 : 0;
}

API cudaError_t cudaStreamCreate(cudaStream_t *s) {
    if (!s) return cudaErrorInvalidValue;
    struct sim_stream *st = calloc(1, sizeof *st);
    if (!st) return cudaErrorMemoryAllocation;
    for (int i = 0; i < MAX_STREAMS; i++) {
        struct sim_stream *none = NULL;
        if (__atomic_compare_exchange_n(&streams[i], &none, st, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *s = st;
            return cudaSuccess;
        }
    }
    free(st);
    return cudaErrorMemoryAllocation;
}

API cudaError_t cudaStreamDestroy(cudaStream_t s) {
    for (int i = 0; i < MAX_STREAMS; i++) {
        struct sim_stream *mine = s;
        if (s && __atomic_compare_exchange_n(&streams[i], &mine, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            free(s);
            return cudaSuccess;
        }
    }
    return cudaErrorInvalidValue;
}

API cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t s) {
    (void)ptr; (void)value;
    struct sim_stream *st = stream_of(s);
    uint64_t now = sim_mono_ns();
    uint64_t start = __atomic_load_n(&st->busy_until, __ATOMIC_ACQUIRE);
    uint64_t end = (start > now ? start : now) + (uint64_t)((double)count / memset_bytes_per_ns());
    __atomic_store_n(&st->busy_until, end, __ATOMIC_RELEASE);
    uint64_t dev = __atomic_load_n(&device_busy_until, __ATOMIC_ACQUIRE);
    while (end > dev && !__atomic_compare_exchange_n(&device_busy_until, &dev, end, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
    return cudaSuccess;
}

API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags) {
    (void)flags;
    if (!ev) return cudaErrorInvalidValue;
    struct sim_event *e = calloc(1, sizeof *e);
    if (!e) return cudaErrorMemoryAllocation;
    *ev = e;
    return cudaSuccess;
}

API cudaError_t cudaEventCreate(cudaEvent_t *ev) { return cudaEventCreateWithFlags(ev, 0); }

API cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    free(ev);
    return cudaSuccess;
}

static cudaError_t event_record(cudaEvent_t ev, cudaStream_t s, void *caller) {
    BEGIN("cudaEventRecord");
    uint64_t who = from_allocator(caller);
    if (!ev) return RECORD(cudaErrorInvalidValue, SIM_NONE, 0, (uint64_t)(uintptr_t)s, who);
    struct sim_event *e = ev;
    e->complete_at = __atomic_load_n(&stream_of(s)->busy_until, __ATOMIC_ACQUIRE);
    e->recorded = 1;
    e->capture = __atomic_load_n(&stream_of(s)->capture, __ATOMIC_ACQUIRE);
    return RECORD(cudaSuccess, SIM_NONE, (uint64_t)(uintptr_t)ev, (uint64_t)(uintptr_t)s, who);
}

API cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) {
    return event_record(ev, s, __builtin_return_address(0));
}
API cudaError_t cudaEventRecord_ptsz(cudaEvent_t ev, cudaStream_t s) {
    return event_record(ev, s, __builtin_return_address(0));
}

API cudaError_t cudaEventQuery(cudaEvent_t ev) {
    BEGIN("cudaEventQuery");
    if (!ev) return RECORD(cudaErrorInvalidValue, SIM_NONE, 0, SIM_NONE, SIM_NONE);
    struct sim_event *e = ev;
    cudaError_t r = !e->recorded || sim_mono_ns() >= e->complete_at ? cudaSuccess : cudaErrorNotReady;
    return RECORD(r, SIM_NONE, (uint64_t)(uintptr_t)ev, SIM_NONE, SIM_NONE);
}

API cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    BEGIN("cudaEventSynchronize");
    if (!ev) return RECORD(cudaErrorInvalidValue, SIM_NONE, 0, SIM_NONE, SIM_NONE);
    struct sim_event *e = ev;
    if (e->recorded) wait_until(e->complete_at);
    return RECORD(cudaSuccess, SIM_NONE, (uint64_t)(uintptr_t)ev, SIM_NONE, SIM_NONE);
}

static void wait_device(void) { wait_until(__atomic_load_n(&device_busy_until, __ATOMIC_ACQUIRE)); }
static void wait_stream(cudaStream_t s) { wait_until(__atomic_load_n(&stream_of(s)->busy_until, __ATOMIC_ACQUIRE)); }

/* CUDA graphs. A capture runs on a stream this runtime made (capturing the legacy default
 * stream is an error, as on a GPU); cudaStreamEndCapture ends it on every stream joined to it
 * and hands out the graph. Instantiating, launching and destroying graphs move no memory. */
typedef void *cudaGraph_t;
typedef void *cudaGraphExec_t;
#define cudaErrorStreamCaptureUnsupported 900
#define cudaErrorIllegalState 401
static uint64_t next_capture = 1;
struct sim_graph { uint64_t capture; };

static cudaError_t begin_capture(cudaStream_t s, int mode) {
    BEGIN("cudaStreamBeginCapture");
    struct sim_stream *st = stream_of(s);
    uint64_t none = 0;
    uint64_t id = __atomic_fetch_add(&next_capture, 1, __ATOMIC_ACQ_REL);
    cudaError_t r = st == &default_stream ? cudaErrorStreamCaptureUnsupported
                    : __atomic_compare_exchange_n(&st->capture, &none, id, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
                        ? cudaSuccess : cudaErrorIllegalState;
    return RECORD(r, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)s, (uint64_t)mode);
}
API cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) { return begin_capture(s, mode); }
API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t s, int mode) { return begin_capture(s, mode); }

static cudaError_t end_capture(cudaStream_t s, cudaGraph_t *graph) {
    BEGIN("cudaStreamEndCapture");
    struct sim_stream *st = stream_of(s);
    uint64_t id = __atomic_load_n(&st->capture, __ATOMIC_ACQUIRE);
    if (!graph || id == 0 || st == &default_stream)
        return RECORD(id == 0 ? cudaErrorIllegalState : cudaErrorInvalidValue, SIM_NONE, SIM_NONE,
                      (uint64_t)(uintptr_t)s, SIM_NONE);
    for (int i = 0; i < MAX_STREAMS; i++) {
        struct sim_stream *other = __atomic_load_n(&streams[i], __ATOMIC_ACQUIRE);
        uint64_t mine = id;
        if (other) __atomic_compare_exchange_n(&other->capture, &mine, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    struct sim_graph *g = calloc(1, sizeof *g);
    if (!g) return RECORD(cudaErrorMemoryAllocation, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)s, SIM_NONE);
    g->capture = id;
    *graph = g;
    return RECORD(cudaSuccess, SIM_NONE, (uint64_t)(uintptr_t)g, (uint64_t)(uintptr_t)s, SIM_NONE);
}
API cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) { return end_capture(s, graph); }
API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t s, cudaGraph_t *graph) { return end_capture(s, graph); }

static cudaError_t stream_wait_event(cudaStream_t s, cudaEvent_t ev) {
    BEGIN("cudaStreamWaitEvent");
    if (!ev) return RECORD(cudaErrorInvalidValue, SIM_NONE, 0, (uint64_t)(uintptr_t)s, SIM_NONE);
    struct sim_event *e = ev;
    struct sim_stream *st = stream_of(s);
    if (e->capture && st != &default_stream) __atomic_store_n(&st->capture, e->capture, __ATOMIC_RELEASE);
    return RECORD(cudaSuccess, SIM_NONE, (uint64_t)(uintptr_t)ev, (uint64_t)(uintptr_t)s, SIM_NONE);
}
API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned flags) {
    (void)flags;
    return stream_wait_event(s, ev);
}
API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t s, cudaEvent_t ev, unsigned flags) {
    (void)flags;
    return stream_wait_event(s, ev);
}

static __thread int capture_mode;
API cudaError_t cudaThreadExchangeStreamCaptureMode(int *mode) {
    BEGIN("cudaThreadExchangeStreamCaptureMode");
    if (!mode) return RECORD(cudaErrorInvalidValue, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE);
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return RECORD(cudaSuccess, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE);
}

static cudaError_t instantiate(const char *op, cudaGraphExec_t *exec, cudaGraph_t graph) {
    BEGIN(op);
    if (!exec || !graph) return RECORD(cudaErrorInvalidValue, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)graph, SIM_NONE);
    struct sim_graph *e = calloc(1, sizeof *e);
    if (!e) return RECORD(cudaErrorMemoryAllocation, SIM_NONE, SIM_NONE, (uint64_t)(uintptr_t)graph, SIM_NONE);
    e->capture = ((struct sim_graph *)graph)->capture;
    *exec = e;
    return RECORD(cudaSuccess, SIM_NONE, (uint64_t)(uintptr_t)e, (uint64_t)(uintptr_t)graph, SIM_NONE);
}
API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    (void)flags;
    return instantiate("cudaGraphInstantiate", exec, graph);
}
API cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    (void)flags;
    return instantiate("cudaGraphInstantiateWithFlags", exec, graph);
}

static cudaError_t graph_launch(cudaGraphExec_t exec, cudaStream_t s) {
    BEGIN("cudaGraphLaunch");
    cudaError_t r = exec ? cudaSuccess : cudaErrorInvalidValue;
    return RECORD(r, SIM_NONE, (uint64_t)(uintptr_t)exec, (uint64_t)(uintptr_t)s, SIM_NONE);
}
API cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) { return graph_launch(exec, s); }
API cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t exec, cudaStream_t s) { return graph_launch(exec, s); }

static cudaError_t graph_destroy(const char *op, void *graph) {
    BEGIN(op);
    if (!graph) return RECORD(cudaErrorInvalidValue, SIM_NONE, SIM_NONE, SIM_NONE, SIM_NONE);
    uint64_t handle = (uint64_t)(uintptr_t)graph;
    free(graph);
    return RECORD(cudaSuccess, SIM_NONE, handle, SIM_NONE, SIM_NONE);
}
API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) { return graph_destroy("cudaGraphExecDestroy", exec); }
API cudaError_t cudaGraphDestroy(cudaGraph_t graph) { return graph_destroy("cudaGraphDestroy", graph); }
