/* What every other process on the machine pays for discovery (`cargo xtask bench-discovery`):
 * N opens and closes of an ordinary file, timed (CLOCK_MONOTONIC), one JSON line out.
 *
 *   open_loop PATH N */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: open_loop PATH N\n");
        return 2;
    }
    long n = atol(argv[2]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            perror("open");
            return 1;
        }
        close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("{\"opens\":%ld,\"ns_per_open\":%.1f}\n", n, ns / n);
    return 0;
}
