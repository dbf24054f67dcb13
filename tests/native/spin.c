/* Threads that are preempted and one that blocks, for the scheduler test: after a CUDA call
 * (which makes tracer follow the process and the threads it starts), N threads spin for MS
 * milliseconds (never blocking: on fewer cores they are preempted), while one thread sleeps in
 * short naps. Prints {"spinners": [tids], "sleeper": tid}. usage: spin N MS */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

static long ms;
static pid_t tids[64];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *spin(void *arg) {
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    volatile unsigned long x = 0;
    double end = now() + ms / 1000.0;
    while (now() < end) x++;
    return NULL;
}

static void *sleeper(void *arg) {
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    double end = now() + ms / 1000.0;
    while (now() < end) usleep(20000);
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 4;
    ms = argc > 2 ? atol(argv[2]) : 1000;
    if (n < 1 || n > 60) return 2;
    void *p = NULL;
    if (cudaMalloc(&p, 4096) != 0) return 3;
    /* Let tracer follow this process before its threads start. */
    usleep(300000);
    pthread_t t[64];
    for (long i = 0; i < n; i++) pthread_create(&t[i], NULL, spin, (void *)i);
    pthread_create(&t[n], NULL, sleeper, (void *)n);
    for (long i = 0; i <= n; i++) pthread_join(t[i], NULL);
    cudaFree(p);
    printf("{\"spinners\": [");
    for (long i = 0; i < n; i++) printf("%s%d", i ? ", " : "", tids[i]);
    printf("], \"sleeper\": %d}\n", tids[n]);
    return 0;
}
