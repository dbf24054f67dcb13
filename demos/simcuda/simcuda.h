/* Internal interface between the simulated runtime (libcudart.so.12) and the simulated driver
 * (libcuda.so.1), which owns the device-memory model. Not part of the CUDA API. */
#ifndef SIMCUDA_H
#define SIMCUDA_H
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(default)
enum sim_space { SIM_DEVICE = 0, SIM_HOST = 1 };
enum sim_status { SIM_OK = 0, SIM_INVALID = 1, SIM_OOM = 2, SIM_BAD_DEVICE = 101 };

int sim_device_count(void);
int sim_set_device(int device);
int sim_get_device(void);
/* Allocates `size` bytes on the calling thread's device (or pinned host memory). */
int sim_alloc(enum sim_space space, size_t size, uint64_t *out);
int sim_free(enum sim_space space, uint64_t ptr);
void sim_mem_info(size_t *free_bytes, size_t *total_bytes);
/* Virtual memory management (expandable segments). */
int sim_va_reserve(size_t size, size_t alignment, uint64_t *out);
int sim_va_free(uint64_t ptr, size_t size);
int sim_phys_create(size_t size, uint64_t *handle);
int sim_phys_release(uint64_t handle);
int sim_map(uint64_t ptr, size_t size, uint64_t handle);
int sim_unmap(uint64_t ptr, size_t size);
/* Event log for runs without eBPF (SIMCUDA_EVENTS=path): one line per call,
 * "ts_ns dur_ns pid tid op ret device size ptr aux0 aux1", '-' for unknown values. */
uint64_t sim_realtime_ns(void);
uint64_t sim_mono_ns(void);
#define SIM_NONE UINT64_MAX
void sim_record(const char *op, uint64_t ts_ns, uint64_t mono0, int ret, uint64_t size, uint64_t ptr,
                uint64_t aux0, uint64_t aux1);
/* A message (PyTorch's out-of-memory text) in the event log, after the call fields. */
void sim_record_message(const char *op, uint64_t ts_ns, const char *text);
/* Spends the configured latency of `op` (busy-waiting, as a driver call does). */
void sim_delay(const char *op);

/* The file SIMCUDA_SHARED_DEVICES names, mapped by every process that names it: each device's
 * bytes in use, then each process's own use (what NVML reports per process). */
#define MAX_DEVICES 16
#define MAX_SHARING 64
struct sim_process_slot {
    uint32_t pid; /* 0: free */
    uint32_t padding;
    uint64_t used[MAX_DEVICES];
};
struct sim_shared {
    uint64_t used[MAX_DEVICES];
    struct sim_process_slot slots[MAX_SHARING];
};
/* This process's slot, taken from a free one or one a process of this pid left (NULL: full). */
static inline struct sim_process_slot *sim_claim_slot(struct sim_shared *s, uint32_t pid) {
    for (int i = 0; i < MAX_SHARING; i++) {
        uint32_t expected = 0;
        if (__atomic_load_n(&s->slots[i].pid, __ATOMIC_ACQUIRE) == pid ||
            __atomic_compare_exchange_n(&s->slots[i].pid, &expected, pid, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            for (int d = 0; d < MAX_DEVICES; d++) __atomic_store_n(&s->slots[i].used[d], 0, __ATOMIC_RELEASE);
            return &s->slots[i];
        }
    }
    return NULL;
}
#pragma GCC visibility pop
#endif
