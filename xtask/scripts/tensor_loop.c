/* Tensor allocations through PyTorch's own USDT sites, for `cargo xtask bench`: provider
 * `pytorch`, `malloc(ptr, device, size, stream)` and `free(ptr)`, semaphore-gated, as
 * libc10_cuda.so carries them (sys/sdt.h). Each thread hands out and takes back blocks of
 * varied sizes at varied addresses, as a training step does.
 *
 * usage: tensor_loop THREADS PAIRS_PER_THREAD [SECONDS]
 *   with SECONDS > 0 each thread runs that long instead of a fixed number of pairs.
 * Prints {"cpu_s": process CPU seconds, "wall_s": ..., "pairs": N, "semaphore": malloc's}. */
#define _GNU_SOURCE
#define _SDT_HAS_SEMAPHORES 1
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/sdt.h>

__extension__ unsigned short pytorch_malloc_semaphore __attribute__((unused)) __attribute__((section(".probes")));
__extension__ unsigned short pytorch_free_semaphore __attribute__((unused)) __attribute__((section(".probes")));

static long pairs_per_thread;
static double seconds;

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* noinline: each probe site stays a `nop` in a function of its own, as in the allocator. */
__attribute__((noinline)) static void block_malloc(uint64_t ptr, int device, uint64_t size, uint64_t stream) {
    if (pytorch_malloc_semaphore) STAP_PROBE4(pytorch, malloc, ptr, device, size, stream);
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline)) static void block_free(uint64_t ptr) {
    if (pytorch_free_semaphore) STAP_PROBE1(pytorch, free, ptr);
    __asm__ volatile("" ::: "memory");
}

static void *producer(void *arg) {
    long id = (long)arg;
    uint64_t base = 0x7f0000000000ULL + ((uint64_t)id << 36);
    long done = 0;
    double end = seconds > 0 ? now(CLOCK_MONOTONIC) + seconds : 0;
    for (long i = 0;; i++) {
        if (seconds > 0) {
            if ((i & 1023) == 0 && now(CLOCK_MONOTONIC) >= end) break;
        } else if (i >= pairs_per_thread) {
            break;
        }
        uint64_t ptr = base + (uint64_t)(i % 4096) * 0x200000ULL;
        uint64_t size = 512 + (uint64_t)((i * 2654435761u) % (8u << 20));
        block_malloc(ptr, 0, size, 0);
        block_free(ptr);
        done++;
    }
    return (void *)done;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    pairs_per_thread = argc > 2 ? atol(argv[2]) : 100000;
    seconds = argc > 3 ? atof(argv[3]) : 0;
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "tensor_loop: THREADS must be 1..64\n");
        return 2;
    }
    pthread_t t[64];
    double cpu0 = now(CLOCK_PROCESS_CPUTIME_ID), wall0 = now(CLOCK_MONOTONIC);
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, producer, (void *)i);
    long pairs = 0;
    for (int i = 0; i < threads; i++) {
        void *done;
        pthread_join(t[i], &done);
        pairs += (long)done;
    }
    printf("{\"cpu_s\":%.6f,\"wall_s\":%.6f,\"pairs\":%ld,\"semaphore\":%d}\n", now(CLOCK_PROCESS_CPUTIME_ID) - cpu0,
           now(CLOCK_MONOTONIC) - wall0, pairs, pytorch_malloc_semaphore);
    return 0;
}
