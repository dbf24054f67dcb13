/* Short-lived processes and threads making CUDA calls, for the soak test: the parent forks
 * PROCS children in turn; each starts a thread that allocates and frees once, then both exit.
 * Prints {"processes": N, "threads": N, "calls": N} (calls made, all successful). */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

static void *worker(void *arg) {
    (void)arg;
    void *p = NULL;
    if (cudaMalloc(&p, 4096) != 0 || cudaFree(p) != 0) _exit(3);
    return NULL;
}

int main(int argc, char **argv) {
    long procs = argc > 1 ? atol(argv[1]) : 1000;
    long done = 0;
    for (long i = 0; i < procs; i++) {
        pid_t pid = fork();
        if (pid < 0) return 2;
        if (pid == 0) {
            void *p = NULL;
            if (cudaMalloc(&p, 1 << 20) != 0) _exit(3);
            pthread_t t;
            if (pthread_create(&t, NULL, worker, NULL) != 0) _exit(4);
            pthread_join(t, NULL);
            cudaFree(p);
            _exit(0);
        }
        int status = 0;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 5;
        done++;
    }
    printf("{\"processes\": %ld, \"threads\": %ld, \"calls\": %ld}\n", done, 2 * done, 4 * done);
    return 0;
}
