/* A loop through one USDT site, semaphore-gated as PyTorch's are (sys/sdt.h), for
 * `cargo xtask bench`: the cost of a probe hit at a USDT `nop`, the floor for tracing such
 * sites. Prints {"cpu_s": ..., "hits": N}. usage: usdt_loop N DELAY_S */
#define _SDT_HAS_SEMAPHORES 1
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/sdt.h>

__extension__ unsigned short tracer_bench_hit_semaphore __attribute__((unused)) __attribute__((section(".probes")));

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    double delay = argc > 2 ? atof(argv[2]) : 0;
    usleep((useconds_t)(delay * 1e6));
    volatile long sink = 0;
    double start = cpu_s();
    for (long i = 0; i < n; i++) {
        if (tracer_bench_hit_semaphore) STAP_PROBE2(tracer_bench, hit, i, sink);
        sink += i;
    }
    printf("{\"cpu_s\":%.6f,\"hits\":%ld,\"semaphore\":%d}\n", cpu_s() - start, n, tracer_bench_hit_semaphore);
    return 0;
}
