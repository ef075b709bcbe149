// Vector math shared by fulcrum's kernels (AVX-512, or AVX2 with FMA).
#pragma once

namespace fulcrum {

// e^x for x in [-87, 88] (clamped outside): 2^n * 2^f with f in [-0.5, 0.5] and a degree-6
// Taylor polynomial for 2^f (relative error < 2e-7); its coefficients, highest power first.
constexpr float kExp2Taylor[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                  2.4022651e-1f, 6.9314718e-1f, 1.f};

constexpr float kLog2e = 1.44269504f;

// 2^f for f in [-0.5, 0.5] to within 2.8e-6 relative, a degree-4 polynomial fitted for the
// least largest relative error (highest power first): enough for attention's weights, which
// are rounded to bf16 (a relative step of 3.9e-3) next.
constexpr float kExp2Weights[5] = {9.5701013e-3f, 5.5917859e-2f, 2.4024744e-1f,
                                   6.9312179e-1f, 9.9999928e-1f};

}  // namespace fulcrum

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include <cstdint>

namespace fulcrum {

inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^t to kExp2Weights' precision, for any t without a clamp (scalef takes any exponent: 0
// far below, +inf far above); a lane's NaN stays NaN.
inline __m512 exp2_weights(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Weights[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Weights[i]));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values (fewer under `mask`, the rest read as zero) widened to fp32 lanes.
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

#if defined(__AVX512BF16__)
// Round fp32 lanes to bf16 (nearest even, as torch does): packed, or back to fp32 lanes.
inline __m256i to_bf16(__m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  return reinterpret_cast<const __m256i&>(h);
}

inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

inline void store_bf16(uint16_t* p, __m512 x, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, to_bf16(x));
}
#endif

// Lanes [i, i + 16) of a row of `width` values that exist.
inline __mmask16 tail_mask(int i, int width) {
  return width - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - i)) - 1);
}

}  // namespace fulcrum
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace fulcrum {

// exp512's method on 8 lanes: 2^n by building the exponent's bits (n in [-126, 127] after
// the clamp, so no scalef is needed).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[i]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// The largest and the sum of a vector's 8 lanes.
inline float max_of(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum_of(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// 8 bf16 values widened to fp32 lanes.
inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Each lane rounded to bf16 as bf16.h's float_to_bf16 does (nearest even; NaN stays NaN),
// its 16 bits in the lane's low half.
inline __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

inline __m256 round_bf16x8(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
}

inline void store_bf16x8(uint16_t* p, __m256 x) {
  const __m256i bits = bf16_bits(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(
      _mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

}  // namespace fulcrum
#endif
