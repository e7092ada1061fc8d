/* 16-bit floats to and from float32, shared by linear.c (16-bit panels) and layer.c (16-bit KV caches).
 * Narrowing rounds to nearest, ties to even, as torch's .to(torch.float16 / torch.bfloat16) does, so a cache
 * written here holds what torch would have written; widening is exact. */
#ifndef LLAMA_CORE_WIDEN_H
#define LLAMA_CORE_WIDEN_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

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

/* 16 consecutive float16 values, widened. */
static inline __attribute__((always_inline)) v16 load_f16(const uint16_t *p) {
  v16 out;
#if defined(__AVX512F__)
  __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
  memcpy(&out, &wide, sizeof out);
#elif defined(__F16C__)
  __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
  __m256 high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
  memcpy(&out, &low, sizeof low);
  memcpy((char *)&out + sizeof low, &high, sizeof high);
#else
  for (int i = 0; i < 16; i++) out[i] = half_to_float(p[i]);
#endif
  return out;
}

/* 16 consecutive bfloat16 values, widened: each is float32's upper half. */
static inline __attribute__((always_inline)) v16 load_bf16(const uint16_t *p) {
  uint16_t halves[16];
  memcpy(halves, p, sizeof halves);
  v16u lanes;
  for (int i = 0; i < 16; i++) lanes[i] = (uint32_t)halves[i] << 16;
  return (v16)lanes;
}

/* 16 consecutive values of a buffer of `kind`, from element `at`, as float32. */
static inline __attribute__((always_inline)) v16 load_kind(int kind, const void *base, int64_t at) {
  if (kind == KIND_BFLOAT16) return load_bf16((const uint16_t *)base + at);
  if (kind == KIND_FLOAT16) return load_f16((const uint16_t *)base + at);
  v16 out;
  memcpy(&out, (const float *)base + at, sizeof out);
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
