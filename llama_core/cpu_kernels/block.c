/* A whole transformer block in one call, for float32 weights in panels (linear.c) and tokens whose attention
 * layer.c computes: h = x + wo(attention(wqkv(rms(x)))), then x' = h + w2(silu(w13(rms(h)))). The same
 * kernels, in the same order, as the block's modules calling them one by one, so the same values; what it
 * saves is the dozen trips through Python between them, which on a small model cost more than the
 * arithmetic. */
#include <stdint.h>
#include <stdlib.h>

void panel_linear(int kind, const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K, int threads);
int panel_linear_i8(const float *x, const int8_t *w, const float *scales, const int32_t *weight_sums, float *y,
                    int64_t M, int64_t N, int64_t K, int threads);
int panel_linear_i4(const float *x, const uint8_t *w, const float *scales, float *y, int64_t M, int64_t N, int64_t K,
                    int threads);
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps, int threads);
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t hidden, int threads);
int attend_new_tokens(const float *qkv, int64_t qkv_stride, const float *rotation, int cache_kind, void *k_cache,
                      void *v_cache, const int64_t *rows, const int64_t *positions, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t slots, int64_t max_seq_len, float *out, int threads);

static void add_to(float *x, const float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

static int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

enum { INT8 = 3, INT4 = 4 };  /* the quantized kinds, after linear.c's float ones (0 float32, 1 bfloat16, 2 float16) */

/* Projection p (0 wqkv, 1 wo, 2 w13, 3 w2) of x [M][K] into y [M][N]; 0, or -1 where an int8 or int4 product
 * found no memory for its rounded activations. */
static int project(int kind, const void *const *weights, const float *const *scales, const int32_t *const *sums, int p,
                   const float *x, float *y, int64_t M, int64_t N, int64_t K, int threads) {
  if (kind == INT8) return panel_linear_i8(x, weights[p], scales[p], sums[p], y, M, N, K, threads);
  if (kind == INT4) return panel_linear_i4(x, weights[p], scales[p], y, M, N, K, threads);
  panel_linear(kind, x, weights[p], y, M, N, K, threads);
  return 0;
}

/* x [count][dim] (count tokens, each with its cache row and position, as attend_new_tokens takes them) becomes
 * the block's output in place. weights are the panels of wqkv [heads + 2 kv_heads heads], wo, w13 [2 * hidden]
 * (gate, then up) and w2, all of one kind: linear.c's panel_linear (0 float32, 1 bfloat16, 2 float16), INT8
 * (with each projection's scales and row sums) or INT4 (with its scales); the KV cache is of cache_kind (the
 * float kinds). Returns attend_new_tokens' status (-1: a row or position outside the cache, nothing written;
 * -2: no memory), 0 when done. */
int decoder_block(float *x, int64_t count, int64_t dim, float eps, const float *attention_norm, int kind,
                  const void *const *weights, const float *const *scales, const int32_t *const *sums,
                  const float *ffn_norm, int64_t hidden,
                  const float *rotation, int cache_kind, void *k_cache, void *v_cache, const int64_t *rows,
                  const int64_t *positions,
                  int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t slots, int64_t max_seq_len, int threads) {
  int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, attended_width = heads * head_dim;
  float *normed = malloc((size_t)(count * dim) * sizeof(float));
  float *wide = malloc((size_t)(count * larger(qkv_width, 2 * hidden)) * sizeof(float));
  float *narrow = malloc((size_t)(count * larger(attended_width, hidden)) * sizeof(float));
  int status = -2;
  if (normed != NULL && wide != NULL && narrow != NULL) {
    rms_norm(x, attention_norm, normed, count, dim, eps, threads);
    if (project(kind, weights, scales, sums, 0, normed, wide, count, qkv_width, dim, threads)) goto done;
    status = attend_new_tokens(wide, qkv_width, rotation, cache_kind, k_cache, v_cache, rows, positions, count, heads,
                               kv_heads, head_dim, slots, max_seq_len, narrow, threads);
    if (status == 0) {
      status = -2;
      if (project(kind, weights, scales, sums, 1, narrow, normed, count, dim, attended_width, threads)) goto done;
      add_to(x, normed, count * dim);
      rms_norm(x, ffn_norm, normed, count, dim, eps, threads);
      if (project(kind, weights, scales, sums, 2, normed, wide, count, 2 * hidden, dim, threads)) goto done;
      silu_mul(wide, narrow, count, hidden, threads);
      if (project(kind, weights, scales, sums, 3, narrow, normed, count, dim, hidden, threads)) goto done;
      add_to(x, normed, count * dim);
      status = 0;
    }
  }
done:
  free(normed);
  free(wide);
  free(narrow);
  return status;
}
