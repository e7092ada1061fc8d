/* The target's vectors (vf: LANES floats; v16: 16 lanes in the same order on every target), and 16-bit floats to
 * and from float32, shared by linear.c (16-bit panels) and layer.c (16-bit KV caches). Narrowing rounds to
 * nearest, ties to even, as torch's .to(torch.float16 / torch.bfloat16) does, so a cache written here holds what
 * torch would have written; widening is exact. */
#ifndef LLAMA_CORE_WIDEN_H
#define LLAMA_CORE_WIDEN_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The target's own vectors, LANES floats each: 16 with AVX-512, 8 with AVX, 4 elsewhere. Code written in a wider
 * vector type than the target's has its vectors kept in memory by GCC, many times slower. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4), aligned(4)));

/* 16 float32 lanes as 16 / LANES of the target's vectors: sums kept in 16 lanes add in the same order, to
 * the same values, on every target. */
#define V16_PARTS (16 / LANES)
typedef struct {
  vf part[V16_PARTS];
} v16;

static inline __attribute__((always_inline)) v16 v16_zero(void) {
  v16 r;
  for (int p = 0; p < V16_PARTS; p++) r.part[p] = (vf){0};
  return r;
}

static inline __attribute__((always_inline)) v16 v16_load(const float *x) {
  v16 r;
  for (int p = 0; p < V16_PARTS; p++) r.part[p] = *(const vf *)(x + p * LANES);
  return r;
}

static inline __attribute__((always_inline)) void v16_store(float *x, v16 a) {
  for (int p = 0; p < V16_PARTS; p++) memcpy(x + p * LANES, &a.part[p], sizeof(vf));
}

static inline __attribute__((always_inline)) v16 v16_add(v16 a, v16 b) {
  for (int p = 0; p < V16_PARTS; p++) a.part[p] += b.part[p];
  return a;
}

/* acc + a * b, lane by lane. */
static inline __attribute__((always_inline)) v16 v16_fma(v16 acc, v16 a, v16 b) {
  for (int p = 0; p < V16_PARTS; p++) acc.part[p] += a.part[p] * b.part[p];
  return acc;
}

/* acc + s * b, lane by lane. */
static inline __attribute__((always_inline)) v16 v16_fma_scalar(v16 acc, float s, v16 b) {
  for (int p = 0; p < V16_PARTS; p++) acc.part[p] += b.part[p] * s;
  return acc;
}

/* The 16 lanes' sum by halving (lanes i and i + 8, then i and i + 4, then the four in two pairs), the same
 * order on every target: a few vector adds where a lane-by-lane sum takes 15 dependent ones. */
static inline __attribute__((always_inline)) float v16_sum(v16 a) {
#if LANES >= 8
#if LANES == 16
  __m512 all = (__m512)a.part[0];
  __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(all),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1)));
#else
  __m256 eight = _mm256_add_ps((__m256)a.part[0], (__m256)a.part[1]);
#endif
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  __m128 pairs = _mm_add_ps(four, _mm_movehl_ps(four, four)); /* lanes 0 + 2 and 1 + 3 */
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
#else
  vf low = a.part[0] + a.part[2], high = a.part[1] + a.part[3]; /* lanes i and i + 8 */
  float four[4];
  for (int i = 0; i < 4; i++) four[i] = low[i] + high[i];
  return (four[0] + four[2]) + (four[1] + four[3]);
#endif
}

/* What a void pointer to weights or cached keys holds: panels.PANEL_KINDS and layer_ops.CACHE_KINDS. */
enum { KIND_FLOAT32 = 0, KIND_BFLOAT16 = 1, KIND_FLOAT16 = 2 };

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13); /* inf, nan */
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: normalise */
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      exponent--;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* float32 to float16, nearest even, overflow to infinity, as F16C's vcvtps2ph (what torch uses here): a NaN keeps
 * its sign and the top of its payload, made quiet. In C, scaling by powers of two lets the FPU do the rounding
 * (FP16's fp16_ieee_from_fp32_value). */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__) || defined(__AVX512F__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  float scaled = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t w, bits;
  memcpy(&w, &f, sizeof w);
  if (f != f) return (uint16_t)(((w >> 16) & 0x8000u) | 0x7e00u | ((w >> 13) & 0x3ffu));
  uint32_t shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  bias = (bias >> 1) + 0x07800000u;
  float bias_f;
  memcpy(&bias_f, &bias, sizeof bias_f);
  scaled = bias_f + scaled;
  memcpy(&bits, &scaled, sizeof bits);
  uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
#endif
}

/* float32 to bfloat16, nearest even; NaN becomes the quiet NaN 0x7fc0 (c10::BFloat16's rounding). */
static inline uint16_t float_to_bfloat16(float f) {
  if (f != f) return 0x7fc0;
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

/* LANES consecutive float16 values, widened. */
static inline __attribute__((always_inline)) vf load_f16_lanes(const uint16_t *p) {
  vf out;
#if LANES == 16
  __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
  memcpy(&out, &wide, sizeof out);
#elif LANES == 8 && defined(__F16C__)
  __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
  memcpy(&out, &wide, sizeof out);
#else
  for (int i = 0; i < LANES; i++) out[i] = half_to_float(p[i]);
#endif
  return out;
}

/* LANES consecutive bfloat16 values, widened: each is float32's upper half. */
static inline __attribute__((always_inline)) vf load_bf16_lanes(const uint16_t *p) {
  vu lanes;
#if LANES == 16
  __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
  memcpy(&lanes, &wide, sizeof lanes);
#elif LANES == 8 && defined(__AVX2__)
  __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
  memcpy(&lanes, &wide, sizeof lanes);
#else
  for (int i = 0; i < LANES; i++) lanes[i] = (uint32_t)p[i] << 16;
#endif
  return (vf)lanes;
}

/* 16 consecutive values of a buffer of `kind`, from element `at`, as float32. */
static inline __attribute__((always_inline)) v16 load_kind(int kind, const void *base, int64_t at) {
  v16 out;
  for (int p = 0; p < V16_PARTS; p++) {
    if (kind == KIND_BFLOAT16)
      out.part[p] = load_bf16_lanes((const uint16_t *)base + at + p * LANES);
    else if (kind == KIND_FLOAT16)
      out.part[p] = load_f16_lanes((const uint16_t *)base + at + p * LANES);
    else
      out.part[p] = *(const vf *)((const float *)base + at + p * LANES);
  }
  return out;
}

/* One value of a buffer of `kind`, as float32. */
static inline float value_of_kind(int kind, const void *base, int64_t at) {
  if (kind == KIND_BFLOAT16) {
    uint32_t bits = (uint32_t)((const uint16_t *)base)[at] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  if (kind == KIND_FLOAT16) return half_to_float(((const uint16_t *)base)[at]);
  return ((const float *)base)[at];
}

/* Writes x[0..n) into a buffer of `kind` from element `at`, rounded to its precision. */
static inline void store_kind(int kind, void *base, int64_t at, const float *x, int64_t n) {
  if (kind == KIND_BFLOAT16) {
    for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[at + i] = float_to_bfloat16(x[i]);
  } else if (kind == KIND_FLOAT16) {
    for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[at + i] = float_to_half(x[i]);
  } else {
    memcpy((float *)base + at, x, (size_t)n * sizeof(float));
  }
}

#endif
