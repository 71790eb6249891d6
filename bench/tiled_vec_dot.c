// The one-row K-quant kernels of patches/llama.cpp/0005 (tiled_vec_dot_*, which add as llama.cpp's
// tiled kernels do) against ggml's own vec_dot, per type, one thread, on one row of activations:
// in cache (512 rows of 3072) and from memory (16384 rows). Both get the same integer sums, so
// their results differ by rounding only (printed). Built and run by bench/tiled_vec_dot.py.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"
typedef void (*vd_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void quantize_row_q8_K(const float *, void *, int64_t);
#define DECL(t) void ggml_vec_dot_##t##_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int); \
                void tiled_vec_dot_##t##_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int) __asm__("_Z23tiled_vec_dot_" #t "_q8_KiPfmPKvmS1_mi");
DECL(q2_K) DECL(q3_K) DECL(q4_K) DECL(q5_K) DECL(q6_K)
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
int main(int argc, char ** argv) {
    const int K = 3072; const int rows = argc > 1 ? atoi(argv[1]) : 4096; const int reps = argc > 2 ? atoi(argv[2]) : 20;
    struct { const char * name; enum ggml_type t; vd_t up, ti; } types[] = {
        {"q2_K", GGML_TYPE_Q2_K, ggml_vec_dot_q2_K_q8_K, tiled_vec_dot_q2_K_q8_K},
        {"q3_K", GGML_TYPE_Q3_K, ggml_vec_dot_q3_K_q8_K, tiled_vec_dot_q3_K_q8_K},
        {"q4_K", GGML_TYPE_Q4_K, ggml_vec_dot_q4_K_q8_K, tiled_vec_dot_q4_K_q8_K},
        {"q5_K", GGML_TYPE_Q5_K, ggml_vec_dot_q5_K_q8_K, tiled_vec_dot_q5_K_q8_K},
        {"q6_K", GGML_TYPE_Q6_K, ggml_vec_dot_q6_K_q8_K, tiled_vec_dot_q6_K_q8_K}};
    ggml_cpu_init();
    float * x = malloc(sizeof(float) * K); float * w = malloc(sizeof(float) * (size_t) K * rows);
    srand(1); for (int i = 0; i < K; i++) x[i] = (float) rand() / RAND_MAX - 0.5f;
    for (size_t i = 0; i < (size_t) K * rows; i++) w[i] = (float) rand() / RAND_MAX - 0.5f;
    void * q8 = malloc(ggml_row_size(GGML_TYPE_Q8_K, K)); quantize_row_q8_K(x, q8, K);
    float * out_up = malloc(sizeof(float) * rows), * out_ti = malloc(sizeof(float) * rows);
    for (int k = 0; k < 5; k++) {
        ggml_quantize_init(types[k].t);
        const size_t rs = ggml_row_size(types[k].t, K);
        // a copy of the weights each, and the kernels take turns going first, so that neither
        // finds in cache what the other just read
        char * wq_up = malloc(rs * rows), * wq_ti = malloc(rs * rows);
        ggml_quantize_chunk(types[k].t, w, wq_up, 0, rows, K, NULL);
        memcpy(wq_ti, wq_up, rs * rows);
        double best_up = 1e9, best_ti = 1e9;
        for (int r = 0; r < reps; r++) {
            for (int turn = 0; turn < 2; turn++) {
                const int up = (turn + r) % 2 == 0;
                double t0 = now();
                for (int i = 0; i < rows; i++) {
                    if (up) types[k].up(K, &out_up[i], 0, wq_up + i * rs, 0, q8, 0, 1);
                    else    types[k].ti(K, &out_ti[i], 0, wq_ti + i * rs, 0, q8, 0, 1);
                }
                double t = now() - t0;
                if (up && t < best_up) best_up = t;
                if (!up && t < best_ti) best_ti = t;
            }
        }
        double md = 0, mx = 0; for (int i = 0; i < rows; i++) { md = fmax(md, fabs(out_up[i] - out_ti[i])); mx = fmax(mx, fabs(out_up[i])); }
        printf("%s: %d rows x %d (%.1f MB): ggml vec_dot %.1f ns/row, tiled order %.1f ns/row (%.3fx), max |diff| / max |dot| %.1e\n",
               types[k].name, rows, K, rs * rows / 1e6, best_up * 1e9 / rows, best_ti * 1e9 / rows, best_up / best_ti, md / mx);
        free(wq_up); free(wq_ti);
    }
    return 0;
}
