/* A process whose /proc/PID/maps is huge: it maps its own executable MAPS times, executable,
 * at separate addresses (so none merge), then allocates and frees CALLS times, and stays
 * LINGER_MS before it exits (as a job does after its calls).
 * Prints {"mappings": N, "calls": N}. */
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

int main(int argc, char **argv) {
    long maps = argc > 1 ? atol(argv[1]) : 30000;
    long calls = argc > 2 ? atol(argv[2]) : 100;
    long linger_ms = argc > 3 ? atol(argv[3]) : 0;
    int fd = open("/proc/self/exe", O_RDONLY);
    if (fd < 0) return 2;
    long page = sysconf(_SC_PAGESIZE);
    /* One reservation, then every other page mapped from the file: no two mappings touch. */
    char *base = mmap(NULL, 2 * maps * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return 3;
    for (long i = 0; i < maps; i++) {
        if (mmap(base + 2 * i * page, page, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED, fd, 0) == MAP_FAILED) return 4;
    }
    for (long i = 0; i < calls; i++) {
        void *p = NULL;
        if (cudaMalloc(&p, 4096) != 0 || cudaFree(p) != 0) return 5;
    }
    printf("{\"mappings\": %ld, \"calls\": %ld}\n", maps, 2 * calls);
    fflush(stdout);
    usleep((useconds_t)linger_ms * 1000);
    return 0;
}
