/* y = x @ W.T on the CPU for float32 x [M, K] and a weight stored in panels: W's rows in groups of PANEL,
 * each group contiguous. float32 panels are [K][PANEL]; 16-bit ones (bfloat16 or float16, the dtypes Llama-2
 * checkpoints are stored in) have the same layout and are widened to float32 in registers, so their products
 * are bit for bit those of the float32 panels of the same values, reading half the bytes; int8 panels (one
 * float scale per row of W) are [K / 4][PANEL][4], the layout of VNNI's four-products-per-lane instruction.
 *
 * One panel is read as a single sequential stream and every row of x in a tile of rows is multiplied with it
 * while it is in registers; a block of up to ROW_BLOCK rows takes the panel K_BLOCK inputs at a time, so the
 * weight leaves memory once per block and L1 once per tile, and a tile asks for the weights it will read a
 * little ahead of reading them: a few rows cost about what one does. One or two rows (decoding one sequence or
 * two) read STREAMS panels side by side instead, to keep more of memory's bandwidth busy, and run at the
 * memory's speed. Built by build.py with -O3 -march=native -fopenmp.
 *
 * The code is written in the target's own vectors, LANES floats each (widen.h): 16 with AVX-512, 8 with AVX2; a
 * panel row is VECS of them. Tile and stream counts are sized so that the accumulators and the weights they
 * multiply fit the target's registers (32 with AVX-512, 16 with AVX2): a wider vector type than the target's
 * own, or more accumulators than registers, makes GCC keep them in memory, many times slower. Each output sums
 * its products over k in the same order on every target and tile size, so a row gets the same values alone as
 * in a batch, and from an AVX2 build as from an AVX-512 one. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) || defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "widen.h"

#define PANEL 32
/* TILE_ROWS: rows of a tile over a whole panel row (16-bit panels, widened as they are read). Over float32
 * panels (and 16-bit ones widened beforehand) a tile is FLOAT_TILE_ROWS by FLOAT_TILE_COLUMNS: with AVX2's
 * 16 registers, 6 rows by half a panel (12 accumulators, 2 weight vectors, a broadcast) multiply each loaded
 * weight vector 6 times where 3 rows by a whole panel (12 accumulators) leave no register to hold the weights,
 * which are then loaded once per FMA. */
#if LANES == 16
#define TILE_ROWS 8
#define FLOAT_TILE_ROWS 8
#define FLOAT_TILE_COLUMNS 32
#define STREAMS 4
#elif LANES == 8
#define TILE_ROWS 3
#define FLOAT_TILE_ROWS 6
#define FLOAT_TILE_COLUMNS 16
#define STREAMS 3
#else
#define TILE_ROWS 2
#define FLOAT_TILE_ROWS 4
#define FLOAT_TILE_COLUMNS 16
#define STREAMS 2
#endif
#define VECS (PANEL / LANES)
/* How many panel rows ahead a tile asks for the weights it reads from memory: a tile reads one panel at a time,
 * a single stream, which the hardware's prefetcher alone leaves waiting on memory (at the 7B's width, bf16
 * panels: AVX2's 2 rows took 1.39x one row's time, with this 0.99x; AVX-512's 8 rows 1.74x, now 1.16x). */
#define TILE_PREFETCH 32
#define INT8_PREFETCH 16  /* groups of 4 inputs (128 bytes of a panel) ahead, for the int8 tiles likewise */

/* TILE(..., rows) over rows [0, M_ROWS) in tiles of ROWS rows: the arguments before the row count may use m0,
 * the tile's first row. The last, partial tile is dispatched on its row count so that each call has a
 * constant one and its loops over rows unroll (cases of ROWS rows or more never run; up to 8 rows a tile). */
#define BELOW_TILE(rows, tile) ((rows) < (tile) ? (rows) : (tile))
#define ALL_TILES(M_ROWS, ROWS, TILE, ...)                                                             \
  {                                                                                                    \
    int64_t m0 = 0;                                                                                    \
    for (; m0 + (ROWS) <= (M_ROWS); m0 += (ROWS)) TILE(__VA_ARGS__, ROWS);                             \
    switch ((M_ROWS) - m0) {                                                                           \
      case 1: TILE(__VA_ARGS__, BELOW_TILE(1, ROWS)); break;                                           \
      case 2: TILE(__VA_ARGS__, BELOW_TILE(2, ROWS)); break;                                           \
      case 3: TILE(__VA_ARGS__, BELOW_TILE(3, ROWS)); break;                                           \
      case 4: TILE(__VA_ARGS__, BELOW_TILE(4, ROWS)); break;                                           \
      case 5: TILE(__VA_ARGS__, BELOW_TILE(5, ROWS)); break;                                           \
      case 6: TILE(__VA_ARGS__, BELOW_TILE(6, ROWS)); break;                                           \
      case 7: TILE(__VA_ARGS__, BELOW_TILE(7, ROWS)); break;                                           \
      default: break;                                                                                  \
    }                                                                                                  \
  }

/* One panel row's PANEL weights as float32 vectors w[0..VECS), columns c * LANES onwards in w[c]. */
static inline __attribute__((always_inline)) void load_row_f32(const float *p, vf *w) {
  for (int c = 0; c < VECS; c++) w[c] = *(const vf *)(p + c * LANES);
}

/* The FLOAT_TILE_COLUMNS weights from p of a float32 panel row. */
static inline __attribute__((always_inline)) void load_tile_row_f32(const float *p, vf *w) {
  for (int c = 0; c < FLOAT_TILE_COLUMNS / LANES; c++) w[c] = *(const vf *)(p + c * LANES);
}

/* bfloat16 is float32's upper half, and bfloat16 panels interleave a row's two halves (columns j and 16 + j
 * share 32-bit lane j: see panels.py), so widening is one load, a shift and a mask per two vectors. */
static inline __attribute__((always_inline)) void load_row_bf16(const uint16_t *p, vf *w) {
  for (int i = 0; i < VECS / 2; i++) {
    vu lanes = *(const vu *)(p + 2 * LANES * i);
    w[i] = (vf)(lanes << 16);
    w[VECS / 2 + i] = (vf)(lanes & 0xffff0000u);
  }
}

static inline __attribute__((always_inline)) void load_row_f16(const uint16_t *p, vf *w) {
  for (int c = 0; c < VECS; c++) w[c] = load_f16_lanes(p + c * LANES);
}

/* The first `width` columns of a panel row's results into y. Through a fixed-size buffer: copying from the
 * vectors themselves with a variable size would make GCC keep them in memory. */
static inline __attribute__((always_inline)) void store_columns(const vf *sums, float *y, int64_t width) {
  float out[PANEL];
  for (int c = 0; c < VECS; c++) memcpy(out + c * LANES, &sums[c], sizeof(vf));
  memcpy(y, out, width * sizeof(float));
}

/* Rows [0, rows) of x (row stride K) times rows [k0, k1) of COLUMNS columns of one panel from w (a row every
 * PANEL weights), added to the tile's sums so far in acc (a row every PANEL; none when k0 is 0): over
 * consecutive passes each output sums its products over k in order, as in one pass. */
#define DEFINE_TILE(NAME, WEIGHT_T, LOAD_ROW, ROWS, COLUMNS, PREFETCH)                                 \
  static inline __attribute__((always_inline)) void NAME(const float *x, const WEIGHT_T *w, float *acc, \
                                                         int64_t K, int64_t k0, int64_t k1, int rows) { \
    vf sums[ROWS][COLUMNS / LANES];                                                                    \
    for (int m = 0; m < rows; m++)                                                                     \
      for (int c = 0; c < COLUMNS / LANES; c++)                                                        \
        sums[m][c] = k0 == 0 ? (vf){0} : *(const vf *)(acc + m * PANEL + c * LANES);                   \
    for (int64_t k = k0; k < k1; k++) {                                                                \
      vf row[COLUMNS / LANES];                                                                         \
      if (PREFETCH) __builtin_prefetch(w + (k + PREFETCH) * PANEL);                                    \
      LOAD_ROW(w + k * PANEL, row);                                                                    \
      for (int m = 0; m < rows; m++) {                                                                 \
        float xv = x[m * K + k];                                                                       \
        for (int c = 0; c < COLUMNS / LANES; c++) sums[m][c] += row[c] * xv;                           \
      }                                                                                                \
    }                                                                                                  \
    for (int m = 0; m < rows; m++)                                                                     \
      for (int c = 0; c < COLUMNS / LANES; c++) memcpy(acc + m * PANEL + c * LANES, &sums[m][c], sizeof(vf)); \
  }

DEFINE_TILE(tile_f32, float, load_tile_row_f32, FLOAT_TILE_ROWS, FLOAT_TILE_COLUMNS, TILE_PREFETCH)
DEFINE_TILE(tile_wide, float, load_tile_row_f32, FLOAT_TILE_ROWS, FLOAT_TILE_COLUMNS, 0)
DEFINE_TILE(tile_bf16, uint16_t, load_row_bf16, TILE_ROWS, PANEL, TILE_PREFETCH)
DEFINE_TILE(tile_f16, uint16_t, load_row_f16, TILE_ROWS, PANEL, TILE_PREFETCH)

/* Rows of x times a panel, a block of ROW_BLOCK rows at a time and, within that, K_BLOCK inputs at a time for
 * every tile of the block: the panel's block of rows is then read from L1 by all tiles after the first
 * (at 3 rows a tile, reading a whole panel from L2 for each tile held AVX2's products to about half of the
 * FMA units' rate). Tiles of ROWS rows and COLUMNS columns. */
#define K_BLOCK 128
#define ROW_BLOCK 96
#define TILES_OF_PANEL(TILE, ROWS, COLUMNS, panel)                                                     \
  {                                                                                                    \
    float acc[ROW_BLOCK * PANEL] __attribute__((aligned(64)));                                         \
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;                                   \
    for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {                                                    \
      int64_t block_rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;                                    \
      for (int64_t c0 = 0; c0 < PANEL; c0 += COLUMNS)                                                  \
        for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {                                                  \
          int64_t k1 = K - k0 < K_BLOCK ? K : k0 + K_BLOCK;                                            \
          ALL_TILES(block_rows, ROWS, TILE, x + (r0 + m0) * K, panel + c0, acc + m0 * PANEL + c0, K, k0, k1) \
        }                                                                                              \
      for (int64_t m = 0; m < block_rows; m++)                                                         \
        memcpy(y + (r0 + m) * N + n0, acc + m * PANEL, width * sizeof(float));                         \
    }                                                                                                  \
  }
_Static_assert(TILE_ROWS <= 8 && FLOAT_TILE_ROWS <= 8, "ALL_TILES dispatches partial tiles of up to 7 rows");
_Static_assert(ROW_BLOCK % TILE_ROWS == 0 && ROW_BLOCK % FLOAT_TILE_ROWS == 0, "whole tiles in a row block");

void panel_product_f32(const float *x, const float *w, const float *scales, float *y, int64_t M, int64_t N,
                       int64_t K, int threads) {
  (void)scales;
  int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p++) TILES_OF_PANEL(tile_f32, FLOAT_TILE_ROWS, FLOAT_TILE_COLUMNS, w + p * K * PANEL)
}

/* 16-bit panels: with more rows than four tiles, each thread widens a panel into float32 once and runs every
 * tile over that (prefill is arithmetic-bound, and widening per tile would cost a conversion per tile); the
 * same values in the same order, so the same sums. */
#define DEFINE_PRODUCT_16(NAME, TILE, LOAD_ROW)                                                        \
  void NAME(const float *x, const uint16_t *w, const float *scales, float *y, int64_t M, int64_t N,    \
            int64_t K, int threads) {                                                                  \
    (void)scales;                                                                                      \
    int64_t panels = (N + PANEL - 1) / PANEL;                                                          \
    _Pragma("omp parallel num_threads(threads)") {                                                     \
      float *wide = M > 4 * TILE_ROWS ? aligned_alloc(64, (size_t)(K * PANEL) * sizeof(float)) : NULL; \
      _Pragma("omp for schedule(static)")                                                              \
      for (int64_t p = 0; p < panels; p++) {                                                           \
        const uint16_t *panel = w + p * K * PANEL;                                                     \
        if (wide == NULL) {                                                                            \
          TILES_OF_PANEL(TILE, TILE_ROWS, PANEL, panel)                                                \
        } else {                                                                                       \
          for (int64_t k = 0; k < K; k++) {                                                            \
            vf row[VECS];                                                                              \
            LOAD_ROW(panel + k * PANEL, row);                                                          \
            memcpy(wide + k * PANEL, row, sizeof row);                                                 \
          }                                                                                            \
          TILES_OF_PANEL(tile_wide, FLOAT_TILE_ROWS, FLOAT_TILE_COLUMNS, wide)                         \
        }                                                                                              \
      }                                                                                                \
      free(wide);                                                                                      \
    }                                                                                                  \
  }

DEFINE_PRODUCT_16(panel_product_bf16, tile_bf16, load_row_bf16)
DEFINE_PRODUCT_16(panel_product_f16, tile_f16, load_row_f16)

/* ROWS rows of x times `count` consecutive panels at once (count <= STREAMS): that many weight streams in
 * flight per thread. Decoding one sequence is this product, at the memory's speed; on a 2026 Intel Xeon one
 * stream at a time per core read 18 GB/s with 2 threads and four at a time 26 (before the tiles asked for their
 * weights ahead, which brought them to about the streams' rate). Each output sums over k in the same order as
 * the tiles, so a row gets the same values alone as in a batch. */
#define DEFINE_ROWS(NAME, WEIGHT_T, LOAD_ROW)                                                          \
  static inline __attribute__((always_inline)) void NAME(const float *x, const WEIGHT_T *w, float *y,  \
                                                         int64_t K, int64_t N, int64_t p0, int count,  \
                                                         int rows) {                                   \
    vf sums[STREAMS][STREAMED_ROWS][VECS];                                                             \
    for (int s = 0; s < count; s++)                                                                    \
      for (int m = 0; m < rows; m++)                                                                   \
        for (int c = 0; c < VECS; c++) sums[s][m][c] = (vf){0};                                        \
    for (int64_t k = 0; k < K; k++) {                                                                  \
      for (int s = 0; s < count; s++) {                                                                \
        vf row[VECS];                                                                                  \
        LOAD_ROW(w + ((p0 + s) * K + k) * PANEL, row);                                                 \
        for (int m = 0; m < rows; m++) {                                                               \
          float xv = x[m * K + k];                                                                     \
          for (int c = 0; c < VECS; c++) sums[s][m][c] += row[c] * xv;                                 \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    for (int s = 0; s < count; s++) {                                                                  \
      int64_t n0 = (p0 + s) * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;                          \
      for (int m = 0; m < rows; m++) store_columns(sums[s][m], y + m * N + n0, width);                 \
    }                                                                                                  \
  }

/* STREAMED_ROWS: the most rows read as streams rather than in tiles, as many as the registers hold STREAMS
 * streams' accumulators for (32 with AVX-512; AVX2's 16 hold one row's). From 3 rows on, the tiles, asking for
 * their weights ahead, were as fast or faster (at the 7B's width, 4 and 6 rows 1.06x and 1.09x one row's time,
 * where 2 and 4 streams took 1.16x and 1.25x). */
#if LANES == 16
#define STREAMED_ROWS 2
#else
#define STREAMED_ROWS 1
#endif

DEFINE_ROWS(rows_times_panels_f32, float, load_row_f32)
DEFINE_ROWS(rows_times_panels_bf16, uint16_t, load_row_bf16)
DEFINE_ROWS(rows_times_panels_f16, uint16_t, load_row_f16)

/* Each thread an equal share of the panels (groups of streams dealt out would leave a 9-panel product to
 * one thread of two), read `streams` at a time; ROWS and streams are constants where this expands. */
#if defined(_OPENMP)
#define TEAM_SHARE int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
#define TEAM_SHARE int64_t team = 1, me = 0;
#endif
#define PANELS_IN_STREAMS(ROW_FN, ROWS)                                                                \
  _Pragma("omp parallel num_threads(threads)") {                                                       \
    TEAM_SHARE                                                                                         \
    int64_t p = panels * me / team, end = panels * (me + 1) / team;                                    \
    for (; p + STREAMS <= end; p += STREAMS) ROW_FN(x, w, y, K, N, p, STREAMS, ROWS);                  \
    switch (end - p) {                                                                                 \
      case 3: ROW_FN(x, w, y, K, N, p, BELOW_TILE(3, STREAMS), ROWS); break;                           \
      case 2: ROW_FN(x, w, y, K, N, p, BELOW_TILE(2, STREAMS), ROWS); break;                           \
      case 1: ROW_FN(x, w, y, K, N, p, 1, ROWS); break;                                                \
      default: break;                                                                                  \
    }                                                                                                  \
  }
#define DEFINE_LINEAR(NAME, WEIGHT_T, ROW_FN, PRODUCT)                                                 \
  void NAME(const float *x, const WEIGHT_T *w, const float *scales, float *y, int64_t M, int64_t N,    \
            int64_t K, int threads) {                                                                  \
    if (M > STREAMED_ROWS) {                                                                           \
      PRODUCT(x, w, scales, y, M, N, K, threads);                                                      \
      return;                                                                                          \
    }                                                                                                  \
    int64_t panels = (N + PANEL - 1) / PANEL;                                                          \
    if (threads > panels) threads = (int)panels;                                                       \
    if (threads < 1) threads = 1;                                                                      \
    if (M == 1)                                                                                        \
      PANELS_IN_STREAMS(ROW_FN, 1)                                                                     \
    else                                                                                               \
      PANELS_IN_STREAMS(ROW_FN, STREAMED_ROWS)                                                         \
  }
_Static_assert(STREAMS <= 4 && STREAMED_ROWS <= 2, "DEFINE_LINEAR dispatches up to 2 rows and the last panels in groups of up to 3");

DEFINE_LINEAR(panel_linear_f32, float, rows_times_panels_f32, panel_product_f32)
DEFINE_LINEAR(panel_linear_bf16, uint16_t, rows_times_panels_bf16, panel_product_bf16)
DEFINE_LINEAR(panel_linear_f16, uint16_t, rows_times_panels_f16, panel_product_f16)

/* The product for panels of a kind: 0 float32, 1 bfloat16, 2 float16 (block.c's projections). */
void panel_linear(int kind, const float *x, const void *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
  if (kind == KIND_BFLOAT16)
    panel_linear_bf16(x, w, NULL, y, M, N, K, threads);
  else if (kind == KIND_FLOAT16)
    panel_linear_f16(x, w, NULL, y, M, N, K, threads);
  else
    panel_linear_f32(x, w, NULL, y, M, N, K, threads);
}

/* The integer products' tiles: as many rows as the target's registers hold accumulators for. */
#if defined(__AVX512VNNI__) || !defined(__AVX2__)
#define INT_TILE_ROWS 8
#else
#define INT_TILE_ROWS 2
#endif
_Static_assert(INT_TILE_ROWS <= 8, "ALL_TILES dispatches partial tiles of up to 7 rows");

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
/* acc plus, in each 32-bit lane, the sum of the four products of unsigned bytes u and signed bytes s (VNNI's
 * vpdpbusd). Without AVX-VNNI it is AVX2's pairwise products, whose 16-bit sums saturate beyond 32,767: the
 * callers keep every pair below that. */
static inline __attribute__((always_inline)) __m256i dot_u8_s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

/* int8: each row of x is quantized on its own scale (its largest magnitude / 127, rounded to nearest even)
 * and offset by 128 to unsigned bytes; with VNNI a lane then sums (x + 128) * w four at a time in int32, and
 * the 128 * sum(w) this adds is taken off with the row sums of W that the caller keeps (`weight_sums`). With
 * AVX2 the lane sums |x| * (w with x's sign), which keeps AVX2's 16-bit pair sums within range (the weights
 * are in [-127, 127]: llama_core.quantize), and needs no correction. The result for a row never depends on
 * the other rows. */
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
  int32_t sums[INT_TILE_ROWS][PANEL];
  int32_t offset = 128;  /* what the sums hold beyond x * w, per unit of sum(w) */
#if defined(__AVX512VNNI__)
  __m512i low[INT_TILE_ROWS], high[INT_TILE_ROWS];
  for (int m = 0; m < rows; m++) low[m] = high[m] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4 / 4; g++) {
    __builtin_prefetch(w + (g + INT8_PREFETCH) * 4 * PANEL);
    __builtin_prefetch(w + (g + INT8_PREFETCH) * 4 * PANEL + 64);
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
#elif defined(__AVX2__)
  __m256i acc[INT_TILE_ROWS][4];  /* rows 0-7, 8-15, 16-23 and 24-31 of the panel */
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < 4; c++) acc[m][c] = _mm256_setzero_si256();
  const __m256i sign_bit = _mm256_set1_epi8((char)0x80);
  for (int64_t g = 0; g < K4 / 4; g++) {
    __builtin_prefetch(w + (g + INT8_PREFETCH) * 4 * PANEL);
    __builtin_prefetch(w + (g + INT8_PREFETCH) * 4 * PANEL + 64);
    __m256i wv[4];
    for (int c = 0; c < 4; c++) wv[c] = _mm256_loadu_si256((const __m256i *)(w + g * 4 * PANEL + c * 32));
    for (int m = 0; m < rows; m++) {
      int32_t four;
      memcpy(&four, xq + m * K4 + g * 4, 4);
      __m256i xs = _mm256_xor_si256(_mm256_set1_epi32(four), sign_bit);  /* x, signed */
      __m256i magnitude = _mm256_abs_epi8(xs);
      for (int c = 0; c < 4; c++) acc[m][c] = dot_u8_s8(acc[m][c], magnitude, _mm256_sign_epi8(wv[c], xs));
    }
  }
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(sums[m] + 8 * c), acc[m][c]);
  offset = 0;
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
      y[m * N + n0 + j] = (float)(sums[m][j] - offset * weight_sums[n0 + j]) * x_scales[m] * scales[n0 + j];
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
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
    ALL_TILES(M, INT_TILE_ROWS, tile_i8, xq + m0 * K4, x_scales + m0, panel, scales, weight_sums, y + m0 * N, K4, N,
              n0, width)
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
  float out[INT_TILE_ROWS][PANEL];
#if defined(__AVX512VNNI__)
  __m512 low[INT_TILE_ROWS], high[INT_TILE_ROWS];
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
#elif defined(__AVX2__)
  /* A 32-byte half h of each 64-byte block holds rows 8h..8h+7 (low nibbles) and 16+8h.. (high): vector c of
   * a group's unpacked weights covers rows 8c..8c+7. */
  __m256 acc[INT_TILE_ROWS][4];
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < 4; c++) acc[m][c] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *wg = w + g * (GROUP / 2) * PANEL;
    __m256i wv[GROUP / 4][4];
    for (int q = 0; q < GROUP / 4; q++)
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(wg + q * 64 + h * 32));
        wv[q][h] = _mm256_and_si256(v, nibble);
        wv[q][2 + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
    for (int m = 0; m < rows; m++) {
      const int8_t *xg = xq + (m * groups + g) * GROUP;
      __m256i sums[4];
#if defined(__AVXVNNI__)
      for (int c = 0; c < 4; c++) sums[c] = _mm256_setzero_si256();
      for (int q = 0; q < GROUP / 4; q++) {
        int32_t four;
        memcpy(&four, xg + q * 4, 4);
        __m256i xs = _mm256_set1_epi32(four);
        for (int c = 0; c < 4; c++) sums[c] = _mm256_dpbusd_avx_epi32(sums[c], wv[q][c], xs);
      }
#else
      /* q <= 15 and |x| <= 127: a pair's sum is at most 3,810, a group's eight pairs per lane 30,480, so the
       * 16-bit sums stay exact until one widening per group. */
      __m256i pairs[4];
      for (int c = 0; c < 4; c++) pairs[c] = _mm256_setzero_si256();
      for (int q = 0; q < GROUP / 4; q++) {
        int32_t four;
        memcpy(&four, xg + q * 4, 4);
        __m256i xs = _mm256_set1_epi32(four);
        for (int c = 0; c < 4; c++) pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(wv[q][c], xs));
      }
      for (int c = 0; c < 4; c++) sums[c] = _mm256_madd_epi16(pairs[c], _mm256_set1_epi16(1));
#endif
      __m256i offset = _mm256_set1_epi32(8 * x_sums[m * groups + g]);
      __m256 x_scale = _mm256_set1_ps(x_scales[m * groups + g]);
      for (int c = 0; c < 4; c++)
        acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[c], offset)),
                                    _mm256_mul_ps(_mm256_loadu_ps(scales + g * PANEL + 8 * c), x_scale), acc[m][c]);
    }
  }
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(out[m] + 8 * c, acc[m][c]);
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
    int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
    ALL_TILES(M, INT_TILE_ROWS, tile_i4, xq + m0 * groups * GROUP, x_scales + m0 * groups, x_sums + m0 * groups, panel,
              panel_scales, y + m0 * N, groups, N, n0, width)
  }
  free(xq);
  free(x_scales);
  free(x_sums);
  return 0;
}

/* The layout's constants, for the Python side to check against its own. */
int panel_width(void) { return PANEL; }

/* The rows of a tile over 16-bit panels (float32 ones take at least as many), and of an int8 or int4 one: rows
 * that read the weight once, at about one row's cost. */
int tile_rows(void) { return TILE_ROWS; }
int int_tile_rows(void) { return INT_TILE_ROWS; }

/* Whether the target has the vectors these kernels are written for: AVX-512F, or AVX2 with FMA (a v16 is then one
 * or two registers, and a tile's accumulators stay in registers). Elsewhere (NEON, x86 before AVX2) they have
 * not been measured against torch's own products: the Python side then leaves the kernels unused. */
int native_vectors(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}

/* The vector instructions the products were built with, in words (the app's Model tab shows them). */
const char *vector_instructions(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "AVX-512 with VNNI";
#elif defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "AVX2 with AVX-VNNI";
#elif defined(__AVX2__)
  return "AVX2";
#else
  return "no AVX2";
#endif
}
