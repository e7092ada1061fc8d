/* The small operations of a decoding layer, each one call instead of several torch kernels: RMSNorm, SiLU
 * gating, and a decoding token's attention (rotary embedding, KV-cache write and attention over its own
 * cache row, which may hold 16-bit floats). Float32, built with linear.c (build.py). Each row's result is
 * computed the same way whatever else is in the batch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "widen.h"

#define ENOUGH_FOR_THREADS (1 << 16) /* elements; below this one thread is faster than waking others */

/* The largest of x[0..n), 16 lanes at a time. */
static inline float max_of(const float *x, int64_t n) {
  float lanes[16], largest = -INFINITY;
  int64_t t = 0;
  for (int k = 0; k < 16; k++) lanes[k] = -INFINITY;
  for (; t + 16 <= n; t += 16)
    for (int k = 0; k < 16; k++) lanes[k] = x[t + k] > lanes[k] ? x[t + k] : lanes[k];
  for (int k = 0; k < 16; k++) largest = lanes[k] > largest ? lanes[k] : largest;
  for (; t < n; t++) largest = x[t] > largest ? x[t] : largest;
  return largest;
}

/* The sum of x[0..n) in 16 lanes, the same order for every row. */
static inline float sum_of(const float *x, int64_t n) {
  v16 lanes = v16_zero();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) lanes = v16_add(lanes, v16_load(x + t));
  float sum = v16_sum(lanes);
  for (; t < n; t++) sum += x[t];
  return sum;
}

/* torch.argmax of each row of x [rows][n] into out [rows]: the index of the largest value, the first where
 * several are equal, and the first NaN where there is one (torch counts NaN as the largest). Two passes in
 * vectors (AVX-512's 16 lanes or AVX2's 8), one for the largest value and one for where it first is; torch's
 * argmax reads a row an element at a time, ~2 ns each (8 rows of a 32000-token vocabulary: 0.44 ms). */
static int64_t argmax_of(const float *row, int64_t n) {
  float largest = -INFINITY;
  int any_nan = 0;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 v = _mm512_loadu_ps(row + t);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lanes = _mm512_max_ps(lanes, v);
  }
  largest = _mm512_reduce_max_ps(lanes);
  any_nan = nans != 0;
#elif defined(__AVX2__)
  __m256 lanes = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    __m256 v = _mm256_loadu_ps(row + t);
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    lanes = _mm256_max_ps(lanes, v);
  }
  float eight[8];
  _mm256_storeu_ps(eight, lanes);
  for (int k = 0; k < 8; k++) largest = eight[k] > largest ? eight[k] : largest;
  any_nan = _mm256_movemask_ps(nans) != 0;
#endif
  for (; t < n; t++) {
    largest = row[t] > largest ? row[t] : largest;
    any_nan |= row[t] != row[t];
  }
  t = 0;
#if defined(__AVX512F__)
  __m512 target = _mm512_set1_ps(largest);
  for (; t + 16 <= n; t += 16) {
    __m512 v = _mm512_loadu_ps(row + t);
    __mmask16 hits = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hits) return t + __builtin_ctz(hits);
  }
#elif defined(__AVX2__)
  __m256 target = _mm256_set1_ps(largest);
  for (; t + 8 <= n; t += 8) {
    __m256 v = _mm256_loadu_ps(row + t);
    int hits = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits) return t + __builtin_ctz((unsigned)hits);
  }
#endif
  for (; t < n; t++)
    if (any_nan ? row[t] != row[t] : row[t] == largest) return t;
  return 0;
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
  for (int64_t r = 0; r < rows; r++) out[r] = argmax_of(x + r * n, n);
}

/* Sums of products in 16 lanes (the compiler does not reorder a float sum by itself), the same order for
 * every row. */
static inline float dot(const float *a, const float *b, int64_t n) {
  v16 lanes = v16_zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes = v16_fma(lanes, v16_load(a + i), v16_load(b + i));
  float sum = v16_sum(lanes);
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= ENOUGH_FOR_THREADS)
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * dim;
    float *normed = out + r * dim, squares = dot(row, row, dim);
    float scale = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t k = 0; k < dim; k++) normed[k] = row[k] * scale * weight[k];
  }
}

typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4)));

/* a where mask (all ones), else b. */
static inline __attribute__((always_inline)) vf select_lanes(vi mask, vf a, vf b) {
  return (vf)((mask & (vi)a) | (~mask & (vi)b));
}

/* e^x of LANES values, each within 1.1 ulp of the exact value for every float x in [-87, 88], clamped outside
 * it (x = n ln 2 + r; e^r from Cephes' expf polynomial, 2^n from exponent bits). Written in vectors: GCC
 * vectorizes such a scalar function's loops only with AVX-512 (whose masks if-convert the clamps), and libm's
 * expf not at all (SiLU over a prompt's activations took 7x as long with expf as all else in the call). */
static inline __attribute__((always_inline)) vf exp_lanes(vf x) {
  const vf lowest = (vf){0} - 87.0f, highest = (vf){0} + 88.0f;
  x = select_lanes(x < lowest, lowest, x);
  x = select_lanes(x > highest, highest, x);
  vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2), |x / ln 2| < 2^22 */
  vf r = x - n * 0.693359375f;                                       /* ln 2 in two parts, the first exact */
  r = r - n * -2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n, n in [-126, 127]: a normal float */
  return p * (vf)bits;
}

/* e^x of one value, as exp_lanes gives it. */
static inline float exp_approx(float x) { return exp_lanes((vf){0} + x)[0]; }

/* x[t] = e^(x[t] - shift) for t in [0, n). */
static inline void exp_shifted(float *x, int64_t n, float shift) {
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    vf e = exp_lanes(*(const vf *)(x + t) - shift);
    memcpy(x + t, &e, sizeof e);
  }
  for (; t < n; t++) x[t] = exp_approx(x[t] - shift);
}

/* gate_up [rows][2 * hidden] (gate, then up) -> out [rows][hidden] = silu(gate) * up */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t hidden, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * hidden >= ENOUGH_FOR_THREADS)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * 2 * hidden, *up = gate + hidden;
    float *o = out + r * hidden;
    int64_t k = 0;
    for (; k + LANES <= hidden; k += LANES) {
      vf g = *(const vf *)(gate + k), result = g / (1.0f + exp_lanes(-g)) * *(const vf *)(up + k);
      memcpy(o + k, &result, sizeof result);
    }
    for (; k < hidden; k++) o[k] = gate[k] / (1.0f + exp_approx(-gate[k])) * up[k];
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

/* q . the key of `kind` at element `at` of keys, n a multiple of 16, summed in dot()'s order (so float32 keys
 * give dot()'s value). */
static inline __attribute__((always_inline)) float dot_cached(int kind, const float *q, const void *keys, int64_t at,
                                                              int64_t n) {
  v16 lanes = v16_zero();
  for (int64_t i = 0; i < n; i += 16) lanes = v16_fma(lanes, v16_load(q + i), load_kind(kind, keys, at + i));
  return v16_sum(lanes);
}

#define VALUE_BLOCK 32 /* positions whose values stay in L1 while each query head of a group takes them */

/* out[j] = sum over t of weights[j][t] * value t, for the `group` query heads j of one kv head: values of `kind`
 * [length][head_dim] from element `base` of v_cache, read once, in order, a block of positions at a time. The
 * head_dim / 16 sums of a head stay in registers over a block (head_dim a multiple of 16, at most 128). */
static inline __attribute__((always_inline)) void weigh_values(int kind, const void *v_cache, int64_t base,
                                                               int64_t length, int64_t group, int64_t head_dim,
                                                               const float *weights, float *out) {
  int64_t chunks = head_dim / 16;
  memset(out, 0, (size_t)(group * head_dim) * sizeof(float));
  for (int64_t t0 = 0; t0 < length; t0 += VALUE_BLOCK) {
    int64_t t1 = t0 + VALUE_BLOCK < length ? t0 + VALUE_BLOCK : length;
    for (int64_t j = 0; j < group; j++) {
      const float *w = weights + j * length;
      v16 sums[8];
      for (int64_t c = 0; c < chunks; c++) sums[c] = v16_load(out + j * head_dim + 16 * c);
      for (int64_t t = t0; t < t1; t++)
        for (int64_t c = 0; c < chunks; c++)
          sums[c] = v16_fma_scalar(sums[c], w[t], load_kind(kind, v_cache, base + t * head_dim + 16 * c));
      for (int64_t c = 0; c < chunks; c++) v16_store(out + j * head_dim + 16 * c, sums[c]);
    }
  }
}

/* A cached row of `kind` as float32: the cache itself for float32, else widened into scratch. */
static inline const float *row_as_float(int kind, const void *cache, int64_t at, int64_t n, float *scratch) {
  if (kind == KIND_FLOAT32) return (const float *)cache + at;
  for (int64_t i = 0; i < n; i++) scratch[i] = value_of_kind(kind, cache, at + i);
  return scratch;
}

/* weigh_values for any head_dim: each value row as float32, then the same float32 sums whatever the kind. */
static void weigh_values_any_width(int kind, const void *v_cache, int64_t base, int64_t length, int64_t group,
                                   int64_t head_dim, const float *weights, float *out, float *scratch) {
  memset(out, 0, (size_t)(group * head_dim) * sizeof(float));
  for (int64_t t = 0; t < length; t++) {
    const float *value = row_as_float(kind, v_cache, base + t * head_dim, head_dim, scratch);
    for (int64_t j = 0; j < group; j++)
      for (int64_t d = 0; d < head_dim; d++) out[j * head_dim + d] += weights[j * length + t] * value[d];
  }
}

/* The `group` query heads q [group][head_dim] of one kv head attend over positions 0..length-1 of its keys and
 * values (of `kind`, from element `base`); out [group][head_dim]; scores [group * length] and scratch
 * [head_dim] are scratch. */
static inline __attribute__((always_inline)) void attend_kv_head(
    int kind, const float *q, const void *k_cache, const void *v_cache, int64_t base, int64_t length,
    int64_t group, int64_t head_dim, float scale, float *scores, float *scratch, float *out) {
  if (head_dim % 16 == 0) {
    for (int64_t t = 0; t < length; t++)
      for (int64_t j = 0; j < group; j++)
        scores[j * length + t] = dot_cached(kind, q + j * head_dim, k_cache, base + t * head_dim, head_dim) * scale;
  } else {
    for (int64_t t = 0; t < length; t++) {
      const float *key = row_as_float(kind, k_cache, base + t * head_dim, head_dim, scratch);
      for (int64_t j = 0; j < group; j++) scores[j * length + t] = dot(q + j * head_dim, key, head_dim) * scale;
    }
  }
  for (int64_t j = 0; j < group; j++) {
    float *row_scores = scores + j * length, largest = max_of(row_scores, length);
    exp_shifted(row_scores, length, largest);
    float total = sum_of(row_scores, length);
    for (int64_t t = 0; t < length; t++) row_scores[t] /= total;
  }
  if (head_dim == 64)
    weigh_values(kind, v_cache, base, length, group, 64, scores, out);
  else if (head_dim == 128)
    weigh_values(kind, v_cache, base, length, group, 128, scores, out);
  else if (head_dim % 16 == 0 && head_dim <= 128)
    weigh_values(kind, v_cache, base, length, group, head_dim, scores, out);
  else
    weigh_values_any_width(kind, v_cache, base, length, group, head_dim, scores, out, scratch);
}

/* New tokens, each with its own cache row and position (a decoding row's one token, or a prompt's tokens
 * each with its row): qkv [count][qkv_stride] holds a token's query heads, key heads and value heads side by
 * side; rotation [count][head_dim / 2][2]. Every token's rotated key and its value go to position
 * positions[i] of cache row rows[i] (caches [slots][kv_heads][max_seq_len][head_dim] of cache_kind: 0 float32,
 * 1 bfloat16, 2 float16, rounded to it) before any attends; then each query head attends over positions
 * 0..positions[i] of that row (its kv head: h / (heads / kv_heads)), scaled by 1/sqrt(head_dim). out
 * [count][heads * head_dim]. Returns -1, writing nothing, if a row or position is outside the cache, -2
 * without memory. */
int attend_new_tokens(const float *qkv, int64_t qkv_stride, const float *rotation, int cache_kind, void *k_cache,
                      void *v_cache, const int64_t *rows, const int64_t *positions, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t slots, int64_t max_seq_len, float *out, int threads) {
  for (int64_t b = 0; b < batch; b++)
    if (rows[b] < 0 || rows[b] >= slots || positions[b] < 0 || positions[b] >= max_seq_len) return -1;
  float *queries = malloc((size_t)((batch * heads + 1) * head_dim) * sizeof(float));
  if (queries == NULL) return -2;
  float *rotated_key = queries + batch * heads * head_dim;
  for (int64_t b = 0; b < batch; b++) {
    const float *source = qkv + b * qkv_stride, *angles = rotation + b * head_dim;
    for (int64_t h = 0; h < heads; h++) rotate(source + h * head_dim, angles, queries + (b * heads + h) * head_dim, head_dim);
    for (int64_t g = 0; g < kv_heads; g++) {
      int64_t at = ((rows[b] * kv_heads + g) * max_seq_len + positions[b]) * head_dim;
      rotate(source + (heads + g) * head_dim, angles, rotated_key, head_dim);
      store_kind(cache_kind, k_cache, at, rotated_key, head_dim);
      store_kind(cache_kind, v_cache, at, source + (heads + kv_heads + g) * head_dim, head_dim);
    }
  }
  int64_t group = heads / kv_heads, longest = 0;
  for (int64_t b = 0; b < batch; b++) longest = positions[b] + 1 > longest ? positions[b] + 1 : longest;
  float scale = 1.0f / sqrtf((float)head_dim);
  int failed = 0;
  /* One task per (row, kv head): its `group` query heads read each cached key and value once together. */
#pragma omp parallel num_threads(threads) if (batch * heads * longest * head_dim >= ENOUGH_FOR_THREADS)
  {
    float *scores = malloc((size_t)(group * longest + head_dim) * sizeof(float));
    if (scores == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
      if (scores == NULL) continue;
      int64_t b = task / kv_heads, g = task % kv_heads, length = positions[b] + 1;
      int64_t base = (rows[b] * kv_heads + g) * max_seq_len * head_dim;
      const float *q = queries + (b * heads + g * group) * head_dim;
      float *o = out + (b * heads + g * group) * head_dim, *scratch = scores + group * longest;
      /* one copy of the loop per kind, so none of them tests the kind inside it */
      if (cache_kind == KIND_BFLOAT16)
        attend_kv_head(KIND_BFLOAT16, q, k_cache, v_cache, base, length, group, head_dim, scale, scores, scratch, o);
      else if (cache_kind == KIND_FLOAT16)
        attend_kv_head(KIND_FLOAT16, q, k_cache, v_cache, base, length, group, head_dim, scale, scores, scratch, o);
      else
        attend_kv_head(KIND_FLOAT32, q, k_cache, v_cache, base, length, group, head_dim, scale, scores, scratch, o);
    }
    free(scores);
  }
  free(queries);
  return failed ? -2 : 0;
}
