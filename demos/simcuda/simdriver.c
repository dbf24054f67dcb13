/* A CUDA workload for tests and benchmarks: loads a CUDA runtime (and optionally the driver
 * library) with dlopen, as frameworks do, makes a configurable mix of allocation calls from
 * several threads, and prints a JSON report of every call it made and what each returned. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*fn_ptr_size)(void **, size_t);
typedef int (*fn_ptr)(void *);
typedef int (*fn_ptr_size_stream)(void **, size_t, void *);
typedef int (*fn_ptr_stream)(void *, void *);
typedef int (*fn_ptr_size_flags)(void **, size_t, unsigned);
typedef int (*fn_pitch)(void **, size_t *, size_t, size_t);
typedef int (*fn_info)(size_t *, size_t *);
typedef int (*fn_int)(int);
typedef int (*fn_intp)(int *);
typedef int (*fn_void)(void);
typedef int (*fn_stream)(void *);
typedef int (*fn_pool_alloc)(void **, size_t, void *, void *);
typedef int (*fn_cu_alloc)(uint64_t *, size_t);
typedef int (*fn_cu_free)(uint64_t);
typedef int (*fn_cu_alloc_stream)(uint64_t *, size_t, void *);
typedef int (*fn_cu_free_stream)(uint64_t, void *);
typedef int (*fn_cu_alloc_flags)(uint64_t *, size_t, unsigned);
typedef int (*fn_cu_pool_alloc)(uint64_t *, size_t, void *, void *);
typedef int (*fn_cu_reserve)(uint64_t *, size_t, size_t, uint64_t, unsigned long long);
typedef int (*fn_cu_range)(uint64_t, size_t);
typedef int (*fn_cu_create)(uint64_t *, size_t, const void *, unsigned long long);
typedef int (*fn_cu_release)(uint64_t);
typedef int (*fn_cu_map)(uint64_t, size_t, size_t, uint64_t, unsigned long long);

/* Ops as tracer names them (variants count under their base name). */
static const char *OPS[] = {
    "cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaMallocManaged",
    "cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaMallocPitch", "cudaMemGetInfo",
    "cudaSetDevice", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaMallocFromPoolAsync",
    "cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocManaged",
    "cuMemGetInfo_v2", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease",
    "cuMemMap", "cuMemUnmap", "cuMemAllocFromPoolAsync", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
};
enum { N_OPS = sizeof OPS / sizeof OPS[0], MAX_RET = 1024 };

struct stats { uint64_t calls[N_OPS]; uint64_t rets[N_OPS][8]; int ret_codes[N_OPS][8]; uint64_t bytes_ok[N_OPS]; };

static struct {
    const char *cudart, *cuda, *mix, *start_when;
    int threads, device, start_delay_ms, hold_ms, duration_ms;
    long iters;
    size_t size;
} opt = {NULL, NULL, "pairs", NULL, 1, 0, 0, 0, 0, 1000, 1 << 20};

static void *rt, *drv;
static struct stats *thread_stats;
static pid_t *thread_tids;
static int *thread_devices;
static int device_count = 1;

static void *sym(void *lib, const char *name) {
    void *p = lib ? dlsym(lib, name) : NULL;
    if (!p) { fprintf(stderr, "simdriver: symbol %s not found: %s\n", name, dlerror()); exit(2); }
    return p;
}

static int op_index(const char *name) {
    for (int i = 0; i < N_OPS; i++) if (!strcmp(OPS[i], name)) return i;
    fprintf(stderr, "simdriver: unknown op %s\n", name);
    exit(2);
}

static int record(struct stats *s, const char *op, int ret, size_t bytes) {
    int i = op_index(op);
    s->calls[i]++;
    if (ret == 0) s->bytes_ok[i] += bytes;
    for (int k = 0; k < 8; k++) {
        if (s->rets[i][k] == 0 || s->ret_codes[i][k] == ret) {
            s->ret_codes[i][k] = ret;
            s->rets[i][k]++;
            break;
        }
    }
    return ret;
}

#define CALL(s, op, bytes, expr) record(s, op, (expr), bytes)

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* With --duration-ms, runs until then instead of --iters times. */
static int keep_going(long i, uint64_t until) {
    if (!until) return i < opt.iters;
    return (i & 1023) || mono_ns() < until;
}

static void run_pairs(struct stats *s) {
    fn_ptr_size cudaMalloc = sym(rt, "cudaMalloc");
    fn_ptr cudaFree = sym(rt, "cudaFree");
    uint64_t until = opt.duration_ms ? mono_ns() + (uint64_t)opt.duration_ms * 1000000ULL : 0;
    for (long i = 0; keep_going(i, until); i++) {
        void *p = NULL;
        if (CALL(s, "cudaMalloc", opt.size, cudaMalloc(&p, opt.size)) == 0)
            CALL(s, "cudaFree", opt.size, cudaFree(p));
    }
}

/* The real runtime without a GPU: every call fails (35), the probes still fire. cudaMalloc then
 * cudaFree, as `pairs` does, at the real entry and return sites (on their error path). */
static void run_real_pairs(struct stats *s) {
    fn_ptr_size cudaMalloc = sym(rt, "cudaMalloc");
    fn_ptr cudaFree = sym(rt, "cudaFree");
    for (long i = 0; i < opt.iters; i++) {
        void *p = NULL;
        CALL(s, "cudaMalloc", opt.size, cudaMalloc(&p, opt.size));
        CALL(s, "cudaFree", opt.size, cudaFree(p));
    }
}

static void run_real(struct stats *s) {
    fn_ptr_size cudaMalloc = sym(rt, "cudaMalloc");
    for (long i = 0; i < opt.iters; i++) {
        void *p = NULL;
        CALL(s, "cudaMalloc", opt.size, cudaMalloc(&p, opt.size));
    }
}

static void run_all(struct stats *s, int device) {
    fn_int cudaSetDevice = sym(rt, "cudaSetDevice");
    fn_ptr_size cudaMalloc = sym(rt, "cudaMalloc");
    fn_ptr cudaFree = sym(rt, "cudaFree");
    fn_ptr_size_stream cudaMallocAsync = sym(rt, "cudaMallocAsync");
    fn_ptr_size_stream cudaMallocAsync_ptsz = sym(rt, "cudaMallocAsync_ptsz");
    fn_ptr_stream cudaFreeAsync = sym(rt, "cudaFreeAsync");
    fn_ptr_size_flags cudaMallocManaged = sym(rt, "cudaMallocManaged");
    fn_ptr_size cudaMallocHost = sym(rt, "cudaMallocHost");
    fn_ptr_size_flags cudaHostAlloc = sym(rt, "cudaHostAlloc");
    fn_ptr cudaFreeHost = sym(rt, "cudaFreeHost");
    fn_pitch cudaMallocPitch = sym(rt, "cudaMallocPitch");
    fn_info cudaMemGetInfo = sym(rt, "cudaMemGetInfo");
    fn_void cudaDeviceSynchronize = sym(rt, "cudaDeviceSynchronize");
    fn_stream cudaStreamSynchronize = sym(rt, "cudaStreamSynchronize");
    fn_stream cudaStreamSynchronize_ptsz = sym(rt, "cudaStreamSynchronize_ptsz");
    fn_pool_alloc cudaMallocFromPoolAsync = sym(rt, "cudaMallocFromPoolAsync");
    fn_cu_alloc cuMemAlloc = sym(drv, "cuMemAlloc_v2");
    fn_cu_free cuMemFree = sym(drv, "cuMemFree_v2");
    fn_cu_alloc_stream cuMemAllocAsync = sym(drv, "cuMemAllocAsync");
    fn_cu_free_stream cuMemFreeAsync = sym(drv, "cuMemFreeAsync");
    fn_cu_free_stream cuMemFreeAsync_ptsz = sym(drv, "cuMemFreeAsync_ptsz");
    fn_cu_alloc_flags cuMemAllocManaged = sym(drv, "cuMemAllocManaged");
    fn_cu_pool_alloc cuMemAllocFromPoolAsync = sym(drv, "cuMemAllocFromPoolAsync");
    fn_info cuMemGetInfo = sym(drv, "cuMemGetInfo_v2");
    fn_cu_reserve cuMemAddressReserve = sym(drv, "cuMemAddressReserve");
    fn_cu_range cuMemAddressFree = sym(drv, "cuMemAddressFree");
    fn_cu_create cuMemCreate = sym(drv, "cuMemCreate");
    fn_cu_release cuMemRelease = sym(drv, "cuMemRelease");
    fn_cu_map cuMemMap = sym(drv, "cuMemMap");
    fn_cu_range cuMemUnmap = sym(drv, "cuMemUnmap");

    void *stream = (void *)0x5eed;
    size_t size = opt.size;
    CALL(s, "cudaSetDevice", 0, cudaSetDevice(device));
    for (long i = 0; i < opt.iters; i++) {
        void *p1 = NULL, *p2 = NULL, *p3 = NULL, *p4 = NULL, *p5 = NULL, *h1 = NULL, *h2 = NULL;
        size_t pitch = 0, f = 0, t = 0;
        CALL(s, "cudaMalloc", size, cudaMalloc(&p1, size));
        CALL(s, "cudaMallocAsync", 2 * size, cudaMallocAsync(&p2, 2 * size, stream));
        CALL(s, "cudaFreeAsync", 2 * size, cudaFreeAsync(p2, stream));
        CALL(s, "cudaMallocAsync", size, cudaMallocAsync_ptsz(&p2, size, stream));
        CALL(s, "cudaFreeAsync", size, cudaFreeAsync(p2, stream));
        CALL(s, "cudaMallocManaged", size, cudaMallocManaged(&p3, size, 1));
        CALL(s, "cudaMallocHost", 4096, cudaMallocHost(&h1, 4096));
        CALL(s, "cudaHostAlloc", 8192, cudaHostAlloc(&h2, 8192, 0));
        CALL(s, "cudaFreeHost", 4096, cudaFreeHost(h1));
        CALL(s, "cudaFreeHost", 8192, cudaFreeHost(h2));
        CALL(s, "cudaMallocPitch", 1024 * 10, cudaMallocPitch(&p4, &pitch, 1000, 10));
        CALL(s, "cudaMemGetInfo", 0, cudaMemGetInfo(&f, &t));
        CALL(s, "cudaDeviceSynchronize", 0, cudaDeviceSynchronize());
        CALL(s, "cudaStreamSynchronize", 0, cudaStreamSynchronize(stream));
        CALL(s, "cudaStreamSynchronize", 0, cudaStreamSynchronize_ptsz(stream));
        CALL(s, "cudaMallocFromPoolAsync", size, cudaMallocFromPoolAsync(&p5, size, NULL, stream));

        uint64_t d1 = 0, d2 = 0, d3 = 0, d4 = 0, va = 0, handle = 0;
        CALL(s, "cuMemAlloc_v2", 3 * size, cuMemAlloc(&d1, 3 * size));
        CALL(s, "cuMemAllocAsync", size, cuMemAllocAsync(&d2, size, stream));
        CALL(s, "cuMemFreeAsync", size, cuMemFreeAsync(d2, stream));
        CALL(s, "cuMemAllocAsync", size, cuMemAllocAsync(&d2, size, stream));
        CALL(s, "cuMemFreeAsync", size, cuMemFreeAsync_ptsz(d2, stream));
        CALL(s, "cuMemAllocManaged", size, cuMemAllocManaged(&d3, size, 1));
        CALL(s, "cuMemAllocFromPoolAsync", size, cuMemAllocFromPoolAsync(&d4, size, NULL, stream));
        CALL(s, "cuMemGetInfo_v2", 0, cuMemGetInfo(&f, &t));
        /* The physical memory lives on the next device, not the thread's: tracer reads it from prop. */
        struct { int type, handle_types, location_type, location_id; void *meta; } prop = {1, 0, 1, (device + 1) % device_count, NULL};
        CALL(s, "cuMemAddressReserve", 4 << 20, cuMemAddressReserve(&va, 4 << 20, 0, 0, 0));
        CALL(s, "cuMemCreate", 2 << 20, cuMemCreate(&handle, 2 << 20, &prop, 0));
        CALL(s, "cuMemMap", 2 << 20, cuMemMap(va, 2 << 20, 0, handle, 0));
        CALL(s, "cuMemUnmap", 2 << 20, cuMemUnmap(va, 2 << 20));
        CALL(s, "cuMemRelease", 2 << 20, cuMemRelease(handle));
        CALL(s, "cuMemAddressFree", 4 << 20, cuMemAddressFree(va, 4 << 20));

        /* Failures: too large (2), an invalid free (1), a device that does not exist (101). */
        void *huge = NULL;
        CALL(s, "cudaMalloc", (size_t)1 << 50, cudaMalloc(&huge, (size_t)1 << 50));
        CALL(s, "cudaFree", 0, cudaFree((void *)0xdead000));
        CALL(s, "cudaSetDevice", 0, cudaSetDevice(999));

        CALL(s, "cudaFree", size, cudaFree(p1));
        CALL(s, "cudaFree", size, cudaFree(p3));
        CALL(s, "cudaFree", 1024 * 10, cudaFree(p4));
        CALL(s, "cudaFree", size, cudaFree(p5));
        CALL(s, "cuMemFree_v2", 3 * size, cuMemFree(d1));
        CALL(s, "cuMemFree_v2", size, cuMemFree(d3));
        CALL(s, "cuMemFree_v2", size, cuMemFree(d4));
    }
}

/* Three ways a thread is on a device, each followed by PyTorch's probe naming the thread's
 * current device as its allocator does (c10::cuda::GetDevice): thread 0 sets device 1 with
 * cudaSetDevice (PyTorch changing device), thread 1 sets none (device 0, CUDA's default: PyTorch
 * on device 0 never calls cudaSetDevice), thread 2 makes device 1's primary context current
 * (cuCtxSetCurrent). Needs libsimtorch.so beside the runtime. */
static int run_devices(struct stats *s, int t) {
    fn_int cudaSetDevice = sym(rt, "cudaSetDevice");
    fn_intp cudaGetDevice = sym(rt, "cudaGetDevice");
    fn_ptr_size cudaMalloc = sym(rt, "cudaMalloc");
    fn_ptr cudaFree = sym(rt, "cudaFree");
    fn_cu_alloc cuMemAlloc = sym(drv, "cuMemAlloc_v2");
    fn_cu_free cuMemFree = sym(drv, "cuMemFree_v2");
    int (*retain)(void **, int) = sym(drv, "cuDevicePrimaryCtxRetain");
    int (*set_current)(void *) = sym(drv, "cuCtxSetCurrent");
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s", opt.cudart);
    snprintf(strrchr(path, '/') ? strrchr(path, '/') + 1 : path, 64, "libsimtorch.so");
    void *torch = dlopen(path, RTLD_NOW);
    void (*probe_malloc)(uint64_t, int8_t, uint64_t, uint64_t) = sym(torch, "simtorch_malloc");
    void (*probe_free)(uint64_t) = sym(torch, "simtorch_free");
    int mode = t % 3;
    if (mode == 0) CALL(s, "cudaSetDevice", 0, cudaSetDevice(1 % device_count));
    if (mode == 2) {
        void *ctx = NULL;
        CALL(s, "cuDevicePrimaryCtxRetain", 0, retain(&ctx, 1 % device_count));
        CALL(s, "cuCtxSetCurrent", 0, set_current(ctx));
    }
    int device = 0;
    cudaGetDevice(&device);
    for (long i = 0; i < opt.iters; i++) {
        void *p = NULL;
        uint64_t d = 0;
        if (mode == 2) {
            if (CALL(s, "cuMemAlloc_v2", opt.size, cuMemAlloc(&d, opt.size)) != 0) continue;
        } else {
            if (CALL(s, "cudaMalloc", opt.size, cudaMalloc(&p, opt.size)) != 0) continue;
            d = (uint64_t)(uintptr_t)p;
        }
        probe_malloc(d, (int8_t)device, opt.size / 2, 0);
        probe_free(d);
        if (mode == 2) CALL(s, "cuMemFree_v2", opt.size, cuMemFree(d));
        else CALL(s, "cudaFree", opt.size, cudaFree(p));
    }
    return device;
}

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    thread_tids[t] = (pid_t)syscall(SYS_gettid);
    int device = (opt.device + t) % device_count;
    thread_devices[t] = device;
    struct stats *s = &thread_stats[t];
    if (!strcmp(opt.mix, "pairs")) run_pairs(s);
    else if (!strcmp(opt.mix, "all")) run_all(s, device);
    else if (!strcmp(opt.mix, "real")) run_real(s);
    else if (!strcmp(opt.mix, "real-pairs")) run_real_pairs(s);
    else if (!strcmp(opt.mix, "devices")) thread_devices[t] = run_devices(s, t);
    else { fprintf(stderr, "simdriver: unknown --mix %s (pairs, all, real, real-pairs, devices)\n", opt.mix); exit(2); }
    return NULL;
}

static void usage(void) {
    fprintf(stderr,
            "usage: simdriver [--cudart PATH] [--cuda PATH|none] [--mix pairs|all|real|real-pairs|devices] [--threads N]\n"
            "                 [--iters N] [--size BYTES] [--device D] [--start-delay-ms N] [--start-when FILE]\n                 [--hold-ms N] [--duration-ms N (pairs: run this long instead of --iters)]\n");
    exit(2);
}

int main(int argc, char **argv) {
    static char default_rt[PATH_MAX], default_drv[PATH_MAX];
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        char *dir = dirname(self);
        snprintf(default_rt, sizeof default_rt, "%s/libcudart.so.12", dir);
        snprintf(default_drv, sizeof default_drv, "%s/libcuda.so.1", dir);
    }
    opt.cudart = default_rt;
    opt.cuda = default_drv;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--cudart")) opt.cudart = v;
        else if (!strcmp(a, "--cuda")) opt.cuda = v;
        else if (!strcmp(a, "--mix")) opt.mix = v;
        else if (!strcmp(a, "--threads")) opt.threads = atoi(v);
        else if (!strcmp(a, "--iters")) opt.iters = atol(v);
        else if (!strcmp(a, "--size")) opt.size = strtoull(v, NULL, 0);
        else if (!strcmp(a, "--device")) opt.device = atoi(v);
        else if (!strcmp(a, "--start-delay-ms")) opt.start_delay_ms = atoi(v);
        else if (!strcmp(a, "--start-when")) opt.start_when = v;
        else if (!strcmp(a, "--hold-ms")) opt.hold_ms = atoi(v);
        else if (!strcmp(a, "--duration-ms")) opt.duration_ms = atoi(v);
        else usage();
        i++;
    }
    if (opt.threads < 1 || opt.iters < 0) usage();
    rt = dlopen(opt.cudart, RTLD_NOW | RTLD_GLOBAL);
    if (!rt) { fprintf(stderr, "simdriver: cannot load %s: %s\n", opt.cudart, dlerror()); return 2; }
    if (strcmp(opt.cuda, "none")) {
        drv = dlopen(opt.cuda, RTLD_NOW | RTLD_GLOBAL);
        if (!drv) { fprintf(stderr, "simdriver: cannot load %s: %s\n", opt.cuda, dlerror()); return 2; }
    }
    fn_intp cudaGetDeviceCount = (fn_intp)dlsym(rt, "cudaGetDeviceCount");
    if (cudaGetDeviceCount && strncmp(opt.mix, "real", 4) && cudaGetDeviceCount(&device_count) != 0) device_count = 1;
    if (device_count < 1) device_count = 1;
    if (opt.start_delay_ms) usleep((useconds_t)opt.start_delay_ms * 1000);
    /* Libraries loaded, no call made yet: a test creates FILE once the tracer is ready. */
    while (opt.start_when && access(opt.start_when, F_OK) != 0) usleep(10000);

    thread_stats = calloc((size_t)opt.threads, sizeof *thread_stats);
    thread_tids = calloc((size_t)opt.threads, sizeof *thread_tids);
    thread_devices = calloc((size_t)opt.threads, sizeof *thread_devices);
    pthread_t *threads = calloc((size_t)opt.threads, sizeof *threads);
    struct timespec t0, t1, c0, c1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    for (int t = 0; t < opt.threads; t++)
        if (pthread_create(&threads[t], NULL, worker, (void *)(intptr_t)t)) { perror("pthread_create"); return 1; }
    for (int t = 0; t < opt.threads; t++) pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    if (opt.hold_ms) usleep((useconds_t)opt.hold_ms * 1000);

    double elapsed = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    /* CPU time (user + kernel, probes included) is steadier than wall time on a shared VM. */
    double cpu = (double)(c1.tv_sec - c0.tv_sec) + (double)(c1.tv_nsec - c0.tv_nsec) / 1e9;
    printf("{\"pid\":%d,\"elapsed_s\":%.6f,\"cpu_s\":%.6f,\"threads\":[", getpid(), elapsed, cpu);
    for (int t = 0; t < opt.threads; t++)
        printf("%s{\"tid\":%d,\"device\":%d}", t ? "," : "", thread_tids[t], thread_devices[t]);
    printf("],\"ops\":{");
    int first = 1;
    for (int i = 0; i < N_OPS; i++) {
        uint64_t calls = 0, bytes = 0;
        for (int t = 0; t < opt.threads; t++) { calls += thread_stats[t].calls[i]; bytes += thread_stats[t].bytes_ok[i]; }
        if (!calls) continue;
        printf("%s\"%s\":{\"calls\":%llu,\"bytes_ok\":%llu,\"rets\":{", first ? "" : ",", OPS[i],
               (unsigned long long)calls, (unsigned long long)bytes);
        first = 0;
        /* Merge per-thread return-code counts. */
        int codes[64]; uint64_t counts[64]; int nc = 0;
        for (int t = 0; t < opt.threads; t++)
            for (int k = 0; k < 8 && thread_stats[t].rets[i][k]; k++) {
                int c = thread_stats[t].ret_codes[i][k], j;
                for (j = 0; j < nc && codes[j] != c; j++) {}
                if (j == nc && nc < 64) { codes[nc] = c; counts[nc++] = 0; }
                if (j < 64) counts[j] += thread_stats[t].rets[i][k];
            }
        for (int j = 0; j < nc; j++) printf("%s\"%d\":%llu", j ? "," : "", codes[j], (unsigned long long)counts[j]);
        printf("}}");
    }
    printf("}}\n");
    return 0;
}
