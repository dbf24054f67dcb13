/* A serving loop that replays a captured CUDA graph every step, for `cargo xtask bench-graphs`:
 * one capture on a side stream at start (as torch.cuda.graph does), then per step a CPU-bound
 * body of `work_us`, the graph's launch and a wait for its stream. Prints one JSON line: the
 * mean step in microseconds and the launches made.
 *
 *   graph_replay WORK_US STEPS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void *cudaStream_t;
typedef void *cudaGraph_t;
typedef void *cudaGraphExec_t;
int cudaStreamCreate(cudaStream_t *s);
int cudaStreamBeginCapture(cudaStream_t s, int mode);
int cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
int cudaGraphInstantiateWithFlags(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
int cudaGraphDestroy(cudaGraph_t g);
int cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
int cudaStreamSynchronize(cudaStream_t s);

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void spin_until(double t) {
    while (now_us() < t) {
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: graph_replay WORK_US STEPS\n");
        return 2;
    }
    double work_us = atof(argv[1]);
    long steps = atol(argv[2]);
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t e;
    if (cudaStreamCreate(&s) || cudaStreamBeginCapture(s, 0) || cudaStreamEndCapture(s, &g) ||
        cudaGraphInstantiateWithFlags(&e, g, 0) || cudaGraphDestroy(g)) {
        fprintf(stderr, "graph_replay: the capture failed\n");
        return 1;
    }
    for (int i = 0; i < 50; i++) cudaGraphLaunch(e, s), cudaStreamSynchronize(s);
    double t0 = now_us();
    for (long i = 0; i < steps; i++) {
        spin_until(now_us() + work_us);
        if (cudaGraphLaunch(e, s) || cudaStreamSynchronize(s)) return 1;
    }
    double t1 = now_us();
    printf("{\"step_us\": %.3f, \"launches\": %ld}\n", (t1 - t0) / steps, steps);
    return 0;
}
