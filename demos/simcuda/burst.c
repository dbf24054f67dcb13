/* A short CUDA program, the kind discovery must not miss (issue 52): it loads the runtime named
 * on its command line, makes COUNT cudaMalloc/cudaFree pairs at once, optionally pauses PAUSE_MS
 * (or, given GO, waits until the file GO exists) and makes COUNT more, and exits, printing one
 * JSON line: its pid, the calls it made, and how long after its start it made the first and
 * exited (CLOCK_MONOTONIC, from main).
 *
 *   burst LIBCUDART COUNT [PAUSE_MS [GO]] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int pairs(malloc_fn m, free_fn f, int count) {
    int ok = 0;
    for (int i = 0; i < count; i++) {
        void *p = NULL;
        if (m(&p, 4096 + (size_t)i * 512) == 0) {
            ok++;
            f(p);
        }
    }
    return ok;
}

int main(int argc, char **argv) {
    double t0 = now_us();
    if (argc < 3) {
        fprintf(stderr, "usage: burst LIBCUDART COUNT [PAUSE_MS]\n");
        return 2;
    }
    int count = atoi(argv[2]);
    int pause_ms = argc > 3 ? atoi(argv[3]) : 0;
    const char *go = argc > 4 ? argv[4] : NULL;
    void *rt = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!rt) {
        fprintf(stderr, "burst: %s\n", dlerror());
        return 1;
    }
    malloc_fn m = (malloc_fn)dlsym(rt, "cudaMalloc");
    free_fn f = (free_fn)dlsym(rt, "cudaFree");
    if (!m || !f) {
        fprintf(stderr, "burst: %s lacks cudaMalloc or cudaFree\n", argv[1]);
        return 1;
    }
    double first = now_us() - t0;
    int ok = pairs(m, f, count);
    int rounds = 1;
    if (pause_ms > 0 || go) {
        usleep((useconds_t)pause_ms * 1000);
        for (int waited = 0; go && access(go, F_OK) != 0 && waited < 60000; waited += 10)
            usleep(10000);
        ok += pairs(m, f, count);
        rounds = 2;
    }
    printf("{\"pid\":%d,\"mallocs\":%d,\"granted\":%d,\"first_call_us\":%.0f,\"exit_us\":%.0f}\n",
           (int)getpid(), count * rounds, ok, first, now_us() - t0);
    return 0;
}
