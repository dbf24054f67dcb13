/* The simulated NVML (libnvidia-ml.so.1): the calls PyTorch's out-of-memory message makes to
 * name the processes on the device ("Process 516 has 129.79 GiB memory in use"), answered from
 * the file SIMCUDA_SHARED_DEVICES names (model.c keeps each process's use there).
 *
 * Without that file, or with SIMCUDA_NVML=0 (a container without the NVIDIA management
 * library), nvmlInit fails as NVML does where it is missing, and PyTorch's message lists no
 * process. Only what PyTorch calls is here; the structures are NVML's (nvml.h, version 12).
 */
#define _GNU_SOURCE
#include "simcuda.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_LIBRARY_NOT_FOUND 12

typedef struct nvml_device *nvmlDevice_t;

/* nvmlProcessInfo_t (v2 and later). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

static struct sim_shared *shared;

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    const char *on = getenv("SIMCUDA_NVML");
    const char *path = getenv("SIMCUDA_SHARED_DEVICES");
    if ((on && !strcmp(on, "0")) || !path || !*path) return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (shared) return NVML_SUCCESS;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NVML_ERROR_LIBRARY_NOT_FOUND;
    void *m = mmap(NULL, sizeof(struct sim_shared), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NVML_ERROR_LIBRARY_NOT_FOUND;
    shared = m;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

/* SIMCUDA_DEVICES, as the runtime reads it (default 1). */
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!shared) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    const char *n = getenv("SIMCUDA_DEVICES");
    int devices = n ? atoi(n) : 1;
    *count = devices < 1 ? 1 : devices > MAX_DEVICES ? MAX_DEVICES : (unsigned)devices;
    return NVML_SUCCESS;
}

/* A simulated device's minor number is its index (/dev/nvidiaN). */
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    uintptr_t index = (uintptr_t)device;
    if (!minor || index == 0 || index > MAX_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned)(index - 1);
    return NVML_SUCCESS;
}

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

/* SIMCUDA_MEM's capacity (as model.c parses it: a number with K/M/G/T and optional iB/B). */
static unsigned long long capacity(void) {
    const char *s = getenv("SIMCUDA_MEM");
    if (!s || !*s) return 16ULL << 30;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    switch (*end) {
    case 'K': case 'k': return v << 10;
    case 'M': case 'm': return v << 20;
    case 'G': case 'g': return v << 30;
    case 'T': case 't': return v << 40;
    default: return v;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!shared) return NVML_ERROR_UNINITIALIZED;
    uintptr_t index = (uintptr_t)device;
    if (!memory || index == 0 || index > MAX_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = capacity(), used = __atomic_load_n(&shared->used[index - 1], __ATOMIC_ACQUIRE);
    *memory = (nvmlMemory_t){.total = total, .used = used, .free = used < total ? total - used : 0};
    return NVML_SUCCESS;
}

/* A device handle is its index + 1 (never NULL). */
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!shared) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= MAX_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

/* Every process with memory on the device, with its bytes; *count in: room, out: processes. */
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    if (!shared) return NVML_ERROR_UNINITIALIZED;
    uintptr_t index = (uintptr_t)device;
    if (!count || index == 0 || index > MAX_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int found = 0, room = infos ? *count : 0;
    for (int i = 0; i < MAX_SHARING; i++) {
        uint32_t pid = __atomic_load_n(&shared->slots[i].pid, __ATOMIC_ACQUIRE);
        uint64_t used = __atomic_load_n(&shared->slots[i].used[index - 1], __ATOMIC_ACQUIRE);
        if (!pid || !used) continue;
        if (found < room)
            infos[found] = (nvmlProcessInfo_t){.pid = pid, .usedGpuMemory = used,
                                               .gpuInstanceId = 0xFFFFFFFF, .computeInstanceId = 0xFFFFFFFF};
        found++;
    }
    *count = found;
    return found > room ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}
