/* A training-shaped loop for `cargo xtask bench` (the step section), on the simulated runtime:
 * per step, the tensor allocations of one window of a real PyTorch trace (step_plan.py: the
 * recorded sizes and order, so each tensor lives as long as it did) through libsimtorch.so's
 * USDT sites (PyTorch's `pytorch:malloc` / `pytorch:free`), and the CUDA calls a step makes
 * beside them (an event recorded and queried per slice, a stream sync at the loss, a few device
 * allocations), around a CPU-bound body cut into 20 slices, each ending in a short wait as a host
 * waits on its GPU. The threads are a PyTorch job's: the main thread runs the forward half and
 * blocks while the autograd thread runs the backward half; a device thread completes the waits
 * (the waiter blocks and is woken, as a blocking sync or a queue is); a loader thread hands over
 * each step's batch.
 *
 * usage: train_step calibrate                      prints work units per millisecond
 *        train_step PLAN UNITS_PER_MS WORK_MS STEPS WARMUP [WAIT_US]
 * WORK_MS is the body's CPU work a step (the bench finds the one that makes an untraced step
 * last as long as it asks: the waits and hand-offs take the rest).
 * Prints {"steps", "step_ms_mean", "step_ms_median", "step_ms_min", "step_ms_max",
 *         "hits_per_step", "cuda_calls_per_step", "cpu_s", "semaphore", "armed_steps",
 *         "armed_ms_sum", "unarmed_ms_sum"}: the last three split the steps by whether PyTorch's
 *         semaphores were raised (tracer --allocator auto armed) from start to end; a step
 *         during which they changed counts in neither sum. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int cudaStreamSynchronize(void *stream);
int cudaEventCreate(void **event);
int cudaEventRecord(void *event, void *stream);
int cudaEventQuery(void *event);
void simtorch_malloc(uint64_t ptr, int8_t device, uint64_t size, uint64_t stream);
void simtorch_free(uint64_t ptr);
int simtorch_semaphores(void);

enum { SLICES = 20, MAX_OPS = 1 << 16 };

struct op { char kind; uint64_t offset, size; };
static struct op ops[MAX_OPS];
static int n_ops;
static uint64_t segment;
static double units_per_ms, work_ms, step_ms;
static long wait_ns = 50000;
static void *event;
static volatile uint64_t sink;

static double now_s(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* A fixed amount of CPU work (not a deadline: time taken from the thread shows as a longer step). */
static void work(double units) {
    uint64_t x = sink | 1;
    for (long i = 0; i < (long)units; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    sink = x;
}

/* A handshake between two threads: one posts and blocks until the other answers. */
struct handoff { pthread_mutex_t lock; pthread_cond_t cond; long posted, answered; };
#define HANDOFF_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0}
static struct handoff gpu = HANDOFF_INIT, backward = HANDOFF_INIT, batch = HANDOFF_INIT;
static int stopping;

static void post_and_wait(struct handoff *h) {
    pthread_mutex_lock(&h->lock);
    long mine = ++h->posted;
    pthread_cond_broadcast(&h->cond);
    while (h->answered < mine) pthread_cond_wait(&h->cond, &h->lock);
    pthread_mutex_unlock(&h->lock);
}

/* Blocks until posted (or stopping); returns 0 when stopping. */
static int take(struct handoff *h) {
    pthread_mutex_lock(&h->lock);
    while (h->posted == h->answered && !stopping) pthread_cond_wait(&h->cond, &h->lock);
    int got = !stopping;
    pthread_mutex_unlock(&h->lock);
    return got;
}

static void answer(struct handoff *h) {
    pthread_mutex_lock(&h->lock);
    h->answered++;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->lock);
}

/* The device: each wait it is asked for completes wait_ns later, and the waiter is woken. */
static void *device_thread(void *arg) {
    (void)arg;
    /* Woken when the wait is over, not up to the default 50 us timer slack later. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    struct timespec ts = {0, wait_ns};
    while (take(&gpu)) {
        nanosleep(&ts, NULL);
        answer(&gpu);
    }
    return NULL;
}

/* One slice: its share of the body, its share of the plan's hits, an event, a wait. */
static void slice(int index) {
    work(units_per_ms * work_ms / SLICES);
    for (int i = n_ops * index / SLICES; i < n_ops * (index + 1) / SLICES; i++) {
        if (ops[i].kind == 'a')
            simtorch_malloc(segment + ops[i].offset, 0, ops[i].size, 0);
        else
            simtorch_free(segment + ops[i].offset);
    }
    cudaEventRecord(event, NULL);
    cudaEventQuery(event);
    post_and_wait(&gpu);
}

/* The autograd engine's thread: runs the backward half while the main thread waits. */
static void *autograd_thread(void *arg) {
    (void)arg;
    while (take(&backward)) {
        for (int s = SLICES / 2; s < SLICES; s++) slice(s);
        answer(&backward);
    }
    return NULL;
}

/* The loader: the next batch is ready a while after the last was taken. */
static void *loader_thread(void *arg) {
    (void)arg;
    struct timespec ts = {0, (long)(step_ms * 1e6 / 4)};
    while (take(&batch)) {
        nanosleep(&ts, NULL);
        answer(&batch);
    }
    return NULL;
}

static void step(void) {
    post_and_wait(&batch);
    for (int s = 0; s < SLICES / 2; s++) slice(s);
    post_and_wait(&backward);
    /* The optimizer: a cache miss or two, and the loss read back. */
    void *p[2] = {0};
    for (int i = 0; i < 2; i++) cudaMalloc(&p[i], 2 << 20);
    for (int i = 0; i < 2; i++) cudaFree(p[i]);
    cudaStreamSynchronize(NULL);
}

static void read_plan(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) { perror(path); exit(2); }
    char kind;
    unsigned long long span = 0, a, b;
    if (fscanf(f, "span %llu", &span) != 1) { fprintf(stderr, "%s: no span line\n", path); exit(2); }
    while (n_ops < MAX_OPS && fscanf(f, " %c %llu", &kind, &a) == 2) {
        b = 0;
        if (kind == 'a' && fscanf(f, " %llu", &b) != 1) break;
        ops[n_ops++] = (struct op){kind, a, b};
    }
    fclose(f);
    void *seg = NULL;
    if (cudaMalloc(&seg, span) != 0) { fprintf(stderr, "train_step: cudaMalloc(%llu) failed\n", span); exit(2); }
    segment = (uint64_t)(uintptr_t)seg;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "calibrate")) {
        double best = 0;
        for (int i = 0; i < 5; i++) {
            double t0 = now_s(CLOCK_MONOTONIC);
            work(2e7);
            best = best > 0 && best < now_s(CLOCK_MONOTONIC) - t0 ? best : now_s(CLOCK_MONOTONIC) - t0;
        }
        printf("%.0f\n", 2e7 / (best * 1e3));
        return 0;
    }
    if (argc < 6) {
        fprintf(stderr, "usage: train_step calibrate | PLAN UNITS_PER_MS WORK_MS STEPS WARMUP [WAIT_US]\n");
        return 2;
    }
    units_per_ms = atof(argv[2]);
    work_ms = atof(argv[3]);
    step_ms = work_ms;
    int steps = atoi(argv[4]), warmup = atoi(argv[5]);
    if (argc > 6) wait_ns = atol(argv[6]) * 1000;
    if (steps < 1 || steps > 100000 || warmup < 0 || work_ms <= 0) {
        fprintf(stderr, "train_step: STEPS 1..100000, WORK_MS above 0\n");
        return 2;
    }
    read_plan(argv[1]);
    cudaEventCreate(&event);
    pthread_t threads[3];
    pthread_create(&threads[0], NULL, device_thread, NULL);
    pthread_create(&threads[1], NULL, autograd_thread, NULL);
    pthread_create(&threads[2], NULL, loader_thread, NULL);
    for (int i = 0; i < warmup; i++) step();
    double *ms = calloc(steps, sizeof *ms);
    double cpu0 = now_s(CLOCK_PROCESS_CPUTIME_ID), wall0 = now_s(CLOCK_MONOTONIC);
    /* Steps made with PyTorch's semaphores raised (tracer's allocator probes armed) and not. */
    int armed_steps = 0;
    double armed_ms = 0, unarmed_ms = 0;
    for (int i = 0; i < steps; i++) {
        int armed = simtorch_semaphores() > 0;
        double t0 = now_s(CLOCK_MONOTONIC);
        step();
        ms[i] = (now_s(CLOCK_MONOTONIC) - t0) * 1e3;
        if (armed && simtorch_semaphores() > 0) {
            armed_steps++;
            armed_ms += ms[i];
        } else if (!armed && simtorch_semaphores() == 0) {
            unarmed_ms += ms[i];
        }
    }
    double wall = now_s(CLOCK_MONOTONIC) - wall0, cpu = now_s(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
    struct handoff *all[] = {&gpu, &backward, &batch};
    for (int i = 0; i < 3; i++) {
        pthread_mutex_lock(&all[i]->lock);
        stopping = 1;
        pthread_cond_broadcast(&all[i]->cond);
        pthread_mutex_unlock(&all[i]->lock);
    }
    for (int i = 0; i < 3; i++) pthread_join(threads[i], NULL);
    qsort(ms, steps, sizeof *ms, cmp);
    printf("{\"steps\":%d,\"step_ms_mean\":%.4f,\"step_ms_median\":%.4f,\"step_ms_min\":%.4f,\"step_ms_max\":%.4f,"
           "\"hits_per_step\":%d,\"cuda_calls_per_step\":%d,\"cpu_s\":%.6f,\"semaphore\":%d,"
           "\"armed_steps\":%d,\"armed_ms_sum\":%.4f,\"unarmed_ms_sum\":%.4f}\n",
           steps, wall * 1e3 / steps, ms[steps / 2], ms[0], ms[steps - 1], n_ops, 2 * SLICES + 5, cpu,
           simtorch_semaphores(), armed_steps, armed_ms, unarmed_ms);
    return 0;
}
