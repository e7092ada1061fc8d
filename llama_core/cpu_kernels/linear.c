/* y = x @ W.T on the CPU for float32 x [M, K] and a weight stored in panels: W's rows in groups of PANEL,
 * each group contiguous. float32 panels are [K][PANEL]; 16-bit ones (bfloat16 or float16, the dtypes Llama-2
 * checkpoints are stored in) have the same layout and are widened to float32 in registers, so their products
 * are bit for bit those of the float32 panels of the same values, reading half the bytes; int8 panels (one
 * float scale per row of W) are [K / 4][PANEL][4], the layout of VNNI's four-products-per-lane instruction.
 *
 * One panel is read as a single sequential stream and every row of x in a tile of up to TILE_ROWS rows is
 * multiplied with it while it is in registers, so the weight leaves memory once per TILE_ROWS rows: a few
 * rows cost about what one does. A single row (decoding one sequence) reads STREAMS panels side by side, to
 * keep more of memory's bandwidth busy, and runs at the memory's speed. Built by build.py with
 * -O3 -march=native -fopenmp; GCC's vector extensions map v16 to whatever vector registers the CPU has. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "widen.h"

#define PANEL 32
#define TILE_ROWS 8

static inline __attribute__((always_inline)) v16 load_f32(const float *p) { return *(const v16 *)p; }

/* A panel row's 32 weights as two float32 vectors: columns 0-15 and 16-31. bfloat16 is float32's upper half,
 * and bfloat16 panels interleave a row's two halves (columns j and 16 + j share 32-bit lane j: see panels.py),
 * so widening is one load, a shift and a mask. */
static inline __attribute__((always_inline)) void load_pair_f32(const float *p, v16 *low, v16 *high) {
  *low = load_f32(p);
  *high = load_f32(p + 16);
}

static inline __attribute__((always_inline)) void load_pair_bf16(const uint16_t *p, v16 *low, v16 *high) {
  v16u lanes = *(const v16u *)p;
  *low = (v16)(lanes << 16);
  *high = (v16)(lanes & 0xffff0000u);
}

static inline __attribute__((always_inline)) void load_pair_f16(const uint16_t *p, v16 *low, v16 *high) {
  *low = load_f16(p);
  *high = load_f16(p + 16);
}

/* Rows [0, rows) of x (row stride K) times one panel w [K][PANEL]; writes columns [n0, n0 + width) of y. */
#define DEFINE_TILE(NAME, WEIGHT_T, LOAD, SCALE)                                                       \
  static inline __attribute__((always_inline)) void NAME(                                              \
      const float *x, const WEIGHT_T *w, const float *scales, float *y, int64_t K, int64_t N,          \
      int64_t n0, int64_t width, int rows) {                                                           \
    v16 low[TILE_ROWS], high[TILE_ROWS];                                                               \
    for (int m = 0; m < rows; m++) low[m] = high[m] = (v16){0};                                        \
    for (int64_t k = 0; k < K; k++) {                                                                  \
      v16 w_low, w_high;                                                                               \
      LOAD(w + k * PANEL, &w_low, &w_high);                                                            \
      for (int m = 0; m < rows; m++) {                                                                 \
        float xv = x[m * K + k];                                                                       \
        low[m] += w_low * xv;                                                                          \
        high[m] += w_high * xv;                                                                        \
      }                                                                                                \
    }                                                                                                  \
    for (int m = 0; m < rows; m++) {                                                                   \
      float out[PANEL];                                                                                \
      SCALE                                                                                            \
      memcpy(out, &low[m], sizeof low[m]);                                                             \
      memcpy(out + 16, &high[m], sizeof high[m]);                                                      \
      memcpy(y + m * N + n0, out, width * sizeof(float));                                              \
    }                                                                                                  \
  }

DEFINE_TILE(tile_f32, float, load_pair_f32, )
DEFINE_TILE(tile_bf16, uint16_t, load_pair_bf16, )
DEFINE_TILE(tile_f16, uint16_t, load_pair_f16, )

/* Every tile of rows of x times one panel; the row count of the last tile is a constant in each case, so the
 * compiler unrolls its loops. */
#define TILES_OF_PANEL(TILE, panel)                                                                     \
  {                                                                                                    \
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL, m0 = 0;                           \
    for (; m0 + TILE_ROWS <= M; m0 += TILE_ROWS)                                                       \
      TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, TILE_ROWS);                         \
    switch (M - m0) {                                                                                  \
      case 1: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 1); break;                  \
      case 2: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 2); break;                  \
      case 3: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 3); break;                  \
      case 4: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 4); break;                  \
      case 5: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 5); break;                  \
      case 6: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 6); break;                  \
      case 7: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 7); break;                  \
      default: break;                                                                                  \
    }                                                                                                  \
  }

void panel_product_f32(const float *x, const float *w, const float *scales, float *y, int64_t M, int64_t N,
                       int64_t K, int threads) {
  int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p++) TILES_OF_PANEL(tile_f32, w + p * K * PANEL)
}

/* 16-bit panels: with more rows than four tiles, each thread widens a panel into float32 once and runs every
 * tile over that (prefill is arithmetic-bound, and widening per tile would cost a conversion per tile); the
 * same values in the same order, so the same sums. */
#define DEFINE_PRODUCT_16(NAME, TILE, LOAD)                                                             \
  void NAME(const float *x, const uint16_t *w, const float *scales, float *y, int64_t M, int64_t N,    \
            int64_t K, int threads) {                                                                  \
    int64_t panels = (N + PANEL - 1) / PANEL;                                                          \
    _Pragma("omp parallel num_threads(threads)") {                                                     \
      float *wide = M > 4 * TILE_ROWS ? aligned_alloc(64, (size_t)(K * PANEL) * sizeof(float)) : NULL; \
      _Pragma("omp for schedule(static)")                                                              \
      for (int64_t p = 0; p < panels; p++) {                                                           \
        const uint16_t *panel = w + p * K * PANEL;                                                     \
        if (wide == NULL) {                                                                            \
          TILES_OF_PANEL(TILE, panel)                                                                  \
        } else {                                                                                       \
          for (int64_t k = 0; k < K; k++) {                                                            \
            v16 low, high;                                                                             \
            LOAD(panel + k * PANEL, &low, &high);                                                      \
            *(v16 *)(wide + k * PANEL) = low;                                                          \
            *(v16 *)(wide + k * PANEL + 16) = high;                                                    \
          }                                                                                            \
          TILES_OF_PANEL(tile_f32, wide)                                                               \
        }                                                                                              \
      }                                                                                                \
      free(wide);                                                                                      \
    }                                                                                                  \
  }

DEFINE_PRODUCT_16(panel_product_bf16, tile_bf16, load_pair_bf16)
DEFINE_PRODUCT_16(panel_product_f16, tile_f16, load_pair_f16)

/* One row of x times `count` consecutive panels at once (count <= STREAMS): that many weight streams in flight
 * per thread. Decoding one sequence is this product, at the memory's speed; on a 2026 Intel Xeon one stream
 * at a time per core read 18 GB/s with 2 threads and four at a time 26. Each output sums over k in the same
 * order as tile_f32, so a row gets the same values alone as in a batch. */
#define STREAMS 4
#define DEFINE_ROW(NAME, WEIGHT_T, LOAD)                                                                \
  static inline __attribute__((always_inline)) void NAME(const float *x, const WEIGHT_T *w, float *y,  \
                                                         int64_t K, int64_t N, int64_t p0, int count) { \
    v16 low[STREAMS], high[STREAMS];                                                                   \
    for (int s = 0; s < count; s++) low[s] = high[s] = (v16){0};                                       \
    for (int64_t k = 0; k < K; k++) {                                                                  \
      float xv = x[k];                                                                                 \
      for (int s = 0; s < count; s++) {                                                                \
        v16 w_low, w_high;                                                                             \
        LOAD(w + ((p0 + s) * K + k) * PANEL, &w_low, &w_high);                                         \
        low[s] += w_low * xv;                                                                          \
        high[s] += w_high * xv;                                                                        \
      }                                                                                                \
    }                                                                                                  \
    for (int s = 0; s < count; s++) {                                                                  \
      float out[PANEL];                                                                                \
      int64_t n0 = (p0 + s) * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;                          \
      memcpy(out, &low[s], sizeof low[s]);                                                             \
      memcpy(out + 16, &high[s], sizeof high[s]);                                                      \
      memcpy(y + n0, out, width * sizeof(float));                                                      \
    }                                                                                                  \
  }

DEFINE_ROW(row_times_panels_f32, float, load_pair_f32)
DEFINE_ROW(row_times_panels_bf16, uint16_t, load_pair_bf16)
DEFINE_ROW(row_times_panels_f16, uint16_t, load_pair_f16)

/* Each thread an equal share of the panels (groups of STREAMS dealt out would leave a 9-panel product to
 * one thread of two), read STREAMS at a time. */
#if defined(_OPENMP)
#define TEAM_SHARE int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
#define TEAM_SHARE int64_t team = 1, me = 0;
#endif
#define DEFINE_LINEAR(NAME, WEIGHT_T, ROW, PRODUCT)                                                     \
  void NAME(const float *x, const WEIGHT_T *w, const float *scales, float *y, int64_t M, int64_t N,    \
            int64_t K, int threads) {                                                                  \
    if (M != 1) {                                                                                      \
      PRODUCT(x, w, scales, y, M, N, K, threads);                                                      \
      return;                                                                                          \
    }                                                                                                  \
    int64_t panels = (N + PANEL - 1) / PANEL;                                                          \
    if (threads > panels) threads = (int)panels;                                                       \
    if (threads < 1) threads = 1;                                                                      \
    _Pragma("omp parallel num_threads(threads)") {                                                     \
      TEAM_SHARE                                                                                       \
      int64_t p = panels * me / team, end = panels * (me + 1) / team;                                  \
      for (; p + STREAMS <= end; p += STREAMS) ROW(x, w, y, K, N, p, STREAMS);                         \
      switch (end - p) {                                                                               \
        case 3: ROW(x, w, y, K, N, p, 3); break;                                                       \
        case 2: ROW(x, w, y, K, N, p, 2); break;                                                       \
        case 1: ROW(x, w, y, K, N, p, 1); break;                                                       \
        default: break;                                                                                \
      }                                                                                                \
    }                                                                                                  \
  }

DEFINE_LINEAR(panel_linear_f32, float, row_times_panels_f32, panel_product_f32)
DEFINE_LINEAR(panel_linear_bf16, uint16_t, row_times_panels_bf16, panel_product_bf16)
DEFINE_LINEAR(panel_linear_f16, uint16_t, row_times_panels_f16, panel_product_f16)

/* The product for panels of a kind: 0 float32, 1 bfloat16, 2 float16 (block.c's projections). */
void panel_linear(int kind, const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
  if (kind == KIND_BFLOAT16)
    panel_linear_bf16(x, w, NULL, y, M, N, K, threads);
  else if (kind == KIND_FLOAT16)
    panel_linear_f16(x, w, NULL, y, M, N, K, threads);
  else
    panel_linear_f32(x, w, NULL, y, M, N, K, threads);
}

/* int8: each row of x is quantized on its own scale (its largest magnitude / 127, rounded to nearest even)
 * and offset by 128 to unsigned bytes; a lane then sums (x + 128) * w four at a time in int32, and the
 * 128 * sum(w) this adds is taken off with the row sums of W that the caller keeps (`weight_sums`). The
 * result for a row never depends on the other rows. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t K4, uint8_t *xq, float *x_scales) {
  for (int64_t m = 0; m < M; m++) {
    const float *row = x + m * K;
    float largest = 0;
    for (int64_t k = 0; k < K; k++) largest = fmaxf(largest, fabsf(row[k]));
    float scale = largest > 0 ? largest / 127.0f : 1.0f, inverse = 1.0f / scale;
    for (int64_t k = 0; k < K; k++) xq[m * K4 + k] = (uint8_t)((int)nearbyintf(row[k] * inverse) + 128);
    for (int64_t k = K; k < K4; k++) xq[m * K4 + k] = 128;
    x_scales[m] = scale;
  }
}

static inline __attribute__((always_inline)) void tile_i8(
    const uint8_t *xq, const float *x_scales, const int8_t *w, const float *scales, const int32_t *weight_sums,
    float *y, int64_t K4, int64_t N, int64_t n0, int64_t width, int rows) {
  int32_t sums[TILE_ROWS][PANEL];
#if defined(__AVX512VNNI__)
  __m512i low[TILE_ROWS], high[TILE_ROWS];
  for (int m = 0; m < rows; m++) low[m] = high[m] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4 / 4; g++) {
    __m512i w_low = _mm512_loadu_si512(w + g * 4 * PANEL), w_high = _mm512_loadu_si512(w + g * 4 * PANEL + 64);
    for (int m = 0; m < rows; m++) {
      int32_t four;
      memcpy(&four, xq + m * K4 + g * 4, 4);
      __m512i xs = _mm512_set1_epi32(four);
      low[m] = _mm512_dpbusd_epi32(low[m], xs, w_low);
      high[m] = _mm512_dpbusd_epi32(high[m], xs, w_high);
    }
  }
  for (int m = 0; m < rows; m++) {
    _mm512_storeu_si512(sums[m], low[m]);
    _mm512_storeu_si512(sums[m] + 16, high[m]);
  }
#else
  for (int m = 0; m < rows; m++) {
    for (int j = 0; j < PANEL; j++) sums[m][j] = 0;
    for (int64_t g = 0; g < K4 / 4; g++)
      for (int j = 0; j < PANEL; j++)
        for (int b = 0; b < 4; b++)
          sums[m][j] += (int32_t)xq[m * K4 + g * 4 + b] * (int32_t)w[(g * PANEL + j) * 4 + b];
  }
#endif
  for (int m = 0; m < rows; m++)
    for (int64_t j = 0; j < width; j++)
      y[m * N + n0 + j] = (float)(sums[m][j] - 128 * weight_sums[n0 + j]) * x_scales[m] * scales[n0 + j];
}

int panel_linear_i8(const float *x, const int8_t *w, const float *scales, const int32_t *weight_sums, float *y,
                    int64_t M, int64_t N, int64_t K, int threads) {
  int64_t K4 = (K + 3) / 4 * 4, panels = (N + PANEL - 1) / PANEL;
  uint8_t *xq = malloc((size_t)(M * K4));
  float *x_scales = malloc((size_t)M * sizeof(float));
  if (xq == NULL || x_scales == NULL) {
    free(xq);
    free(x_scales);
    return -1;
  }
  quantize_rows(x, M, K, K4, xq, x_scales);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p++) {
    const int8_t *panel = w + p * K4 * PANEL;
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL, m0 = 0;
    for (; m0 + TILE_ROWS <= M; m0 += TILE_ROWS)
      tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, TILE_ROWS);
    switch (M - m0) {
      case 1: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 1); break;
      case 2: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 2); break;
      case 3: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 3); break;
      case 4: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 4); break;
      case 5: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 5); break;
      case 6: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 6); break;
      case 7: tile_i8(xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N, n0, width, 7); break;
      default: break;
    }
  }
  free(xq);
  free(x_scales);
  return 0;
}

/* int4 (llama_core.int4): W's rows in groups of GROUP inputs, each group of a row stored as 4-bit values
 * q in 0..15 standing for (q - 8) * its float scale. A panel is [K / GROUP][GROUP / 4][16][4] bytes: for
 * inputs k .. k + 3 of a group, lane j's 4 bytes hold row j's values in their low nibbles and row 16 + j's in
 * their high ones. x is rounded to int8 on a scale per row and group (its largest magnitude / 127), as for
 * int8; a lane sums q * x four at a time in int32 (VNNI: q unsigned, x signed), and the 8 * sum(x) this adds
 * is taken off per group before the group's sum is scaled into the float result. */
#define GROUP 32

static void quantize_groups(const float *x, int64_t M, int64_t K, int64_t groups, int8_t *xq, float *x_scales,
                            int32_t *x_sums) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      const float *part = x + m * K + g * GROUP;
      int64_t count = K - g * GROUP < GROUP ? K - g * GROUP : GROUP;
      float largest = 0;
      for (int64_t k = 0; k < count; k++) largest = fmaxf(largest, fabsf(part[k]));
      float scale = largest > 0 ? largest / 127.0f : 1.0f, inverse = 1.0f / scale;
      int32_t sum = 0;
      int8_t *out = xq + (m * groups + g) * GROUP;
      for (int64_t k = 0; k < GROUP; k++) {
        out[k] = k < count ? (int8_t)nearbyintf(part[k] * inverse) : 0;
        sum += out[k];
      }
      x_scales[m * groups + g] = scale;
      x_sums[m * groups + g] = sum;
    }
}

static inline __attribute__((always_inline)) void tile_i4(
    const int8_t *xq, const float *x_scales, const int32_t *x_sums, const uint8_t *w, const float *scales, float *y,
    int64_t groups, int64_t N, int64_t n0, int64_t width, int rows) {
  float out[TILE_ROWS][PANEL];
#if defined(__AVX512VNNI__)
  __m512 low[TILE_ROWS], high[TILE_ROWS];
  for (int m = 0; m < rows; m++) low[m] = high[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *wg = w + g * (GROUP / 2) * PANEL;
    __m512i w_low[GROUP / 4], w_high[GROUP / 4];
    for (int q = 0; q < GROUP / 4; q++) {
      __m512i v = _mm512_loadu_si512(wg + q * 64);
      w_low[q] = _mm512_and_si512(v, nibble);
      w_high[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    __m512 s_low = _mm512_loadu_ps(scales + g * PANEL), s_high = _mm512_loadu_ps(scales + g * PANEL + 16);
    for (int m = 0; m < rows; m++) {
      const int8_t *xg = xq + (m * groups + g) * GROUP;
      __m512i i_low = _mm512_setzero_si512(), i_high = _mm512_setzero_si512();
      for (int q = 0; q < GROUP / 4; q++) {
        int32_t four;
        memcpy(&four, xg + q * 4, 4);
        __m512i xs = _mm512_set1_epi32(four);
        i_low = _mm512_dpbusd_epi32(i_low, w_low[q], xs);
        i_high = _mm512_dpbusd_epi32(i_high, w_high[q], xs);
      }
      __m512i offset = _mm512_set1_epi32(8 * x_sums[m * groups + g]);
      __m512 x_scale = _mm512_set1_ps(x_scales[m * groups + g]);
      low[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i_low, offset)), _mm512_mul_ps(s_low, x_scale), low[m]);
      high[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i_high, offset)), _mm512_mul_ps(s_high, x_scale),
                                high[m]);
    }
  }
  for (int m = 0; m < rows; m++) {
    _mm512_storeu_ps(out[m], low[m]);
    _mm512_storeu_ps(out[m] + 16, high[m]);
  }
#else
  for (int m = 0; m < rows; m++) {
    for (int j = 0; j < PANEL; j++) out[m][j] = 0;
    for (int64_t g = 0; g < groups; g++) {
      const int8_t *xg = xq + (m * groups + g) * GROUP;
      const uint8_t *wg = w + g * (GROUP / 2) * PANEL;
      for (int j = 0; j < PANEL; j++) {
        int32_t sum = 0;
        for (int q = 0; q < GROUP / 4; q++)
          for (int b = 0; b < 4; b++) {
            uint8_t byte = wg[(q * 16 + j % 16) * 4 + b];
            sum += (int32_t)(j < 16 ? byte & 0x0F : byte >> 4) * xg[q * 4 + b];
          }
        sum -= 8 * x_sums[m * groups + g];
        out[m][j] += (float)sum * (scales[g * PANEL + j] * x_scales[m * groups + g]);
      }
    }
  }
#endif
  for (int m = 0; m < rows; m++)
    for (int64_t j = 0; j < width; j++) y[m * N + n0 + j] = out[m][j];
}

int panel_linear_i4(const float *x, const uint8_t *w, const float *scales, float *y, int64_t M, int64_t N, int64_t K,
                    int threads) {
  int64_t groups = (K + GROUP - 1) / GROUP, panels = (N + PANEL - 1) / PANEL;
  int8_t *xq = malloc((size_t)(M * groups * GROUP));
  float *x_scales = malloc((size_t)(M * groups) * sizeof(float));
  int32_t *x_sums = malloc((size_t)(M * groups) * sizeof(int32_t));
  if (xq == NULL || x_scales == NULL || x_sums == NULL) {
    free(xq);
    free(x_scales);
    free(x_sums);
    return -1;
  }
  quantize_groups(x, M, K, groups, xq, x_scales, x_sums);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p++) {
    const uint8_t *panel = w + p * groups * (GROUP / 2) * PANEL;
    const float *panel_scales = scales + p * groups * PANEL;
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL, m0 = 0;
    for (; m0 + TILE_ROWS <= M; m0 += TILE_ROWS)
      tile_i4(xq + m0 * groups * GROUP, x_scales + m0 * groups, x_sums + m0 * groups, panel, panel_scales, y + m0 * N,
              groups, N, n0, width, TILE_ROWS);
#define TILE_I4(rows) tile_i4(xq + m0 * groups * GROUP, x_scales + m0 * groups, x_sums + m0 * groups, panel, \
                              panel_scales, y + m0 * N, groups, N, n0, width, rows)
    switch (M - m0) {  /* a constant row count each, so that the tile's loops over rows unroll */
      case 1: TILE_I4(1); break;
      case 2: TILE_I4(2); break;
      case 3: TILE_I4(3); break;
      case 4: TILE_I4(4); break;
      case 5: TILE_I4(5); break;
      case 6: TILE_I4(6); break;
      case 7: TILE_I4(7); break;
      default: break;
    }
#undef TILE_I4
  }
  free(xq);
  free(x_scales);
  free(x_sums);
  return 0;
}

/* The layout's constants, for the Python side to check against its own. */
int panel_width(void) { return PANEL; }

/* Whether the target has the 64-byte vector registers these kernels are written for (AVX-512F): a v16 is then
 * one register and a tile's accumulators stay in registers. Elsewhere (AVX2, NEON) the compiler keeps them in
 * memory, and a product of many rows runs many times slower than torch's own: the Python side then leaves
 * the kernels unused. */
int native_vectors(void) {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
