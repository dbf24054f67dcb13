/* A program with the CUDA runtime linked in statically (no libcudart.so): tracer must find
 * cudaMalloc in the executable's own symbol table. Usage: staticapp ITERS DELAY_MS */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 10;
    int delay_ms = argc > 2 ? atoi(argv[2]) : 0;
    if (delay_ms) usleep((useconds_t)delay_ms * 1000);
    long ok = 0;
    for (long i = 0; i < iters; i++) {
        void *p = NULL;
        if (cudaMalloc(&p, 4096) == 0 && cudaFree(p) == 0) ok++;
    }
    printf("{\"pid\":%d,\"pairs_ok\":%ld}\n", getpid(), ok);
    return ok == iters ? 0 : 1;
}
