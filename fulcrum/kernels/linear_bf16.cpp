// bfloat16 linear layers on x86 CPUs with AVX512-BF16, or with AVX2 and FMA: y = x @ W^T
// (+ bias).
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
// int8 (`--quantization int8`): weights int8 with one fp32 scale per output column, and each
// input row quantized to int8 at run time with one scale of its own (symmetric, dynamic per
// token, the W8A8 scheme of vLLM's compressed-tensors and oneDNN). Products then run on
// vpdpbusd, 64 multiply-adds of bytes per instruction into int32, straight from the loaded
// weights: widening int8 panels to bf16 in registers took several instructions per 16
// weights, so weight-only int8 was bound by arithmetic, not by reading its half-size weights.
// Per instruction vpdpbusd does twice vdpbf16ps's multiply-adds at the same issue rate, so
// large batches, bound by arithmetic, gain too.
// vpdpbusd multiplies unsigned by signed bytes, so a row is stored as q + 128 and each panel
// ends with its columns' weight sums times 128, which are subtracted.
// Quantizing a row depends on that row alone: results do not depend on the batch.
//
// CPUs without AVX512-BF16 (AMD before Zen 4, most Intel before Sapphire Rapids) take an
// AVX2 and FMA path instead: there torch's bf16 matmul runs far below its fp32 rate, at every
// batch size. It reads the same packed panels (16 columns wide: one 64-byte line per input
// pair) and widens each weight pair to two fp32 vectors with a shift and a mask, then runs
// fp32 FMAs; int8 products run on vpmaddubsw with the activation's sign moved onto the weight
// (|q| <= 127, so no pair of products saturates int16), the int32 sums equal VNNI's.
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "for_rows.h"
#include "vector_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define FULCRUM_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FULCRUM_LINEAR_AVX2 1
#endif

namespace {

// An int8 row's scale, amax / 127; NaN for a row with a NaN in it, so that all of its outputs
// come out NaN, as the bf16 kernels' and torch's do (its NaN quantized to 0 would hide it).
// Made from bits: -ffinite-math-only lets the compiler assume that no NaN is ever written.
inline float row_scale_of(float amax, bool has_nan) {
  if (!has_nan) return amax / 127.0f;
  const uint32_t bits = 0x7FC00000u;
  float nan;
  std::memcpy(&nan, &bits, sizeof nan);
  return nan;
}

}  // namespace

#if defined(FULCRUM_LINEAR_AVX512) || defined(FULCRUM_LINEAR_AVX2)
#include <immintrin.h>

namespace {

// A slice of the panel a thread computes next, fetched into L1 by a row tile of the panel
// before it, one 64-byte line per step of its K loop (the first `lines` steps); see for_tiles.
struct Ahead {
  const char* start = nullptr;
  int lines = 0;
};

// step(k) for every k in [0, steps), the first `ahead.lines` steps each fetching a line of
// `ahead` first. Two loops, not one testing `ahead` every step: GCC (12) split that one into
// versions that stored every accumulator of a 5- or 6-row AVX2 tile to memory every step.
template <typename Step>
inline void k_loop(int steps, Ahead ahead, const Step& step) {
  const int fetching = ahead.lines < steps ? ahead.lines : steps;
  int k = 0;
  for (; k < fetching; ++k) {
    _mm_prefetch(ahead.start + 64 * int64_t{k}, _MM_HINT_T0);
    step(k);
  }
  for (; k < steps; ++k) step(k);
}

}  // namespace
#endif

#if defined(FULCRUM_LINEAR_AVX512)
namespace {

constexpr int kVectors = 3;              // zmm vectors of 16 fp32 columns per panel
constexpr int kPanel = 16 * kVectors;    // output columns per packed panel
constexpr int kRows = 8;                 // input rows per register tile

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m256i as_i(__m256bh v) { return reinterpret_cast<__m256i&>(v); }
inline __v16si dpbusd(__v16si acc, __m512i a, __m512i b) {
  return __v16si(_mm512_dpbusd_epi32(__m512i(acc), a, b));
}

// y = acc * scale + bias for one row's `columns` outputs of a panel (acc: kVectors vectors),
// stored as bf16 or fp32.
inline void store_row(const __m512* acc, const float* scale, float row_scale, const float* bias,
                      void* out, int columns, bool out_f32) {
  for (int v = 0; v < kVectors; ++v) {
    const int first = v * 16;
    if (first >= columns) break;
    const int n = columns - first < 16 ? columns - first : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    const __m512 s = _mm512_mul_ps(
        scale ? _mm512_maskz_loadu_ps(mask, scale + first) : _mm512_set1_ps(1.0f),
        _mm512_set1_ps(row_scale));
    const __m512 y = _mm512_fmadd_ps(acc[v], s, b);
    if (out_f32) {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + first, mask, y);
    } else {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + first, mask,
                               as_i(_mm512_cvtneps_pbh(y)));
    }
  }
}

// bf16: a tile of M rows x one panel; the panel holds (k, k+1) pairs of kPanel columns.
// No software prefetch of its own panel, unlike the AVX2 tiles: on a Zen 4 EPYC the hardware
// prefetchers keep the weight stream at ~0.9 of a plain streaming read with the same calls,
// and a prefetch 512-2048 bytes ahead made batch-1 sweeps 6-25% slower (non-temporal ones
// too); `ahead` is the next panel's share (for_tiles).
template <int M>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int pairs,
               const float* bias, char* out, int64_t ldo_bytes, int columns, bool out_f32,
               Ahead ahead) {
  __m512 acc[M][kVectors];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  const int32_t* rows[M];
  for (int m = 0; m < M; ++m) rows[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  k_loop(pairs, ahead, [&](int kp) __attribute__((always_inline)) {
    __m512bh b[kVectors];
    const uint16_t* w = panel + static_cast<int64_t>(kp) * kPanel * 2;
    for (int v = 0; v < kVectors; ++v) b[v] = as_bh(_mm512_loadu_si512(w + v * 32));
    for (int m = 0; m < M; ++m) {
      const __m512bh a = as_bh(_mm512_set1_epi32(rows[m][kp]));
      for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  });
  for (int m = 0; m < M; ++m)
    store_row(acc[m], nullptr, 1.0f, bias, out + m * ldo_bytes, columns, out_f32);
}

// int8: the same tile over quads (k..k+3) of unsigned row bytes and signed weight bytes; the
// panel's last kPanel int32 are its columns' weight sums times 128.
template <int M>
void tile_int8(const uint8_t* x, int64_t ldx, const float* row_scales, const int8_t* panel,
               int quads, const float* scale, const float* bias, char* out, int64_t ldo_bytes,
               int columns, bool out_f32, Ahead ahead) {
  // __v16si, not __m512i: GCC (12) keeps an array of the may_alias __m512i in memory, so every
  // vpdpbusd of the K loop loaded and stored its accumulator, which halved the tile's rate
  __v16si acc[M][kVectors];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = __v16si{};
  const int32_t* rows[M];
  for (int m = 0; m < M; ++m) rows[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  k_loop(quads, ahead, [&](int kq) __attribute__((always_inline)) {
    __m512i b[kVectors];
    const int8_t* w = panel + static_cast<int64_t>(kq) * kPanel * 4;
    for (int v = 0; v < kVectors; ++v) b[v] = _mm512_loadu_si512(w + v * 64);
    for (int m = 0; m < M; ++m) {
      const __m512i a = _mm512_set1_epi32(rows[m][kq]);
      for (int v = 0; v < kVectors; ++v) acc[m][v] = dpbusd(acc[m][v], a, b[v]);
    }
  });
  const int32_t* sums = reinterpret_cast<const int32_t*>(panel + static_cast<int64_t>(quads)
                                                         * kPanel * 4);
  for (int m = 0; m < M; ++m) {
    __m512 y[kVectors];
    for (int v = 0; v < kVectors; ++v)
      y[v] = _mm512_cvtepi32_ps(
          _mm512_sub_epi32(__m512i(acc[m][v]), _mm512_loadu_si512(sums + v * 16)));
    store_row(y, scale, row_scales[m], bias, out + m * ldo_bytes, columns, out_f32);
  }
}

// Row m of x (K bf16) -> q + 128 in `quantized` (ld bytes, zero-padded to whole quads) and its
// scale amax / 127, with q = round-half-even(x * (127 / amax)), |q| <= 127. A NaN in the row
// makes its scale NaN (`row_scale_of`), and its q 0.
void quantize_row(const uint16_t* x, int K, int ld, uint8_t* quantized, float* row_scale) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k < 16 ? static_cast<__mmask16>((1u << (K - k)) - 1u) : 0xFFFF;
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + k));
    const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    amax = _mm512_max_ps(_mm512_abs_ps(value), amax);  // max_ps keeps amax over a NaN
  }
  const float top = _mm512_reduce_max_ps(amax);
  // An IEEE division written so that -freciprocal-math cannot turn it into 127 * (1 / top),
  // which may differ in the last bit and so round a q differently from the reference.
  const float inverse =
      top > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), _mm_set_ss(top))) : 0.0f;
  *row_scale = row_scale_of(top, nan != 0);
  const __m512 factor = _mm512_set1_ps(inverse);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k < 16 ? static_cast<__mmask16>((1u << (K - k)) - 1u) : 0xFFFF;
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + k));
    const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), factor);
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(value), offset);
    _mm_mask_storeu_epi8(quantized + k, mask, _mm512_cvtepi32_epi8(q));
  }
  for (int k = K; k < ld; ++k) quantized[k] = 128;  // q = 0 against zero weights
}

// The bf16 tiles' rows: x as it is.
struct Bf16Rows {
  const uint16_t* data;
  int64_t ld;
};

inline Bf16Rows bf16_rows(const uint16_t* x, int64_t ldx, int, int) { return {x, ldx}; }

}  // namespace

#elif defined(FULCRUM_LINEAR_AVX2)
namespace {

constexpr int kVectors = 2;              // ymm vectors of 8 fp32 columns per panel
constexpr int kPanel = 8 * kVectors;     // output columns per packed panel
// Input rows per register tile: 6 rows x 2 vectors are 12 accumulators, and with the step's
// two widened weight vectors, a broadcast row value and the mask, all 16 ymm registers. Tiles
// of 4 rows left the loop bound by its instruction count (a shift and a mask per 4 FMAs); on
// a 2-core Zen 3 EPYC, 6 took a smollm2-135m step's projections 0.89-0.94x the time at 8-512
// rows (benchmarks/results/linear_ab-avx2.md).
constexpr int kRows = 6;
// Each step of a tile's K loop reads one 64-byte line of its panel, and a thread's panels lie
// end to end, so its weights are one stream. The hardware prefetchers alone kept that stream
// below the memory's read rate at decode batch sizes, where the stream is all a step waits
// for; a software prefetch this far ahead (the distance measured best on a Zen 3 EPYC,
// between 1 and 1.5 KiB) closes most of the gap. It never faults, so a panel's last lines may
// point past the weights.
constexpr int kPrefetchBytes = 1280;

// y = acc * scale + bias for one row's `columns` outputs of a panel (its low and high 8
// columns' sums), stored as bf16 or fp32. Not inlined: its column loop inlined into a tile
// of 5 or 6 rows kept GCC (12) from keeping the tile's accumulators in registers.
__attribute__((noinline)) void store_row(__v8sf low, __v8sf high, const float* scale,
                                         float row_scale, const float* bias, void* out,
                                         int columns, bool out_f32) {
  alignas(32) float y[kPanel];
  _mm256_store_ps(y, low);
  _mm256_store_ps(y + 8, high);
  for (int c = 0; c < columns; ++c) {
    const float value = y[c] * ((scale ? scale[c] : 1.0f) * row_scale) + (bias ? bias[c] : 0.f);
    if (out_f32) {
      static_cast<float*>(out)[c] = value;
    } else {
      static_cast<uint16_t*>(out)[c] = fulcrum::float_to_bf16(value);
    }
  }
}

// bf16: a tile of M rows (already widened to fp32, `ldx` floats apart) x one panel. Each
// 32-bit lane of a loaded vector holds one column's (k, k+1) pair: shifted left, k's weight;
// masked, k+1's. One or two rows keep the pair's products in separate accumulators, so the
// FMAs of a step do not wait on each other.
template <int M>
void tile_bf16(const float* x, int64_t ldx, const uint16_t* panel, int pairs,
               const float* bias, char* out, int64_t ldo_bytes, int columns, bool out_f32,
               Ahead ahead) {
  constexpr int kSplit = M <= 2 ? 2 : 1;
  __v8sf acc[M][kVectors][kSplit] = {};
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  k_loop(pairs, ahead, [&](int kp) __attribute__((always_inline)) {
    const __m256i* w = reinterpret_cast<const __m256i*>(panel + int64_t{kp} * kPanel * 2);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    __v8sf b[kVectors];
    for (int v = 0; v < kVectors; ++v)
      b[v] = __v8sf(_mm256_slli_epi32(_mm256_loadu_si256(w + v), 16));
    for (int m = 0; m < M; ++m) {
      const __v8sf a = _mm256_broadcast_ss(x + m * ldx + 2 * kp);
      for (int v = 0; v < kVectors; ++v) acc[m][v][0] = _mm256_fmadd_ps(a, b[v], acc[m][v][0]);
    }
    for (int v = 0; v < kVectors; ++v)
      b[v] = __v8sf(_mm256_and_si256(_mm256_loadu_si256(w + v), high));
    for (int m = 0; m < M; ++m) {
      const __v8sf a = _mm256_broadcast_ss(x + m * ldx + 2 * kp + 1);
      for (int v = 0; v < kVectors; ++v)
        acc[m][v][kSplit - 1] = _mm256_fmadd_ps(a, b[v], acc[m][v][kSplit - 1]);
    }
  });
  // Unrolled, so the accumulators stay registers: left a loop over m, it made GCC keep them
  // in memory too, storing every one on every step of the K loop.
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    __v8sf sum[kVectors];
    for (int v = 0; v < kVectors; ++v)
      sum[v] = kSplit == 2 ? acc[m][v][0] + acc[m][v][kSplit - 1] : acc[m][v][0];
    store_row(sum[0], sum[1], nullptr, 1.0f, bias, out + m * ldo_bytes, columns, out_f32);
  }
}

// int8: quads (k..k+3) of signed row bytes against the panel's signed weight bytes.
// vpmaddubsw takes its first operand unsigned, so it gets |q| and the weights q's signs.
template <int M>
void tile_int8(const uint8_t* x, int64_t ldx, const float* row_scales, const int8_t* panel,
               int quads, const float* scale, const float* bias, char* out, int64_t ldo_bytes,
               int columns, bool out_f32, Ahead ahead) {
  // __v8si, not __m256i, as in the AVX-512 int8 tile: with the may_alias type GCC kept
  // some of a 4-row tile's accumulators in memory
  __v8si acc[M][kVectors];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = __v8si{};
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* rows[M];
  for (int m = 0; m < M; ++m) rows[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  k_loop(quads, ahead, [&](int kq) __attribute__((always_inline)) {
    __m256i b[kVectors];
    const int8_t* w = panel + static_cast<int64_t>(kq) * kPanel * 4;
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    for (int v = 0; v < kVectors; ++v)
      b[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 32));
    for (int m = 0; m < M; ++m) {
      const __m256i a = _mm256_set1_epi32(rows[m][kq]);
      const __m256i magnitude = _mm256_sign_epi8(a, a);
      for (int v = 0; v < kVectors; ++v) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b[v], a));
        acc[m][v] += __v8si(_mm256_madd_epi16(pairs, ones));
      }
    }
  });
#pragma GCC unroll 8  // as in tile_bf16
  for (int m = 0; m < M; ++m) {
    store_row(__v8sf(_mm256_cvtepi32_ps(__m256i(acc[m][0]))),
              __v8sf(_mm256_cvtepi32_ps(__m256i(acc[m][1]))), scale, row_scales[m], bias,
              out + m * ldo_bytes, columns, out_f32);
  }
}

// Row m of x (K bf16) -> q (signed, zero-padded to whole quads) and its scale amax / 127, with
// q = round-half-even(x * (127 / amax)) (the CPU's default rounding), |q| <= 127. A NaN in the
// row makes its scale NaN (`row_scale_of`), and its q 0. Eight lanes at a time: at batch 1 the
// row is quantized on one thread while the others wait for it.
void quantize_row(const uint16_t* x, int K, int ld, uint8_t* quantized, float* row_scale) {
  const int whole = K - K % 8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int k = 0; k < whole; k += 8) {  // |x| first: max_ps keeps amax over a NaN
    const __m256 value = fulcrum::load_bf16x8(x + k);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, value), amax);
  }
  float top = fulcrum::max_of(amax);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int k = whole; k < K; ++k) {
    has_nan |= (x[k] & 0x7FFFu) > 0x7F80u;  // a NaN's bits, either sign
    const float magnitude = std::fabs(fulcrum::bf16_to_float(x[k]));
    top = magnitude > top ? magnitude : top;
  }
  // An IEEE division written so that -freciprocal-math cannot turn it into 127 * (1 / top).
  const float inverse =
      top > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), _mm_set_ss(top))) : 0.0f;
  *row_scale = row_scale_of(top, has_nan);
  const __m256 factor = _mm256_set1_ps(inverse);
  for (int k = 0; k < whole; k += 8) {
    // NaN -> 0, as the scalar tail converts it (the packs below would saturate it to -128)
    const __m256 value = _mm256_mul_ps(fulcrum::load_bf16x8(x + k), factor);
    const __m256i q = _mm256_cvtps_epi32(
        _mm256_and_ps(value, _mm256_cmp_ps(value, value, _CMP_ORD_Q)));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q),
                                          _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(quantized + k), _mm_packs_epi16(words, words));
  }
  for (int k = whole; k < K; ++k)
    quantized[k] = static_cast<uint8_t>(static_cast<int8_t>(
        _mm_cvtss_si32(_mm_set_ss(fulcrum::bf16_to_float(x[k]) * inverse))));
  for (int k = K; k < ld; ++k) quantized[k] = 0;
}

// The bf16 tiles' rows: x's M rows of K bf16 widened to fp32, K floats apart (the tiles
// broadcast single values).
struct Bf16Rows {
  const float* data;
  int64_t ld;
};

Bf16Rows bf16_rows(const uint16_t* x, int64_t ldx, int M, int K) {
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) widened[static_cast<size_t>(m) * K + k] =
        fulcrum::bf16_to_float(x[m * ldx + k]);
  return {widened.data(), K};
}

}  // namespace

#endif

#if defined(FULCRUM_LINEAR_AVX512) || defined(FULCRUM_LINEAR_AVX2)
#include <array>
#include <utility>

namespace {

// The tiles of 1..kRows rows, indexed by the row count (this instruction set's tiles).
template <int... Counts>
constexpr auto bf16_tiles(std::integer_sequence<int, Counts...>) {
  return std::array<decltype(&tile_bf16<1>), kRows + 1>{nullptr, tile_bf16<Counts + 1>...};
}
template <int... Counts>
constexpr auto int8_tiles(std::integer_sequence<int, Counts...>) {
  return std::array<decltype(&tile_int8<1>), kRows + 1>{nullptr, tile_int8<Counts + 1>...};
}
constexpr auto kBf16Tiles = bf16_tiles(std::make_integer_sequence<int, kRows>{});
constexpr auto kInt8Tiles = int8_tiles(std::make_integer_sequence<int, kRows>{});

constexpr int kItemTiles = 16;

// One thread's work items [next, end) in one atomic word, so that the owner's claims from the
// front and a thief's cut from the back can never both take an item. A cache line each: the
// owners' claims would otherwise pass one line back and forth between the cores.
struct alignas(64) Share {
  std::atomic<uint64_t> word{0};

  static uint64_t pack(int64_t next, int64_t end) {
    return static_cast<uint64_t>(next) << 32 | static_cast<uint64_t>(end);
  }
  void assign(int64_t next, int64_t end) { word.store(pack(next, end), std::memory_order_relaxed); }
  bool claim(int64_t& item) {
    uint64_t value = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t next = static_cast<int64_t>(value >> 32), end = value & 0xFFFFFFFFu;
      if (next >= end) return false;
      if (word.compare_exchange_weak(value, pack(next + 1, end), std::memory_order_relaxed)) {
        item = next;
        return true;
      }
    }
  }
};

// A thread out of items takes the back half of the share with most left (its one item, if one
// is left) as its own share, and that share's first item.
bool steal(std::vector<Share>& shares, int thief, int64_t& item) {
  for (;;) {
    int victim = -1;
    int64_t most = 0;
    uint64_t seen = 0;
    for (int v = 0; v < static_cast<int>(shares.size()); ++v) {
      const uint64_t value = shares[v].word.load(std::memory_order_relaxed);
      const int64_t left = static_cast<int64_t>(value & 0xFFFFFFFFu) - (value >> 32);
      if (v != thief && left > most) victim = v, most = left, seen = value;
    }
    if (victim < 0) return false;
    const int64_t next = static_cast<int64_t>(seen >> 32), end = seen & 0xFFFFFFFFu;
    const int64_t cut = end - (most + 1) / 2;
    if (shares[victim].word.compare_exchange_strong(seen, Share::pack(next, cut),
                                                   std::memory_order_relaxed)) {
      shares[thief].assign(cut + 1, end);
      item = cut;
      return true;
    }
  }
}

// Row tiles an item needs before its later tiles fetch the thread's next panel (Ahead).
constexpr int kAheadTiles = 4;

// What row tile `tile` of an item of `tiles` fetches of the next panel (`lines` long): the
// first tile nothing, each later one an equal share.
inline Ahead ahead_share(const char* next_panel, int64_t lines, int tile, int tiles) {
  if (tile == 0) return {};
  const int64_t from = lines * (tile - 1) / (tiles - 1);
  return {next_panel + 64 * from, static_cast<int>(lines * tile / (tiles - 1) - from)};
}

// Every (panel, row tile) pair, panels outermost, so a thread keeps its panel in cache while
// the row tiles pass over it, and a small batch still spreads the panels (each weight read
// once per call) over every core. Each thread starts on an equal contiguous share, one stream
// through the weights; one that runs out takes the back half of another's rest. Measured on
// a 2-core EPYC at batch 1, the two even shares of a call ended ~9% of its time apart on
// average, the first thread done waiting; a stolen half costs one more start of a stream.
// Which thread computes a tile never changes what it computes.
//
// An item's first tile meets its panel in memory, so at a few row tiles per panel (decode
// steps of 32-128 rows) it waits on the memory while the rest of the item computes from
// cache. The tiles after the first each fetch a share of the panel the thread takes next (if
// unstolen) as they compute. On a 2-core Zen 4 EPYC (`benchmarks/linear_ab.py`: a
// smollm2-135m step's projections and LM head, alternating turns) that took bf16 steps of
// 32-128 rows 0.93-0.98x the time and int8 ones 0.98-0.99x, and changed nothing at 512 or
// at 24 rows and fewer; three tiles fetching a whole panel had made 24 rows 1.04x slower,
// hence kAheadTiles. The AVX2 build, run on that CPU, was unchanged (0.99-1.00x at 16-64).
template <typename Run>
void for_tiles(int M, int N, int num_threads, int64_t panel_bytes, const void* panels_start,
               const Run& run) {
  const int panels = (N + kPanel - 1) / kPanel;
  const int row_tiles = (M + kRows - 1) / kRows;
  // An item is up to kItemTiles row tiles of a panel: a claim (an atomic) per item then costs
  // under 1% of its work at prefill sizes too.
  const int groups = (row_tiles + kItemTiles - 1) / kItemTiles;
  const int64_t items = int64_t{panels} * groups;
  std::vector<Share> shares(num_threads);
  for (int t = 0; t < num_threads; ++t)
    shares[t].assign(items * t / num_threads, items * (t + 1) / num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // A smaller team than asked for leaves some shares unowned: they are stolen.
    const int t = omp_get_thread_num();
    int64_t item;
    while (shares[t].claim(item) || steal(shares, t, item)) {
      const int p = static_cast<int>(item / groups), n0 = p * kPanel;
      const int first = static_cast<int>(item % groups) * kItemTiles;
      const int last = first + kItemTiles < row_tiles ? first + kItemTiles : row_tiles;
      const int next = static_cast<int>((item + 1) / groups);
      const bool fetch = last - first >= kAheadTiles && next != p && next < panels;
      const char* next_panel = static_cast<const char*>(panels_start) + next * panel_bytes;
      for (int m0 = first * kRows; m0 < last * kRows; m0 += kRows)
        run(p, m0, M - m0 < kRows ? M - m0 : kRows, n0, N - n0 < kPanel ? N - n0 : kPanel,
            fetch ? ahead_share(next_panel, panel_bytes / 64, m0 / kRows - first, last - first)
                  : Ahead{});
    }
  }
}

}  // namespace

extern "C" {

int fulcrum_linear_bf16_supported() { return 1; }
int fulcrum_linear_bf16_panel() { return kPanel; }
#if defined(FULCRUM_LINEAR_AVX512)
const char* fulcrum_linear_bf16_isa() { return "avx512-bf16"; }
#else
const char* fulcrum_linear_bf16_isa() { return "avx2"; }
#endif

// x: [M, K] bf16 rows with stride ldx; packed: the panels; bias: [N] fp32 or null;
// out: [M, N] (bf16, or fp32 when out_f32) rows with stride ldo. K must be even.
int fulcrum_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed,
                        const float* bias, void* out, int64_t ldo, int M, int N, int K,
                        int out_f32, int num_threads) {
  if (K % 2) return 1;
  const int pairs = K / 2;
  const int64_t panel_size = static_cast<int64_t>(pairs) * kPanel * 2;
  const int64_t item = out_f32 ? 4 : 2;
  char* base = static_cast<char*>(out);
  const Bf16Rows in = bf16_rows(x, ldx, M, K);
  for_tiles(M, N, num_threads, 2 * panel_size, packed,
            [&](int p, int m0, int rows, int n0, int columns, Ahead ahead) {
    kBf16Tiles[rows](in.data + m0 * in.ld, in.ld, packed + p * panel_size, pairs,
                     bias ? bias + n0 : nullptr, base + (m0 * ldo + n0) * item, ldo * item,
                     columns, out_f32 != 0, ahead);
  });
  return 0;
}

// The same with int8 panels (quads of k, each panel ending with its weight sums) and a fp32
// scale per output column ([N], padded to the panels); any K (padded to quads when packed).
int fulcrum_linear_int8(const uint16_t* x, int64_t ldx, const int8_t* packed,
                        const float* scale, const float* bias, void* out, int64_t ldo, int M,
                        int N, int K, int out_f32, int num_threads) {
  const int quads = (K + 3) / 4, ld = quads * 4;
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<float> row_scales;
  quantized.resize(static_cast<size_t>(M) * ld);
  row_scales.resize(M);
  uint8_t* q = quantized.data();
  float* s = row_scales.data();
  // Fewer rows than two tiles are quantized on the calling thread: a team would cost more
  // than their work.
  fulcrum::for_rows(M, num_threads, [&](int m) {
    quantize_row(x + m * ldx, K, ld, q + static_cast<int64_t>(m) * ld, s + m);
  }, 2 * kRows);
  const int64_t panel_size = static_cast<int64_t>(quads) * kPanel * 4 + kPanel * 4;
  const int64_t item = out_f32 ? 4 : 2;
  char* base = static_cast<char*>(out);
  for_tiles(M, N, num_threads, panel_size, packed,
            [&](int p, int m0, int rows, int n0, int columns, Ahead ahead) {
    kInt8Tiles[rows](q + static_cast<int64_t>(m0) * ld, ld, s + m0, packed + p * panel_size,
                     quads, scale + n0, bias ? bias + n0 : nullptr,
                     base + (m0 * ldo + n0) * item, ldo * item, columns, out_f32 != 0, ahead);
  });
  return 0;
}

}  // extern "C"

#else  // neither AVX512-BF16 and VNNI nor AVX2 and FMA: the caller uses torch's matmul

extern "C" {
int fulcrum_linear_bf16_supported() { return 0; }
int fulcrum_linear_bf16_panel() { return 0; }
const char* fulcrum_linear_bf16_isa() { return "none"; }
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
