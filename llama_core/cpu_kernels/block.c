/* A whole transformer block in one call, for float32 weights in panels (linear.c) and tokens whose attention
 * layer.c computes: h = x + wo(attention(wqkv(rms(x)))), then x' = h + w2(silu(w13(rms(h)))). The same
 * kernels, in the same order, as the block's modules calling them one by one, so the same values; what it
 * saves is the dozen trips through Python between them, which on a small model cost more than the
 * arithmetic. */
#include <stdint.h>
#include <stdlib.h>

void panel_linear(int kind, const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K, int threads);
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps, int threads);
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t hidden, int threads);
int attend_new_tokens(const float *qkv, int64_t qkv_stride, const float *rotation, int cache_kind, void *k_cache,
                      void *v_cache, const int64_t *rows, const int64_t *positions, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t slots, int64_t max_seq_len, float *out, int threads);

static void add_to(float *x, const float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

static int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

/* x [count][dim] (count tokens, each with its cache row and position, as attend_new_tokens takes them) becomes
 * the block's output in place. wqkv [heads + 2 kv_heads heads], wo, w13 [2 * hidden] (gate, then up) and w2
 * are panels, all of one kind (linear.c's panel_linear: 0 float32, 1 bfloat16, 2 float16); the KV cache is
 * of cache_kind (the same kinds). Returns
 * attend_new_tokens' status (-1: a row or position outside the cache, nothing written;
 * -2: no memory), 0 when done. */
int decoder_block(float *x, int64_t count, int64_t dim, float eps, const float *attention_norm, int kind, const void *wqkv,
                  const void *wo, const float *ffn_norm, const void *w13, const void *w2, int64_t hidden,
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
    panel_linear(kind, normed, wqkv, wide, count, qkv_width, dim, threads);
    status = attend_new_tokens(wide, qkv_width, rotation, cache_kind, k_cache, v_cache, rows, positions, count, heads,
                               kv_heads,
                               head_dim, slots, max_seq_len, narrow, threads);
    if (status == 0) {
      panel_linear(kind, narrow, wo, normed, count, dim, attended_width, threads);
      add_to(x, normed, count * dim);
      rms_norm(x, ffn_norm, normed, count, dim, eps, threads);
      panel_linear(kind, normed, w13, wide, count, 2 * hidden, dim, threads);
      silu_mul(wide, narrow, count, hidden, threads);
      panel_linear(kind, narrow, w2, normed, count, dim, hidden, threads);
      add_to(x, normed, count * dim);
    }
  }
  free(normed);
  free(wide);
  free(narrow);
  return status;
}
