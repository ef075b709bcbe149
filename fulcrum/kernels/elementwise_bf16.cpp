// The small bf16 operations between the matmuls, each fused into one pass: residual add +
// RMSNorm, SiLU(gate) * up, and rotary embeddings in place.
//
// In torch each is four to eight kernels (casts, pow, mean, rsqrt, cat, ...), about
// 30-45 us apiece at decode batch sizes on this kind of CPU, ~200 us per layer. Here each is
// one loop over rows that computes in fp32 and rounds to bf16 once.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "for_rows.h"
#include "vector_math.h"

namespace {

using fulcrum::bf16_to_float;
using fulcrum::float_to_bf16;

constexpr int kMaxWidth = 16384;

// res (if not null) += in, then o = RMSNorm(res or in) * weight, for one row of `width`
// values (at most kMaxWidth). o may alias in.
inline void norm_row(const uint16_t* in, uint16_t* res, const uint16_t* weight, uint16_t* o,
                     int width, float eps) {
  float values[kMaxWidth];
  float sum = 0.f;
  int i = 0;
#if defined(__AVX512BF16__)
  __m512 squares = _mm512_setzero_ps();
  for (; i < width; i += 16) {
    const __mmask16 mask = fulcrum::tail_mask(i, width);
    __m512 v = fulcrum::load_bf16(in + i, mask);
    if (res) {
      v = fulcrum::round_bf16(_mm512_add_ps(v, fulcrum::load_bf16(res + i, mask)));
      fulcrum::store_bf16(res + i, v, mask);
    }
    _mm512_storeu_ps(values + i, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  sum = _mm512_reduce_add_ps(squares);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 squares = _mm256_setzero_ps();
  for (; i + 8 <= width; i += 8) {
    __m256 v = fulcrum::load_bf16x8(in + i);
    if (res) {
      v = fulcrum::round_bf16x8(_mm256_add_ps(v, fulcrum::load_bf16x8(res + i)));
      fulcrum::store_bf16x8(res + i, v);
    }
    _mm256_storeu_ps(values + i, v);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  sum = fulcrum::sum_of(squares);
#endif
  for (; i < width; ++i) {
    float v = bf16_to_float(in[i]);
    if (res) {
      res[i] = float_to_bf16(v + bf16_to_float(res[i]));
      v = bf16_to_float(res[i]);
    }
    values[i] = v;
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / width + eps);
  i = 0;
#if defined(__AVX512BF16__)
  for (; i < width; i += 16) {
    const __mmask16 mask = fulcrum::tail_mask(i, width);
    const __m512 normed = fulcrum::round_bf16(
        _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, values + i), _mm512_set1_ps(inv)));
    fulcrum::store_bf16(o + i, _mm512_mul_ps(fulcrum::load_bf16(weight + i, mask), normed),
                        mask);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= width; i += 8) {
    const __m256 normed = fulcrum::round_bf16x8(
        _mm256_mul_ps(_mm256_loadu_ps(values + i), _mm256_set1_ps(inv)));
    fulcrum::store_bf16x8(o + i, _mm256_mul_ps(fulcrum::load_bf16x8(weight + i), normed));
  }
#endif
  for (; i < width; ++i)
    o[i] = float_to_bf16(bf16_to_float(weight[i]) *
                         bf16_to_float(float_to_bf16(values[i] * inv)));
}

}  // namespace

extern "C" {

// residual (if not null) += x, then out = RMSNorm(residual or x) * weight, for `rows` rows of
// `width` values with the given row strides. out may alias x.
int fulcrum_rms_norm_bf16(const uint16_t* x, int64_t x_stride, uint16_t* residual,
                          const uint16_t* weight, uint16_t* out, int64_t out_stride, int rows,
                          int width, float eps, int num_threads) {
  if (width > kMaxWidth) return 1;
  fulcrum::for_rows(rows, num_threads, [&](int r) {
    norm_row(x + r * x_stride,
             residual ? residual + static_cast<int64_t>(r) * width : nullptr, weight,
             out + r * out_stride, width, eps);
  });
  return 0;
}

// RMSNorm(head) * weight in place for each of `heads` heads of `head_dim` values, side by side
// in each of `tokens` rows `token_stride` apart (Qwen3's q or k norm, in the fused QKV output):
// the rows RMSNorm computes are not evenly spaced there, so they are found here, one call for
// all of them. Each head's numbers are fulcrum_rms_norm_bf16's on the same values.
int fulcrum_rms_norm_heads_bf16(uint16_t* x, int64_t token_stride, const uint16_t* weight,
                                int tokens, int heads, int head_dim, float eps,
                                int num_threads) {
  if (head_dim > kMaxWidth) return 1;
  fulcrum::for_rows(tokens * heads, num_threads, [&](int r) {
    uint16_t* head = x + (r / heads) * token_stride + static_cast<int64_t>(r % heads) * head_dim;
    norm_row(head, nullptr, weight, head, head_dim, eps);
  });
  return 0;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i].
int fulcrum_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int rows, int width,
                          int num_threads) {
  fulcrum::for_rows(rows, num_threads, [&](int r) {
    const uint16_t* gate = gate_up + static_cast<int64_t>(r) * 2 * width;
    const uint16_t* up = gate + width;
    uint16_t* o = out + static_cast<int64_t>(r) * width;
    int i = 0;
#if defined(__AVX512BF16__)
    // silu(g) = g / (1 + e^-g), rounded to bf16 as torch's F.silu is, then times up.
    for (; i < width; i += 16) {
      const __mmask16 mask = fulcrum::tail_mask(i, width);
      const __m512 g = fulcrum::load_bf16(gate + i, mask);
      const __m512 e = fulcrum::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu =
          fulcrum::round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      fulcrum::store_bf16(o + i, _mm512_mul_ps(silu, fulcrum::load_bf16(up + i, mask)), mask);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= width; i += 8) {
      const __m256 g = fulcrum::load_bf16x8(gate + i);
      const __m256 e = fulcrum::exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 silu =
          fulcrum::round_bf16x8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
      fulcrum::store_bf16x8(o + i, _mm256_mul_ps(silu, fulcrum::load_bf16x8(up + i)));
    }
#endif
    for (; i < width; ++i) {
      const float g = bf16_to_float(gate[i]);
      const float silu = bf16_to_float(float_to_bf16(g / (1.f + std::exp(-g))));
      o[i] = float_to_bf16(silu * bf16_to_float(up[i]));
    }
  });
  return 0;
}

// Rotate-half RoPE in place on `heads` heads of head_dim values per row (q and k heads side
// by side in the fused QKV output), rows `stride` apart; cos/sin: [positions, head_dim] fp32.
int fulcrum_rope_bf16(uint16_t* x, int64_t stride, const int64_t* positions,
                      const float* cos_table, const float* sin_table, int rows, int heads,
                      int head_dim, int num_threads) {
  const int half = head_dim / 2;
  fulcrum::for_rows(rows, num_threads, [&](int r) {
    const float* c = cos_table + positions[r] * head_dim;
    const float* s = sin_table + positions[r] * head_dim;
    for (int h = 0; h < heads; ++h) {
      uint16_t* v = x + r * stride + static_cast<int64_t>(h) * head_dim;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = bf16_to_float(v[i]), b = bf16_to_float(v[i + half]);
        v[i] = float_to_bf16(a * c[i] - b * s[i]);
        v[i + half] = float_to_bf16(b * c[i + half] + a * s[i + half]);
      }
    }
  });
  return 0;
}

}  // extern "C"
