/* The long training job of demos/workloads/long_job.py, in C, fast enough to run at the rate
 * tracer sustains for as long as a benchmark wants (a billion block events): a caching
 * allocator in the manner of PyTorch's over the simulated runtime (cudaMalloc'ed segments, a
 * small pool of 2 MiB segments for requests up to 1 MiB, best fit, PyTorch's split and merge
 * rules, the cache released and the request retried once when the device is full), firing
 * PyTorch's probes through libsimtorch.so. The weights come first and stay; then steps of
 * activations whose sizes vary, one a step living on for 24 steps; then the device fills and a
 * request no cached block holds fails: PyTorch's OOM. At the end it writes its own account
 * (segments and blocks) to --account and one JSON line to stdout.
 *
 * --rate N paces it to N block events a second (the rate a tracer keeps up with).
 *
 *   simjob --cudart PATH --seconds S [--rate N] [--until FILE] [--account FILE] [--ready FILE] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KIB 1024ULL
#define MIB (1024 * KIB)
#define SMALL_SIZE MIB
#define SMALL_SEGMENT (2 * MIB)
#define LARGE_SEGMENT (20 * MIB)
#define MIN_LARGE_ALLOC (10 * MIB)
#define ROUND_LARGE (2 * MIB)
#define MIN_BLOCK 512ULL
#define MAX_SEGMENTS 4096
#define KEPT 24

struct block {
    uint64_t ptr, size, requested;
    int free;
    struct block *prev, *next;
    struct segment *seg;
};

struct segment {
    uint64_t ptr, size;
    int small, live;
    struct block *first;
};

static struct segment segments[MAX_SEGMENTS];
static int nsegments;
static uint64_t events, retries, ooms;

static int (*cuda_malloc)(void **, size_t);
static int (*cuda_free)(void *);
static int (*cuda_mem_get_info)(size_t *, size_t *);
static void (*probe_malloc)(uint64_t, int8_t, uint64_t, uint64_t);
static void (*probe_free)(uint64_t);
static void (*probe_oom)(const char *);

static uint64_t rng = 88172645463325252ULL;
static uint64_t next_rand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static uint64_t randint(uint64_t lo, uint64_t hi) { return lo + next_rand() % (hi - lo + 1); }

static uint64_t round_size(uint64_t size) {
    return size < MIN_BLOCK ? MIN_BLOCK : (size + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

static uint64_t segment_size(uint64_t size) {
    if (size <= SMALL_SIZE) return SMALL_SEGMENT;
    if (size < MIN_LARGE_ALLOC) return LARGE_SEGMENT;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

static struct block *new_block(struct segment *seg, uint64_t ptr, uint64_t size) {
    struct block *b = calloc(1, sizeof *b);
    if (!b) abort();
    b->ptr = ptr;
    b->size = size;
    b->free = 1;
    b->seg = seg;
    return b;
}

/* The smallest free block that holds `size` in the pool (by size, then address, as PyTorch). */
static struct block *best_fit(uint64_t size, int small) {
    struct block *best = NULL;
    for (int i = 0; i < nsegments; i++) {
        struct segment *s = &segments[i];
        if (!s->live || s->small != small) continue;
        for (struct block *b = s->first; b; b = b->next)
            if (b->free && b->size >= size &&
                (!best || b->size < best->size || (b->size == best->size && b->ptr < best->ptr)))
                best = b;
    }
    return best;
}

static struct block *new_segment(uint64_t size, int small) {
    uint64_t seg_size = segment_size(size);
    void *ptr = NULL;
    if (cuda_malloc(&ptr, seg_size) != 0) return NULL;
    int slot = -1;
    for (int i = 0; i < nsegments; i++)
        if (!segments[i].live) { slot = i; break; }
    if (slot < 0) {
        if (nsegments == MAX_SEGMENTS) abort();
        slot = nsegments++;
    }
    struct segment *s = &segments[slot];
    s->ptr = (uint64_t)ptr;
    s->size = seg_size;
    s->small = small;
    s->live = 1;
    s->first = new_block(s, s->ptr, seg_size);
    return s->first;
}

/* Returns every segment with nothing allocated to the device (a failed cudaMalloc's retry,
 * empty_cache()). */
static void release_cached(void) {
    for (int i = 0; i < nsegments; i++) {
        struct segment *s = &segments[i];
        if (!s->live || s->first->next || !s->first->free) continue;
        cuda_free((void *)s->ptr);
        free(s->first);
        s->live = 0;
    }
}

static void split(struct block *b, uint64_t size, int small) {
    uint64_t remaining = b->size - size;
    if (remaining >= (small ? MIN_BLOCK : SMALL_SIZE + 1)) {
        struct block *rest = new_block(b->seg, b->ptr + size, remaining);
        rest->next = b->next;
        rest->prev = b;
        if (b->next) b->next->prev = rest;
        b->next = rest;
        b->size = size;
    }
}

static void oom_message(char *out, size_t n, uint64_t size);

/* PyTorch's malloc: NULL (and the OOM raised) when the device cannot serve it. */
static struct block *alloc_block(uint64_t requested) {
    uint64_t size = round_size(requested);
    int small = size <= SMALL_SIZE;
    struct block *b = best_fit(size, small);
    if (!b) b = new_segment(size, small);
    if (!b) {
        release_cached();
        retries++;
        b = new_segment(size, small);
    }
    if (!b) {
        char message[1024];
        ooms++;
        oom_message(message, sizeof message, size);
        probe_oom(message);
        return NULL;
    }
    split(b, size, small);
    b->free = 0;
    b->requested = size;
    probe_malloc(b->ptr, 0, requested, 0);
    events++;
    return b;
}

static void free_block(struct block *b) {
    probe_free(b->ptr);
    events++;
    b->free = 1;
    b->requested = 0;
    struct block *n = b->next, *p = b->prev;
    if (n && n->free) {
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        free(n);
    }
    if (p && p->free) {
        p->size += b->size;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        free(b);
    }
}

struct stats { uint64_t allocated, reserved, largest_free; };

static struct stats stats(void) {
    struct stats s = {0, 0, 0};
    for (int i = 0; i < nsegments; i++) {
        if (!segments[i].live) continue;
        s.reserved += segments[i].size;
        for (struct block *b = segments[i].first; b; b = b->next) {
            if (!b->free) s.allocated += b->size;
            else if (b->size > s.largest_free) s.largest_free = b->size;
        }
    }
    return s;
}

static void format_size(char *out, size_t n, uint64_t v) {
    if (v <= 1024) snprintf(out, n, "%llu bytes", (unsigned long long)v);
    else if (v <= MIB) snprintf(out, n, "%.2f KiB", v / 1024.0);
    else if (v <= 1024 * MIB) snprintf(out, n, "%.2f MiB", (double)v / MIB);
    else snprintf(out, n, "%.2f GiB", (double)v / (1024 * MIB));
}

/* The message current PyTorch raises, with this allocator's figures. */
static void oom_message(char *out, size_t n, uint64_t size) {
    size_t free_b = 0, total = 0;
    cuda_mem_get_info(&free_b, &total);
    struct stats s = stats();
    char tried[32], cap[32], fr[32], used[32], alloc[32], cached[32];
    format_size(tried, sizeof tried, size);
    format_size(cap, sizeof cap, total);
    format_size(fr, sizeof fr, free_b);
    format_size(used, sizeof used, total - free_b);
    format_size(alloc, sizeof alloc, s.allocated);
    format_size(cached, sizeof cached, s.reserved - s.allocated);
    snprintf(out, n,
             "CUDA out of memory. Tried to allocate %s. GPU 0 has a total capacity of %s of which %s is free. "
             "Including non-PyTorch memory, this process has %s memory in use. Of the allocated memory %s is "
             "allocated by PyTorch, and %s is reserved by PyTorch but unallocated.",
             tried, cap, fr, used, alloc, cached);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "simjob: %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void write_account(const char *path, uint64_t request, uint64_t steps) {
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(2);
    }
    struct stats s = stats();
    fprintf(f, "{\"request\": %llu, \"steps\": %llu, \"stats\": {\"allocated\": %llu, \"reserved\": %llu, "
               "\"largest_free_block\": %llu}, \"segments\": [",
            (unsigned long long)request, (unsigned long long)steps, (unsigned long long)s.allocated,
            (unsigned long long)s.reserved, (unsigned long long)s.largest_free);
    /* By address, as the account of long_job.py. */
    int first = 1;
    uint64_t last = 0;
    for (;;) {
        struct segment *next = NULL;
        for (int i = 0; i < nsegments; i++)
            if (segments[i].live && (first || segments[i].ptr > last) && (!next || segments[i].ptr < next->ptr))
                next = &segments[i];
        if (!next) break;
        fprintf(f, "%s{\"ptr\": %llu, \"size\": %llu, \"pool\": \"%s\", \"blocks\": [", first ? "" : ", ",
                (unsigned long long)next->ptr, (unsigned long long)next->size, next->small ? "small" : "large");
        for (struct block *b = next->first; b; b = b->next)
            fprintf(f, "%s{\"ptr\": %llu, \"size\": %llu, \"allocated\": %s, \"requested\": %llu}",
                    b == next->first ? "" : ", ", (unsigned long long)b->ptr, (unsigned long long)b->size,
                    b->free ? "false" : "true", (unsigned long long)b->requested);
        fprintf(f, "]}");
        first = 0;
        last = next->ptr;
    }
    fprintf(f, "]}\n");
    fclose(f);
}

int main(int argc, char **argv) {
    const char *cudart = NULL, *until = NULL, *account = NULL, *ready = NULL;
    double seconds = 10, rate = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--cudart")) cudart = argv[i + 1];
        else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--rate")) rate = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--until")) until = argv[i + 1];
        else if (!strcmp(argv[i], "--account")) account = argv[i + 1];
        else if (!strcmp(argv[i], "--ready")) ready = argv[i + 1];
        else {
            fprintf(stderr, "simjob: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!cudart) {
        fprintf(stderr, "usage: simjob --cudart PATH [--seconds S] [--rate N] [--until FILE] [--account FILE] [--ready FILE]\n");
        return 2;
    }
    void *rt = dlopen(cudart, RTLD_NOW | RTLD_GLOBAL);
    char probes_path[4096];
    snprintf(probes_path, sizeof probes_path, "%s", cudart);
    char *slash = strrchr(probes_path, '/');
    snprintf(slash ? slash + 1 : probes_path, sizeof probes_path - (slash ? (size_t)(slash + 1 - probes_path) : 0),
             "libsimtorch.so");
    void *torch = dlopen(probes_path, RTLD_NOW);
    if (!rt || !torch) {
        fprintf(stderr, "simjob: %s\n", dlerror());
        return 2;
    }
    cuda_malloc = sym(rt, "cudaMalloc");
    cuda_free = sym(rt, "cudaFree");
    cuda_mem_get_info = sym(rt, "cudaMemGetInfo");
    probe_malloc = sym(torch, "simtorch_malloc");
    probe_free = sym(torch, "simtorch_free");
    probe_oom = sym(torch, "simtorch_oom");
    /* As PyTorch on device 0: no cudaSetDevice (a thread that sets none is on device 0). */
    /* The weights: allocated first, held to the end. */
    for (int i = 0; i < 24; i++) alloc_block(randint(1, 6) * MIB + randint(0, 1023) * KIB);
    for (int i = 0; i < 16; i++) alloc_block(randint(1, 512) * KIB);
    if (ready) {
        FILE *f = fopen(ready, "w");
        if (f) {
            fprintf(f, "%d", getpid());
            fclose(f);
        }
    }
    struct block *kept[KEPT] = {0};
    uint64_t step = 0;
    double start = now_s(), end = start + seconds;
    uint64_t paced_from = events;
    for (;;) {
        if ((step & 255) == 0 && now_s() >= end && !(until && access(until, F_OK) != 0)) break;
        if ((step & 255) == 0 && rate > 0) {
            double ahead = (double)(events - paced_from) / rate - (now_s() - start);
            if (ahead > 0) usleep((useconds_t)(ahead * 1e6));
        }
        uint64_t seq = randint(16, 256);
        struct block *t[10];
        for (int i = 0; i < 4; i++) t[i] = alloc_block(seq * randint(8, 40) * KIB);
        for (int i = 4; i < 10; i++) t[i] = alloc_block(randint(1, 900) * KIB);
        /* One activation a step lives on for KEPT steps. */
        int keep = (int)randint(0, 3);
        struct block *old = kept[step % KEPT];
        kept[step % KEPT] = t[keep];
        t[keep] = NULL;
        if (old) free_block(old);
        for (int i = 9; i >= 0; i--)
            if (t[i]) free_block(t[i]);
        if (step % 20 == 0) {
            size_t f, tot;
            cuda_mem_get_info(&f, &tot);
        }
        step++;
    }
    /* The device fills with what the job keeps; then a request no cached block holds. */
    size_t free_b, total;
    cuda_mem_get_info(&free_b, &total);
    while (free_b > 24 * MIB) {
        if (!alloc_block(20 * MIB)) break;
        cuda_mem_get_info(&free_b, &total);
    }
    release_cached();
    cuda_mem_get_info(&free_b, &total);
    struct stats s = stats();
    uint64_t request = (s.largest_free > free_b ? s.largest_free : free_b) + 2 * MIB;
    int failed = alloc_block(request) == NULL;
    if (account) write_account(account, request, step);
    printf("{\"steps\": %llu, \"block_events\": %llu, \"retries\": %llu, \"ooms\": %llu, \"request\": %llu}\n",
           (unsigned long long)step, (unsigned long long)events, (unsigned long long)retries,
           (unsigned long long)ooms, (unsigned long long)request);
    return failed ? 1 : 0;
}
