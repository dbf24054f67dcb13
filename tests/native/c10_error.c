/* Constructs c10 errors with PyTorch's real libc10.so, as its allocator does when it raises
 * OutOfMemoryError (built inline from c10::Error's base constructor in the real wheels), and
 * another error through the same constructor. No GPU, no torch installed: only the library.
 *
 *     c10_error LIBC10 START_WHEN_FILE
 *
 * Waits for the file (the tracer attached), makes both errors, prints {"pid": N}. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* c10::SourceLocation (24 bytes: passed on the stack) and libstdc++'s std::string. */
struct source_location { const char *function, *file; uint32_t line; };
struct cxx_string { char *data; uint64_t size; union { char local[16]; uint64_t capacity; }; };
typedef void (*error_ctor)(void *self, struct source_location loc, struct cxx_string *msg);

#define OOM_TEXT "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 3.06 MiB is free."

static void raise_error(error_ctor ctor, const char *text) {
    /* The error object (sizeof c10::Error is about 100 bytes), never destroyed: the process
     * exits. The message is heap memory the constructor may take over, as a moved string. */
    void *self = calloc(1, 4096);
    size_t n = strlen(text);
    struct cxx_string msg = {malloc(n + 1), n, {{0}}};
    memcpy(msg.data, text, n + 1);
    msg.capacity = n;
    struct source_location loc = {"malloc", "c10/cuda/CUDACachingAllocator.cpp", 1};
    ctor(self, loc, &msg);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: c10_error LIBC10 START_WHEN_FILE\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "c10_error: %s\n", dlerror()); return 2; }
    error_ctor ctor = (error_ctor)dlsym(lib,
        "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
    if (!ctor) { fprintf(stderr, "c10_error: %s\n", dlerror()); return 2; }
    while (access(argv[2], F_OK) != 0) usleep(10000);
    raise_error(ctor, "Expected all tensors to be on the same device, but found at least two devices");
    raise_error(ctor, OOM_TEXT);
    printf("{\"pid\":%d,\"message\":\"%s\"}\n", getpid(), OOM_TEXT);
    fflush(stdout);
    usleep(300000);
    return 0;
}
