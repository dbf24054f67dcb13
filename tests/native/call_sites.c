/* Calls the CUDA runtime from known lines through a known chain of functions, built with frame
 * pointers and debug info, and prints the expected call site of each call as JSON lines:
 * {"op": ..., "frames": [["function", line], ...]} innermost first. */
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

static void *pointers[4];

__attribute__((noinline)) void release_all(int n) {
    for (int i = 0; i < n; i++) {
        cudaFree(pointers[i]); int free_line = __LINE__;
        printf("{\"op\": \"cudaFree\", \"frames\": [[\"release_all\", %d], [\"main\", %d]]}\n", free_line, MAIN_FREE_LINE);
    }
}

__attribute__((noinline)) void *allocate(size_t size, int caller_line) {
    void *p = NULL;
    cudaMalloc(&p, size); int line = __LINE__;
    printf("{\"op\": \"cudaMalloc\", \"frames\": [[\"allocate\", %d], [\"build_layer\", %d], [\"main\", %d]]}\n",
           line, caller_line, MAIN_BUILD_LINE);
    return p;
}

__attribute__((noinline)) void build_layer(int i) {
    pointers[i] = allocate(4096 << i, __LINE__);
}

int main(void) {
    for (int i = 0; i < 4; i++) {
        build_layer(i);
    }
    release_all(4);
    fflush(stdout);
    /* Dies at once, as a job killed by the OOM killer or its scheduler does: tracer resolves
     * these frames from the mappings it kept from the process's start, not from /proc. */
    kill(getpid(), SIGKILL);
    return 0;
}
