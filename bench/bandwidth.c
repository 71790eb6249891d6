/* This machine's memory read bandwidth: a read-only kernel over a buffer far larger than any
 * cache, split between THREADS threads as llama.cpp splits a matrix's rows, best of PASSES.
 * What a bandwidth-bound decode can reach at most: bytes read per token / this = the fastest
 * possible token. Built and run by bench/bandwidth.py.
 *
 *   cc -O3 -march=native -fopenmp bench/bandwidth.c -o .bench/bandwidth && .bench/bandwidth MIB THREADS PASSES
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef uint64_t lane __attribute__((vector_size(64)));  /* one cache line, any ISA */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MIB THREADS PASSES\n", argv[0]);
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]), passes = atoi(argv[3]);
    size_t lines = bytes / sizeof(lane);
    lane *buffer = aligned_alloc(64, lines * sizeof(lane));
    if (!buffer) {
        perror("aligned_alloc");
        return 1;
    }
    omp_set_num_threads(threads);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < lines; i++) /* each thread touches its own pages first */
        memset(&buffer[i], (int)(i & 0xff), sizeof(lane));
    double best = 1e30;
    uint64_t checksum = 0;
    for (int pass = 0; pass < passes; pass++) {
        double started = now();
        lane total = {0};
#pragma omp parallel
        {
            /* four independent accumulators keep enough loads in flight */
            lane a = {0}, b = {0}, c = {0}, d = {0};
#pragma omp for schedule(static) nowait
            for (size_t i = 0; i < lines; i += 4) {
                a ^= buffer[i];
                b ^= buffer[i + 1];
                c ^= buffer[i + 2];
                d ^= buffer[i + 3];
            }
#pragma omp critical
            total ^= a ^ b ^ c ^ d;
        }
        double seconds = now() - started;
        if (seconds < best)
            best = seconds;
        for (int k = 0; k < 8; k++)
            checksum ^= total[k];
    }
    printf("{\"mib\": %zu, \"threads\": %d, \"passes\": %d, \"best_s\": %.6f, \"gb_per_s\": %.3f, "
           "\"checksum\": %llu}\n",
           bytes >> 20, threads, passes, best, bytes / best / 1e9, (unsigned long long)checksum);
    free(buffer);
    return 0;
}
