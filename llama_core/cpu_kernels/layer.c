/* The small operations of a decoding layer, each one call instead of several torch kernels: RMSNorm, SiLU
 * gating, and a decoding token's attention (rotary embedding, KV-cache write and attention over its own
 * cache row). Float32, built with linear.c (build.py). Each row's result is computed the same way whatever
 * else is in the batch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ENOUGH_FOR_THREADS (1 << 16) /* elements; below this one thread is faster than waking others */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Sums of products in 16 lanes (the compiler does not reorder a float sum by itself), the same order for
 * every row. */
static inline float dot(const float *a, const float *b, int64_t n) {
  v16 lanes = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes += *(const v16 *)(a + i) * *(const v16 *)(b + i);
  float sum = 0;
  for (int k = 0; k < 16; k++) sum += lanes[k];
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= ENOUGH_FOR_THREADS)
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * dim;
    float *normed = out + r * dim, squares = 0;
    for (int64_t k = 0; k < dim; k++) squares += row[k] * row[k];
    float scale = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t k = 0; k < dim; k++) normed[k] = row[k] * scale * weight[k];
  }
}

/* gate_up [rows][2 * hidden] (gate, then up) -> out [rows][hidden] = silu(gate) * up */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t hidden, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * hidden >= ENOUGH_FOR_THREADS)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * 2 * hidden, *up = gate + hidden;
    float *o = out + r * hidden;
    for (int64_t k = 0; k < hidden; k++) o[k] = gate[k] / (1.0f + expf(-gate[k])) * up[k];
  }
}

/* Consecutive pairs (x[2i], x[2i+1]) rotated by angle i: rotation holds [cos, sin] for each i. */
static void rotate(const float *x, const float *rotation, float *out, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim / 2; i++) {
    float even = x[2 * i], odd = x[2 * i + 1], c = rotation[2 * i], s = rotation[2 * i + 1];
    out[2 * i] = even * c - odd * s;
    out[2 * i + 1] = odd * c + even * s;
  }
}

/* New tokens, each with its own cache row and position (a decoding row's one token, or a prompt's tokens
 * each with its row): qkv [count][qkv_stride] holds a token's query heads, key heads and value heads side by
 * side; rotation [count][head_dim / 2][2]. Every token's rotated key and its value go to position
 * positions[i] of cache row rows[i] (caches [slots][kv_heads][max_seq_len][head_dim]) before any attends;
 * then each query head attends over positions 0..positions[i] of that row (its kv head: h / (heads /
 * kv_heads)), scaled by 1/sqrt(head_dim). out [count][heads * head_dim]. Returns -1, writing nothing, if a
 * row or position is outside the cache, -2 without memory. */
int attend_new_tokens(const float *qkv, int64_t qkv_stride, const float *rotation, float *k_cache, float *v_cache,
                  const int64_t *rows, const int64_t *positions, int64_t batch, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t slots, int64_t max_seq_len, float *out, int threads) {
  for (int64_t b = 0; b < batch; b++)
    if (rows[b] < 0 || rows[b] >= slots || positions[b] < 0 || positions[b] >= max_seq_len) return -1;
  float *queries = malloc((size_t)(batch * heads * head_dim) * sizeof(float));
  if (queries == NULL) return -2;
  for (int64_t b = 0; b < batch; b++) {
    const float *source = qkv + b * qkv_stride, *angles = rotation + b * head_dim;
    for (int64_t h = 0; h < heads; h++) rotate(source + h * head_dim, angles, queries + (b * heads + h) * head_dim, head_dim);
    for (int64_t g = 0; g < kv_heads; g++) {
      int64_t at = ((rows[b] * kv_heads + g) * max_seq_len + positions[b]) * head_dim;
      rotate(source + (heads + g) * head_dim, angles, k_cache + at, head_dim);
      memcpy(v_cache + at, source + (heads + kv_heads + g) * head_dim, (size_t)head_dim * sizeof(float));
    }
  }
  int64_t group = heads / kv_heads, longest = 0;
  for (int64_t b = 0; b < batch; b++) longest = positions[b] + 1 > longest ? positions[b] + 1 : longest;
  float scale = 1.0f / sqrtf((float)head_dim);
  int failed = 0;
  /* One task per (row, kv head): its `group` query heads read each cached key and value once together. */
#pragma omp parallel num_threads(threads) if (batch * heads * longest * head_dim >= ENOUGH_FOR_THREADS)
  {
    float *scores = malloc((size_t)(group * longest) * sizeof(float));
    if (scores == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
      if (scores == NULL) continue;
      int64_t b = task / kv_heads, g = task % kv_heads, length = positions[b] + 1;
      int64_t base = (rows[b] * kv_heads + g) * max_seq_len * head_dim;
      const float *keys = k_cache + base, *values = v_cache + base;
      const float *q = queries + (b * heads + g * group) * head_dim;
      for (int64_t t = 0; t < length; t++)
        for (int64_t j = 0; j < group; j++) scores[j * length + t] = dot(q + j * head_dim, keys + t * head_dim, head_dim) * scale;
      for (int64_t j = 0; j < group; j++) {
        float *row_scores = scores + j * length, largest = -INFINITY, total = 0;
        for (int64_t t = 0; t < length; t++) largest = fmaxf(largest, row_scores[t]);
        for (int64_t t = 0; t < length; t++) {
          row_scores[t] = expf(row_scores[t] - largest);
          total += row_scores[t];
        }
        for (int64_t t = 0; t < length; t++) row_scores[t] /= total;
      }
      float *o = out + (b * heads + g * group) * head_dim;
      memset(o, 0, (size_t)(group * head_dim) * sizeof(float));
      for (int64_t t = 0; t < length; t++)
        for (int64_t j = 0; j < group; j++) {
          float weight = scores[j * length + t];
          for (int64_t d = 0; d < head_dim; d++) o[j * head_dim + d] += weight * values[t * head_dim + d];
        }
    }
    free(scores);
  }
  free(queries);
  return failed ? -2 : 0;
}
