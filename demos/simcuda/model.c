/* The device-memory model behind the simulated CUDA libraries.
 *
 * Each device has a capacity and, as a real GPU, a virtual address range much larger than it:
 * device memory is paged, so a request fails with out-of-memory only when the free bytes cannot
 * cover it (rounded to 2 MiB pages), never for want of a physically contiguous range.
 * Allocations are placed first-fit in the device's address range and coalesced on free; the
 * free ranges count toward the allocation latency model (SIMCUDA_LATENCY_PER_FRAGMENT_NS).
 *
 * Configuration (environment, read once):
 *   SIMCUDA_DEVICES      number of devices (default 1)
 *   SIMCUDA_MEM          capacity per device, e.g. 16GiB, 512MiB (default 16GiB)
 *   SIMCUDA_LATENCY      per-op latency, e.g. "cudaMalloc=40us,cudaFree=8us,default=1us"
 *   SIMCUDA_LATENCY_PER_LIVE_NS      extra allocation latency per live allocation on the device
 *   SIMCUDA_LATENCY_PER_FRAGMENT_NS  extra allocation latency per free range (fragment) on the device
 *   SIMCUDA_LATENCY_PER_MIB_NS       extra allocation latency per MiB requested (mapping pages)
 *   SIMCUDA_EVENTS                   log every runtime call to this file (see simcuda.h)
 *   SIMCUDA_SHARED_DEVICES           a file holding each device's bytes in use, shared by every
 *                                    process that names it: processes on one node share its GPUs
 *                                    (a co-tenant's memory is not free to the others), as on a GPU;
 *                                    each process's own use is kept there too, for the simulated
 *                                    NVML (nvml.c) that PyTorch's out-of-memory message reads
 */
#define _GNU_SOURCE
#include "simcuda.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ALIGN 512ULL
#define DEVICE_BASE 0x7f0000000000ULL
#define DEVICE_STRIDE 0x10000000000ULL /* 1 TiB of address space per device */
#define PAGE (2ULL << 20)                /* device memory is backed in 2 MiB pages */
#define VA_BASE 0x600000000000ULL
#define MAX_LATENCIES 64

struct range { uint64_t addr, size; };
struct vec { struct range *items; size_t len, cap; };

struct device {
    uint64_t capacity, used;
    struct vec free_ranges; /* sorted by address */
    struct vec live;        /* sorted by address */
};

struct handle { uint64_t id, size; int device; int live; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int device_count = 1;
static struct device devices[MAX_DEVICES];
/* With SIMCUDA_SHARED_DEVICES: each device's bytes in use by every process sharing the file,
 * then each process's own (simcuda.h `sim_shared`). */
static struct sim_shared *shared_file;
static uint64_t *shared_used;
static struct sim_process_slot *own_slot;
static struct vec host_live;
static struct vec va_free, va_live, mappings;
static struct handle *handles;
static size_t handle_count, handle_cap;
static __thread int current_device = 0;
static uint64_t latency_per_live_ns, latency_per_fragment_ns, latency_per_mib_ns;

static struct { char name[48]; uint64_t ns; } latencies[MAX_LATENCIES];
static int latency_count;
static uint64_t default_latency_ns = 1000;

static uint64_t parse_size(const char *s, uint64_t fallback) {
    if (!s || !*s) return fallback;
    char *end;
    double v = strtod(s, &end);
    if (end == s || v < 0) return fallback;
    while (*end == ' ') end++;
    uint64_t mult = 1;
    if (!strncasecmp(end, "k", 1)) mult = 1ULL << 10;
    else if (!strncasecmp(end, "m", 1)) mult = 1ULL << 20;
    else if (!strncasecmp(end, "g", 1)) mult = 1ULL << 30;
    else if (!strncasecmp(end, "t", 1)) mult = 1ULL << 40;
    return (uint64_t)(v * (double)mult);
}

static uint64_t parse_duration_ns(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || v < 0) return 0;
    if (!strncmp(end, "ns", 2)) return (uint64_t)v;
    if (!strncmp(end, "us", 2)) return (uint64_t)(v * 1e3);
    if (!strncmp(end, "ms", 2)) return (uint64_t)(v * 1e6);
    if (!strncmp(end, "s", 1)) return (uint64_t)(v * 1e9);
    return (uint64_t)v; /* bare number: nanoseconds */
}

static void vec_insert(struct vec *v, size_t at, struct range r) {
    if (v->len == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 64;
        v->items = realloc(v->items, v->cap * sizeof *v->items);
        if (!v->items) { fprintf(stderr, "simcuda: out of host memory\n"); abort(); }
    }
    memmove(&v->items[at + 1], &v->items[at], (v->len - at) * sizeof *v->items);
    v->items[at] = r;
    v->len++;
}

static void vec_remove(struct vec *v, size_t at) {
    memmove(&v->items[at], &v->items[at + 1], (v->len - at - 1) * sizeof *v->items);
    v->len--;
}

/* Index of the first range with addr >= key. */
static size_t lower_bound(const struct vec *v, uint64_t key) {
    size_t lo = 0, hi = v->len;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v->items[mid].addr < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int find_exact(const struct vec *v, uint64_t addr, size_t *at) {
    size_t i = lower_bound(v, addr);
    if (i < v->len && v->items[i].addr == addr) { *at = i; return 1; }
    return 0;
}

/* First fit with alignment; returns 0 when no free range is large enough. */
static uint64_t take_range(struct vec *free_ranges, uint64_t size, uint64_t align) {
    for (size_t i = 0; i < free_ranges->len; i++) {
        struct range r = free_ranges->items[i];
        uint64_t start = (r.addr + align - 1) & ~(align - 1);
        if (start < r.addr || start - r.addr + size > r.size) continue;
        uint64_t head = start - r.addr, tail = r.size - head - size;
        vec_remove(free_ranges, i);
        if (tail) vec_insert(free_ranges, i, (struct range){start + size, tail});
        if (head) vec_insert(free_ranges, i, (struct range){r.addr, head});
        return start;
    }
    return 0;
}

static void give_range(struct vec *free_ranges, uint64_t addr, uint64_t size) {
    size_t i = lower_bound(free_ranges, addr);
    vec_insert(free_ranges, i, (struct range){addr, size});
    if (i + 1 < free_ranges->len && addr + size == free_ranges->items[i + 1].addr) {
        free_ranges->items[i].size += free_ranges->items[i + 1].size;
        vec_remove(free_ranges, i + 1);
    }
    if (i > 0 && free_ranges->items[i - 1].addr + free_ranges->items[i - 1].size == addr) {
        free_ranges->items[i - 1].size += free_ranges->items[i].size;
        vec_remove(free_ranges, i);
    }
}

static void init(void) {
    const char *n = getenv("SIMCUDA_DEVICES");
    if (n) device_count = atoi(n);
    if (device_count < 1) device_count = 1;
    if (device_count > MAX_DEVICES) device_count = MAX_DEVICES;
    uint64_t capacity = parse_size(getenv("SIMCUDA_MEM"), 16ULL << 30);
    for (int d = 0; d < device_count; d++) {
        devices[d].capacity = capacity;
        give_range(&devices[d].free_ranges, DEVICE_BASE + (uint64_t)d * DEVICE_STRIDE, DEVICE_STRIDE);
    }
    give_range(&va_free, VA_BASE, 1ULL << 44);
    const char *shared = getenv("SIMCUDA_SHARED_DEVICES");
    if (shared && *shared) {
        int fd = open(shared, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0 && ftruncate(fd, sizeof(struct sim_shared)) == 0) {
            void *m = mmap(NULL, sizeof(struct sim_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                shared_file = m;
                shared_used = shared_file->used;
                own_slot = sim_claim_slot(shared_file, (uint32_t)getpid());
            }
        }
        if (fd >= 0) close(fd);
    }
    const char *per_live = getenv("SIMCUDA_LATENCY_PER_LIVE_NS");
    if (per_live) latency_per_live_ns = strtoull(per_live, NULL, 10);
    const char *per_fragment = getenv("SIMCUDA_LATENCY_PER_FRAGMENT_NS");
    if (per_fragment) latency_per_fragment_ns = strtoull(per_fragment, NULL, 10);
    const char *per_mib = getenv("SIMCUDA_LATENCY_PER_MIB_NS");
    if (per_mib) latency_per_mib_ns = strtoull(per_mib, NULL, 10);
    const char *spec = getenv("SIMCUDA_LATENCY");
    if (spec) {
        char *copy = strdup(spec), *save = NULL;
        for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(item, '=');
            if (!eq) continue;
            *eq = 0;
            uint64_t ns = parse_duration_ns(eq + 1);
            if (!strcmp(item, "default")) default_latency_ns = ns;
            else if (latency_count < MAX_LATENCIES) {
                snprintf(latencies[latency_count].name, sizeof latencies[0].name, "%s", item);
                latencies[latency_count++].ns = ns;
            }
        }
        free(copy);
    }
}

static void ensure_init(void) { pthread_once(&once, init); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void spin(uint64_t ns) {
    if (!ns) return;
    uint64_t until = now_ns() + ns;
    while (now_ns() < until) __asm__ volatile("pause");
}

/* Takes `bytes` of device `d` if it has them (every process's use counted when shared). */
static int take_device_bytes(int d, uint64_t bytes) {
    struct device *dev = &devices[d];
    if (shared_used) {
        uint64_t cur = __atomic_load_n(&shared_used[d], __ATOMIC_ACQUIRE);
        do {
            if (cur + bytes > dev->capacity) return 0;
        } while (!__atomic_compare_exchange_n(&shared_used[d], &cur, cur + bytes, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    } else if (dev->used + bytes > dev->capacity) {
        return 0;
    }
    dev->used += bytes;
    if (own_slot) __atomic_fetch_add(&own_slot->used[d], bytes, __ATOMIC_ACQ_REL);
    return 1;
}

static void give_device_bytes(int d, uint64_t bytes) {
    devices[d].used -= bytes;
    if (shared_used) __atomic_fetch_sub(&shared_used[d], bytes, __ATOMIC_ACQ_REL);
    if (own_slot) __atomic_fetch_sub(&own_slot->used[d], bytes, __ATOMIC_ACQ_REL);
}

/* A process's device memory goes back when it exits, as on a GPU (a process killed outright
 * keeps its share in the file: start the scenario with a new one). */
__attribute__((destructor)) static void give_back_at_exit(void) {
    if (!shared_used) return;
    for (int d = 0; d < device_count; d++)
        if (devices[d].used) __atomic_fetch_sub(&shared_used[d], devices[d].used, __ATOMIC_ACQ_REL);
    if (own_slot) {
        for (int d = 0; d < MAX_DEVICES; d++) __atomic_store_n(&own_slot->used[d], 0, __ATOMIC_RELEASE);
        __atomic_store_n(&own_slot->pid, 0, __ATOMIC_RELEASE);
    }
}

/* Bytes of device `d` in use: this process's, or every sharing process's. */
static uint64_t device_used(int d) {
    return shared_used ? __atomic_load_n(&shared_used[d], __ATOMIC_ACQUIRE) : devices[d].used;
}

void sim_delay(const char *op) {
    ensure_init();
    uint64_t ns = default_latency_ns;
    for (int i = 0; i < latency_count; i++)
        if (!strcmp(latencies[i].name, op)) { ns = latencies[i].ns; break; }
    spin(ns);
}

int sim_device_count(void) { ensure_init(); return device_count; }

int sim_set_device(int device) {
    ensure_init();
    if (device < 0 || device >= device_count) return SIM_BAD_DEVICE;
    current_device = device;
    return SIM_OK;
}

int sim_get_device(void) { return current_device; }

static uint64_t round_up(uint64_t size) { return (size + ALIGN - 1) & ~(ALIGN - 1); }
static uint64_t pages(uint64_t size) { return (size + PAGE - 1) & ~(PAGE - 1); }

int sim_alloc(enum sim_space space, size_t size, uint64_t *out) {
    ensure_init();
    if (!out) return SIM_INVALID;
    if (size == 0) { *out = 0; return SIM_OK; }
    uint64_t rounded = round_up(size), extra_ns = 0;
    int status = SIM_OK;
    pthread_mutex_lock(&lock);
    if (space == SIM_HOST) {
        void *p = aligned_alloc(ALIGN, rounded);
        if (!p) status = SIM_OOM;
        else {
            size_t at = lower_bound(&host_live, (uint64_t)(uintptr_t)p);
            vec_insert(&host_live, at, (struct range){(uint64_t)(uintptr_t)p, rounded});
            *out = (uint64_t)(uintptr_t)p;
        }
    } else {
        struct device *dev = &devices[current_device];
        /* The search gets slower as memory fragments: latency comes out of the model's state. */
        extra_ns = latency_per_live_ns * dev->live.len + latency_per_fragment_ns * dev->free_ranges.len +
                   latency_per_mib_ns * (rounded >> 20);
        uint64_t align = rounded >= PAGE ? PAGE : ALIGN;
        uint64_t addr = 0;
        if (take_device_bytes(current_device, pages(rounded))) {
            addr = take_range(&dev->free_ranges, rounded, align);
            if (!addr) give_device_bytes(current_device, pages(rounded));
        }
        if (!addr) status = SIM_OOM;
        else {
            size_t at = lower_bound(&dev->live, addr);
            vec_insert(&dev->live, at, (struct range){addr, rounded});
            *out = addr;
        }
    }
    pthread_mutex_unlock(&lock);
    spin(extra_ns);
    return status;
}

int sim_free(enum sim_space space, uint64_t ptr) {
    ensure_init();
    if (ptr == 0) return SIM_OK;
    int status = SIM_INVALID;
    pthread_mutex_lock(&lock);
    size_t at;
    if (space == SIM_HOST) {
        if (find_exact(&host_live, ptr, &at)) {
            vec_remove(&host_live, at);
            free((void *)(uintptr_t)ptr);
            status = SIM_OK;
        }
    } else {
        for (int d = 0; d < device_count; d++) {
            struct device *dev = &devices[d];
            if (find_exact(&dev->live, ptr, &at)) {
                struct range r = dev->live.items[at];
                vec_remove(&dev->live, at);
                give_range(&dev->free_ranges, r.addr, r.size);
                give_device_bytes(d, pages(r.size));
                status = SIM_OK;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

void sim_mem_info(size_t *free_bytes, size_t *total_bytes) {
    ensure_init();
    pthread_mutex_lock(&lock);
    struct device *dev = &devices[current_device];
    if (free_bytes) *free_bytes = dev->capacity - device_used(current_device);
    if (total_bytes) *total_bytes = dev->capacity;
    pthread_mutex_unlock(&lock);
}

int sim_va_reserve(size_t size, size_t alignment, uint64_t *out) {
    ensure_init();
    if (!out || size == 0) return SIM_INVALID;
    uint64_t align = alignment ? alignment : (2ULL << 20);
    pthread_mutex_lock(&lock);
    uint64_t addr = take_range(&va_free, round_up(size), align);
    if (addr) vec_insert(&va_live, lower_bound(&va_live, addr), (struct range){addr, round_up(size)});
    pthread_mutex_unlock(&lock);
    if (!addr) return SIM_OOM;
    *out = addr;
    return SIM_OK;
}

int sim_va_free(uint64_t ptr, size_t size) {
    ensure_init();
    int status = SIM_INVALID;
    size_t at;
    pthread_mutex_lock(&lock);
    if (find_exact(&va_live, ptr, &at) && va_live.items[at].size == round_up(size)) {
        vec_remove(&va_live, at);
        give_range(&va_free, ptr, round_up(size));
        status = SIM_OK;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int sim_phys_create(size_t size, uint64_t *handle) {
    ensure_init();
    if (!handle || size == 0) return SIM_INVALID;
    int status = SIM_OK;
    pthread_mutex_lock(&lock);
    if (!take_device_bytes(current_device, size)) status = SIM_OOM;
    else {
        if (handle_count == handle_cap) {
            handle_cap = handle_cap ? handle_cap * 2 : 64;
            handles = realloc(handles, handle_cap * sizeof *handles);
            if (!handles) abort();
        }
        handles[handle_count] = (struct handle){handle_count + 1, size, current_device, 1};
        *handle = handle_count + 1;
        handle_count++;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int sim_phys_release(uint64_t handle) {
    ensure_init();
    int status = SIM_INVALID;
    pthread_mutex_lock(&lock);
    if (handle >= 1 && handle <= handle_count && handles[handle - 1].live) {
        handles[handle - 1].live = 0;
        give_device_bytes(handles[handle - 1].device, handles[handle - 1].size);
        status = SIM_OK;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int sim_map(uint64_t ptr, size_t size, uint64_t handle) {
    ensure_init();
    int status = SIM_INVALID;
    pthread_mutex_lock(&lock);
    size_t i = lower_bound(&va_live, ptr + 1);
    int in_range = i > 0 && ptr + size <= va_live.items[i - 1].addr + va_live.items[i - 1].size;
    size_t at;
    if (in_range && handle >= 1 && handle <= handle_count && handles[handle - 1].live &&
        !find_exact(&mappings, ptr, &at)) {
        vec_insert(&mappings, lower_bound(&mappings, ptr), (struct range){ptr, size});
        status = SIM_OK;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int sim_unmap(uint64_t ptr, size_t size) {
    ensure_init();
    int status = SIM_INVALID;
    size_t at;
    pthread_mutex_lock(&lock);
    if (find_exact(&mappings, ptr, &at) && mappings.items[at].size == size) {
        vec_remove(&mappings, at);
        status = SIM_OK;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

uint64_t sim_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

uint64_t sim_mono_ns(void) { return now_ns(); }

static int events_fd = -2;
static pthread_once_t events_once = PTHREAD_ONCE_INIT;

static void open_events(void) {
    const char *path = getenv("SIMCUDA_EVENTS");
    events_fd = path && *path ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600) : -1;
}

static void put(char **at, uint64_t v) {
    if (v == SIM_NONE) *at += sprintf(*at, " -");
    else *at += sprintf(*at, " %llu", (unsigned long long)v);
}

void sim_record(const char *op, uint64_t ts_ns, uint64_t mono0, int ret, uint64_t size, uint64_t ptr,
                uint64_t aux0, uint64_t aux1) {
    pthread_once(&events_once, open_events);
    if (events_fd < 0) return;
    char line[256], *at = line;
    at += sprintf(at, "%llu %llu %d %ld %s %d %d", (unsigned long long)ts_ns,
                  (unsigned long long)(now_ns() - mono0), getpid(), (long)syscall(SYS_gettid), op, ret,
                  current_device);
    put(&at, size);
    put(&at, ptr);
    put(&at, aux0);
    put(&at, aux1);
    *at++ = '\n';
    /* One write per line: appends from several threads and processes do not interleave. */
    ssize_t n = write(events_fd, line, (size_t)(at - line));
    (void)n;
}

void sim_record_message(const char *op, uint64_t ts_ns, const char *text) {
    pthread_once(&events_once, open_events);
    if (events_fd < 0) return;
    /* The call fields as sim_record writes them (no duration, size or pointer), then the text on
     * the same line: line breaks become spaces, and a text longer than the line is cut. */
    char line[2048];
    int at = snprintf(line, sizeof line, "%llu 0 %d %ld %s 0 %d - - - - ", (unsigned long long)ts_ns,
                      getpid(), (long)syscall(SYS_gettid), op, current_device);
    for (const char *c = text; *c && at < (int)sizeof line - 1; c++) line[at++] = *c == '\n' ? ' ' : *c;
    line[at++] = '\n';
    ssize_t n = write(events_fd, line, (size_t)at);
    (void)n;
}
