// bfloat16 linear layers on CPUs with AVX512-BF16: y = x @ W^T (+ bias).
//
// torch's bf16 matmul on such CPUs (oneDNN) runs well below the hardware's dot-product rate,
// and at a handful of rows (decode steps) it is slower than reading the weights once would
// be. This kernel does both cases with one register-blocked loop built on vdpbf16ps, which
// multiplies pairs of bf16 values and accumulates them in fp32.
//
// The weight is packed once at load time (fulcrum/kernels/__init__.py) into panels of
// kPanel output columns: panel p holds, for every pair of input features (k, k+1), the
// kPanel columns' two weights side by side, so one 64-byte load feeds 16 columns x 2 k.
// A tile of up to kRows input rows x one panel stays in 24 zmm accumulators for the whole
// K loop; each input pair is broadcast once per row. Threads split the panels, so a small
// batch still uses every core and reads each weight exactly once per call.
//
// Weight-only int8 (`--quantization int8`): the same panels hold int8 weights, half the
// bytes to stream (decode steps are bound by reading the weights), with one fp32 scale per
// output column. Each loaded panel row is widened to bf16 in registers (integers of 8 bits
// are exact in bf16), so the products are those of the bf16 kernel with W = scale * q; the
// accumulators are scaled once at the end.
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kVectors = 3;              // zmm vectors of 16 fp32 columns per panel
constexpr int kPanel = 16 * kVectors;    // output columns per packed panel
constexpr int kRows = 8;                 // input rows per register tile

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m256i as_i(__m256bh v) { return reinterpret_cast<__m256i&>(v); }

// One panel row (kPanel columns x 2 k) as bf16 pairs: loaded as is, or widened from int8.
inline void load_row(const uint16_t* w, __m512bh* b) {
  for (int v = 0; v < kVectors; ++v) b[v] = as_bh(_mm512_loadu_si512(w + v * 32));
}

inline void load_row(const int8_t* w, __m512bh* b) {
  for (int v = 0; v < kVectors; ++v) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * 32));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * 32 + 16));
    b[v] = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
  }
}

template <int M, typename W>
void tile(const uint16_t* x, int64_t ldx, const W* panel, int pairs, const float* scale,
          const float* bias, void* out, int64_t ldo, int columns, bool out_f32) {
  __m512 acc[M][kVectors];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  const int32_t* rows[M];
  for (int m = 0; m < M; ++m) rows[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int kp = 0; kp < pairs; ++kp) {
    __m512bh b[kVectors];
    load_row(panel + static_cast<int64_t>(kp) * kPanel * 2, b);
    for (int m = 0; m < M; ++m) {
      const __m512bh a = as_bh(_mm512_set1_epi32(rows[m][kp]));
      for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int first = v * 16;
    if (first >= columns) break;
    const int n = columns - first < 16 ? columns - first : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    const __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale + first) : _mm512_set1_ps(1.0f);
    for (int m = 0; m < M; ++m) {
      const __m512 y = _mm512_fmadd_ps(acc[m][v], s, b);
      if (out_f32) {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + m * ldo + first, mask, y);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + m * ldo + first, mask,
                                 as_i(_mm512_cvtneps_pbh(y)));
      }
    }
  }
}

template <typename W>
using TileFn = void (*)(const uint16_t*, int64_t, const W*, int, const float*, const float*,
                        void*, int64_t, int, bool);
template <typename W>
constexpr TileFn<W> kTiles[kRows + 1] = {nullptr, tile<1, W>, tile<2, W>, tile<3, W>,
                                         tile<4, W>, tile<5, W>, tile<6, W>, tile<7, W>,
                                         tile<8, W>};

// An int8 panel widened to bf16 once, for the many row tiles of a large batch (each would
// otherwise widen every weight again).
void widen_panel(const int8_t* panel, int pairs, uint16_t* out) {
  for (int kp = 0; kp < pairs; ++kp) {
    __m512bh b[kVectors];
    load_row(panel + static_cast<int64_t>(kp) * kPanel * 2, b);
    for (int v = 0; v < kVectors; ++v)
      _mm512_storeu_si512(out + static_cast<int64_t>(kp) * kPanel * 2 + v * 32,
                          reinterpret_cast<__m512i&>(b[v]));
  }
}

int linear_widened(const uint16_t* x, int64_t ldx, const int8_t* packed, const float* scale,
                   const float* bias, void* out, int64_t ldo, int M, int N, int pairs,
                   int out_f32, int num_threads) {
  const int panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_size = static_cast<int64_t>(pairs) * kPanel * 2;
  const int64_t out_item = out_f32 ? 4 : 2;
#pragma omp parallel num_threads(num_threads)
  {
    uint16_t* widened = new uint16_t[panel_size];
#pragma omp for schedule(static)
    for (int p = 0; p < panels; ++p) {
      widen_panel(packed + p * panel_size, pairs, widened);
      const int n0 = p * kPanel;
      const int columns = N - n0 < kPanel ? N - n0 : kPanel;
      for (int m0 = 0; m0 < M; m0 += kRows) {
        const int rows = M - m0 < kRows ? M - m0 : kRows;
        kTiles<uint16_t>[rows](x + m0 * ldx, ldx, widened, pairs, scale + n0,
                               bias ? bias + n0 : nullptr,
                               static_cast<char*>(out) + (m0 * ldo + n0) * out_item, ldo,
                               columns, out_f32 != 0);
      }
    }
    delete[] widened;
  }
  return 0;
}

template <typename W>
int linear(const uint16_t* x, int64_t ldx, const W* packed, const float* scale,
           const float* bias, void* out, int64_t ldo, int M, int N, int K, int out_f32,
           int num_threads) {
  if (K % 2) return 1;
  const int pairs = K / 2;
  const int panels = (N + kPanel - 1) / kPanel;
  const int row_tiles = (M + kRows - 1) / kRows;
  const int64_t panel_size = static_cast<int64_t>(pairs) * kPanel * 2;
  const int64_t out_item = out_f32 ? 4 : 2;
  if constexpr (sizeof(W) == 1) {
    if (row_tiles > 1)  // several row tiles: widen each panel once, not once per tile
      return linear_widened(x, ldx, packed, scale, bias, out, ldo, M, N, pairs, out_f32,
                            num_threads);
  }
  // Panels outermost: a thread keeps its panel in cache while every row tile passes over it.
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
  for (int p = 0; p < panels; ++p) {
    for (int t = 0; t < row_tiles; ++t) {
      const int m0 = t * kRows;
      const int rows = M - m0 < kRows ? M - m0 : kRows;
      const int n0 = p * kPanel;
      const int columns = N - n0 < kPanel ? N - n0 : kPanel;
      kTiles<W>[rows](x + m0 * ldx, ldx, packed + p * panel_size, pairs,
                      scale ? scale + n0 : nullptr, bias ? bias + n0 : nullptr,
                      static_cast<char*>(out) + (m0 * ldo + n0) * out_item, ldo, columns,
                      out_f32 != 0);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int fulcrum_linear_bf16_supported() { return 1; }
int fulcrum_linear_bf16_panel() { return kPanel; }

// x: [M, K] bf16 rows with stride ldx; packed: the panels; bias: [N] fp32 or null;
// out: [M, N] (bf16, or fp32 when out_f32) rows with stride ldo. K must be even.
int fulcrum_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed,
                        const float* bias, void* out, int64_t ldo, int M, int N, int K,
                        int out_f32, int num_threads) {
  return linear(x, ldx, packed, nullptr, bias, out, ldo, M, N, K, out_f32, num_threads);
}

// The same with int8 panels and a fp32 scale per output column ([N], padded to the panels).
int fulcrum_linear_int8(const uint16_t* x, int64_t ldx, const int8_t* packed,
                        const float* scale, const float* bias, void* out, int64_t ldo, int M,
                        int N, int K, int out_f32, int num_threads) {
  return linear(x, ldx, packed, scale, bias, out, ldo, M, N, K, out_f32, num_threads);
}

}  // extern "C"

#else  // no AVX512-BF16: the caller uses torch's matmul

extern "C" {
int fulcrum_linear_bf16_supported() { return 0; }
int fulcrum_linear_bf16_panel() { return 0; }
int fulcrum_linear_bf16(const uint16_t*, int64_t, const uint16_t*, const float*, void*, int64_t,
                        int, int, int, int, int) {
  return 1;
}
int fulcrum_linear_int8(const uint16_t*, int64_t, const int8_t*, const float*, const float*,
                        void*, int64_t, int, int, int, int, int) {
  return 1;
}
}  // extern "C"

#endif
