/* PyTorch's own probes, for the simulated allocator (demos/workloads/caching_allocator.py):
 * the same USDT sites as libc10_cuda.so (provider `pytorch`, `malloc(ptr, device, size,
 * stream)` at the end of an allocation, `free(ptr)`), each gated by its semaphore as PyTorch's
 * are, and a function with the exported name, arguments and layout of c10::Error's base
 * constructor (libc10.so). As in the real wheels (2.11), OutOfMemoryError has no constructor of
 * its own: it is built inline from c10::Error's, which every other c10 error goes through
 * too. Built with sys/sdt.h (systemtap-sdt-dev). */
#define _SDT_HAS_SEMAPHORES 1
#include <stdint.h>
#include <string.h>
#include <sys/sdt.h>

#include "simcuda.h"

#define API __attribute__((visibility("default")))

__extension__ unsigned short pytorch_malloc_semaphore __attribute__((unused)) __attribute__((section(".probes")));
__extension__ unsigned short pytorch_free_semaphore __attribute__((unused)) __attribute__((section(".probes")));

/* As PyTorch: the device is a signed byte (c10::DeviceIndex), the rest 8-byte values. */
/* Also logged with the runtime's calls (SIMCUDA_EVENTS), for runs without eBPF. */
API void simtorch_malloc(uint64_t ptr, int8_t device, uint64_t size, uint64_t stream) {
    if (pytorch_malloc_semaphore) STAP_PROBE4(pytorch, malloc, ptr, device, size, stream);
    uint64_t now = sim_mono_ns();
    sim_record("pytorch:malloc", sim_realtime_ns(), now, 0, size, ptr, stream, SIM_NONE);
}

API void simtorch_free(uint64_t ptr) {
    if (pytorch_free_semaphore) STAP_PROBE1(pytorch, free, ptr);
    uint64_t now = sim_mono_ns();
    sim_record("pytorch:free", sim_realtime_ns(), now, 0, SIM_NONE, ptr, SIM_NONE, SIM_NONE);
}

/* Whether the probes would run (what PyTorch's `if (semaphore)` reads): for tests. */
API int simtorch_semaphores(void) { return pytorch_malloc_semaphore + pytorch_free_semaphore; }

/* c10::SourceLocation (24 bytes: passed on the stack) and libstdc++'s std::string. */
struct source_location { const char *function, *file; uint32_t line; };
struct cxx_string { const char *data; uint64_t size; union { char local[16]; uint64_t capacity; }; };

static volatile uint64_t last_message_size;

/* c10::Error::Error(c10::SourceLocation, std::string), the base object constructor */
API __attribute__((noinline)) void error_ctor(void *self, struct source_location loc, const struct cxx_string *msg)
    __asm__("_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
void error_ctor(void *self, struct source_location loc, const struct cxx_string *msg) {
    (void)self; (void)loc;
    last_message_size = msg->size;
}

static void raise_error(const char *function, const char *text) {
    char self[64];
    struct source_location loc = {function, "CUDACachingAllocator.cpp", 1};
    struct cxx_string msg = {text, strlen(text), {{0}}};
    error_ctor(self, loc, &msg);
}

/* Raises the simulated allocator's out-of-memory: constructs the error with `text`. */
API void simtorch_oom(const char *text) {
    raise_error("malloc", text);
    sim_record_message("pytorch:oom", sim_realtime_ns(), text);
}

/* Another c10 error (an invalid argument, say): through the same constructor, not an OOM. */
API void simtorch_error(const char *text) { raise_error("check", text); }

/* The allocator's stream events are recorded from its own library, as PyTorch's are from
 * libc10_cuda.so (insert_events, inside the free of a block used on other streams). */
int cudaEventRecord(void *event, void *stream);
API __attribute__((noinline)) int simtorch_record_event(void *event, void *stream) {
    return cudaEventRecord(event, stream);
}

/* PyTorch's CUDAGraph (libtorch_cuda.so), by its exported names: what tracer probes to learn
 * each capture's private pool. The simulated allocator calls them in PyTorch's order (in
 * capture_begin: the pool chosen, requests routed to it, then cudaStreamBeginCapture; in
 * capture_end: cudaStreamEndCapture, routing ended, the graph instantiated; reset: the pool
 * released); the work itself is the allocator's. */
static volatile uint64_t graph_calls;

API __attribute__((noinline)) void graph_capture_begin(void *self, uint64_t pool_first, uint64_t pool_second, int mode)
    __asm__("_ZN2at4cuda9CUDAGraph13capture_beginESt4pairIyyE21cudaStreamCaptureMode");
void graph_capture_begin(void *self, uint64_t pool_first, uint64_t pool_second, int mode) {
    (void)mode;
    graph_calls++;
    sim_record("pytorch:capture_begin", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE,
               (uint64_t)(uintptr_t)self, pool_first, pool_second);
}

API __attribute__((noinline)) void graph_capture_end(void *self) __asm__("_ZN2at4cuda9CUDAGraph11capture_endEv");
void graph_capture_end(void *self) {
    graph_calls++;
    sim_record("pytorch:capture_end", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, (uint64_t)(uintptr_t)self,
               SIM_NONE, SIM_NONE);
}

API __attribute__((noinline)) void graph_reset(void *self) __asm__("_ZN2at4cuda9CUDAGraph5resetEv");
void graph_reset(void *self) {
    graph_calls++;
    sim_record("pytorch:graph_reset", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, (uint64_t)(uintptr_t)self,
               SIM_NONE, SIM_NONE);
}

/* PyTorch's caching allocator's pool methods (c10::cuda::CUDACachingAllocator::Native::
 * NativeCachingAllocator in libc10_cuda.so), by their mangled names: local symbols there, found
 * only through the library's own symbol table, and hidden here too (not exported), so that
 * tracer finds them as it must on the real wheels. PyTorch calls them through the allocator's
 * vtable; the simulated allocator through the exported simtorch_pool_* below. Arguments as
 * PyTorch's: `this`, the device (a signed byte), the pool id's halves, then the method's own. */
static char native_allocator[64];
static volatile uint64_t pool_calls;

__attribute__((noinline, used)) void native_pool_begin(void *self, int8_t device, uint64_t first, uint64_t second,
                                                       void *filter)
    __asm__("_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator19beginAllocateToPoolEaSt4pairIyyESt8functionIFbP11CUstream_stEE");
void native_pool_begin(void *self, int8_t device, uint64_t first, uint64_t second, void *filter) {
    (void)self; (void)device; (void)filter;
    pool_calls++;
    sim_record("pytorch:pool_begin", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, SIM_NONE, first, second);
}

__attribute__((noinline, used)) void native_pool_end(void *self, int8_t device, uint64_t first, uint64_t second)
    __asm__("_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator17endAllocateToPoolEaSt4pairIyyE");
void native_pool_end(void *self, int8_t device, uint64_t first, uint64_t second) {
    (void)self; (void)device;
    pool_calls++;
    sim_record("pytorch:pool_end", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, SIM_NONE, first, second);
}

__attribute__((noinline, used)) void native_pool_release(void *self, int8_t device, uint64_t first, uint64_t second)
    __asm__("_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator11releasePoolEaSt4pairIyyE");
void native_pool_release(void *self, int8_t device, uint64_t first, uint64_t second) {
    (void)self; (void)device;
    pool_calls++;
    sim_record("pytorch:pool_release", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, SIM_NONE, first, second);
}

__attribute__((noinline, used)) void native_pool_create(void *self, int8_t device, uint64_t first, uint64_t second,
                                                        void *allocator)
    __asm__("_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator18createOrIncrefPoolEaSt4pairIyyESt10shared_ptrINS1_13CUDAAllocatorEE");
void native_pool_create(void *self, int8_t device, uint64_t first, uint64_t second, void *allocator) {
    (void)self; (void)device; (void)allocator;
    pool_calls++;
    sim_record("pytorch:pool_create", sim_realtime_ns(), sim_mono_ns(), 0, SIM_NONE, SIM_NONE, first, second);
}

__attribute__((noinline, used)) void native_pool_on_oom(void *self, int8_t device, uint64_t first, uint64_t second,
                                                        _Bool use)
    __asm__("_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator11setUseOnOOMEaSt4pairIyyEb");
void native_pool_on_oom(void *self, int8_t device, uint64_t first, uint64_t second, _Bool use) {
    (void)self; (void)device;
    pool_calls++;
    sim_record("pytorch:pool_use_on_oom", sim_realtime_ns(), sim_mono_ns(), 0, use, SIM_NONE, first, second);
}

/* kind: 0 begin, 1 end, 2 release, 3 create, 4 use_on_oom (flag). */
API void simtorch_pool(int kind, int8_t device, uint64_t first, uint64_t second, int flag) {
    void *self = native_allocator;
    switch (kind) {
    case 0: native_pool_begin(self, device, first, second, 0); break;
    case 1: native_pool_end(self, device, first, second); break;
    case 2: native_pool_release(self, device, first, second); break;
    case 3: native_pool_create(self, device, first, second, 0); break;
    default: native_pool_on_oom(self, device, first, second, flag != 0); break;
    }
}
