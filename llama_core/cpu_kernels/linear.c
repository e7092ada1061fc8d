/* y = x @ W.T on the CPU for float32 x [M, K] and a weight stored in panels: W's rows in groups of PANEL,
 * each group [K][PANEL] contiguous, float32 or int8 (with one float scale per row of W).
 *
 * One panel is read as a single sequential stream and every row of x in a tile of up to TILE_ROWS rows is
 * multiplied with it while it is in registers, so the weight leaves memory once per TILE_ROWS rows: a one-row
 * product runs at the memory's speed and a few rows cost about what one does. Built by build.py with
 * -O3 -march=native -fopenmp; GCC's vector extensions map v16 to whatever vector registers the CPU has. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 32
#define TILE_ROWS 8

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) v16 load_f32(const float *p) { return *(const v16 *)p; }

static inline __attribute__((always_inline)) v16 load_i8(const int8_t *p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
  v16 r;
  for (int i = 0; i < 16; i++) r[i] = p[i];
  return r;
#endif
}

/* Rows [0, rows) of x (row stride K) times one panel w [K][PANEL]; writes columns [n0, n0 + width) of y. */
#define DEFINE_TILE(NAME, WEIGHT_T, LOAD, SCALE)                                                       \
  static inline __attribute__((always_inline)) void NAME(                                              \
      const float *x, const WEIGHT_T *w, const float *scales, float *y, int64_t K, int64_t N,          \
      int64_t n0, int64_t width, int rows) {                                                           \
    v16 low[TILE_ROWS], high[TILE_ROWS];                                                               \
    for (int m = 0; m < rows; m++) low[m] = high[m] = (v16){0};                                        \
    for (int64_t k = 0; k < K; k++) {                                                                  \
      v16 w_low = LOAD(w + k * PANEL), w_high = LOAD(w + k * PANEL + 16);                              \
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

DEFINE_TILE(tile_f32, float, load_f32, )
DEFINE_TILE(tile_i8, int8_t, load_i8, low[m] *= load_f32(scales + n0); high[m] *= load_f32(scales + n0 + 16);)

/* The row count of the last tile is a constant in each case, so the compiler unrolls its loops. */
#define DEFINE_PRODUCT(NAME, WEIGHT_T, TILE)                                                            \
  void NAME(const float *x, const WEIGHT_T *w, const float *scales, float *y, int64_t M, int64_t N,    \
            int64_t K, int threads) {                                                                  \
    int64_t panels = (N + PANEL - 1) / PANEL;                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                  \
    for (int64_t p = 0; p < panels; p++) {                                                             \
      const WEIGHT_T *panel = w + p * K * PANEL;                                                       \
      int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL, m0 = 0;                         \
      for (; m0 + TILE_ROWS <= M; m0 += TILE_ROWS)                                                     \
        TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, TILE_ROWS);                       \
      switch (M - m0) {                                                                                \
        case 1: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 1); break;                \
        case 2: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 2); break;                \
        case 3: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 3); break;                \
        case 4: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 4); break;                \
        case 5: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 5); break;                \
        case 6: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 6); break;                \
        case 7: TILE(x + m0 * K, panel, scales, y + m0 * N, K, N, n0, width, 7); break;                \
        default: break;                                                                                \
      }                                                                                                \
    }                                                                                                  \
  }

DEFINE_PRODUCT(panel_linear_f32, float, tile_f32)
DEFINE_PRODUCT(panel_linear_i8, int8_t, tile_i8)

/* The layout's constants, for the Python side to check against its own. */
int panel_width(void) { return PANEL; }
