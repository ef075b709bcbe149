// Paged attention for single-token queries (decodes) on CPU.
//
// Reads each key and value once, straight from the block tables, one block at a time with
// an online softmax: no gathered copy of the context is ever made. One work item is one (sequence, KV head)
// pair; the query heads that share that KV head (GQA) are processed together, so each key
// and value loaded serves all of them. Built at first use by fulcrum/kernels/__init__.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 128;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline void load_row(const float* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}

inline void load_row(const uint16_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

inline void store_row(const float* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}

inline void store_row(const float* src, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// Key cache: [blocks, kv_heads, head_dim, block_size], so the keys of one block and head are
// a [head_dim][block_size] tile: a block's scores are head_dim vector FMAs over its tokens.
// Value cache: [blocks, block_size, kv_heads, head_dim], a token's values one contiguous row.
//
// kBlock and kDim are the block size and head size when known at compile time (0: read at
// run time): with constant trip counts the compiler unrolls the short inner loops into a few
// vector instructions, which is most of the kernel's speed.
template <typename Q, typename C, int kBlock, int kDim>
void decode_one(const Q* q, const C* k_cache, const C* v_cache, const int64_t* table,
                int64_t context_len, Q* out, int kv_head, int num_kv_heads, int group,
                int head_dim_arg, int block_size_arg, float scale, int window) {
  const int head_dim = kDim > 0 ? kDim : head_dim_arg;
  const int block_size = kBlock > 0 ? kBlock : block_size_arg;
  float query[kMaxGroup][kMaxHeadDim];
  float acc[kMaxGroup][kMaxHeadDim];
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
  float scores[kMaxGroup][kMaxBlockSize];
  float row[kMaxHeadDim];
  for (int g = 0; g < group; ++g) {
    load_row(q + (kv_head * group + g) * head_dim, query[g], head_dim);
    for (int d = 0; d < head_dim; ++d) {
      query[g][d] *= scale;
      acc[g][d] = 0.f;
    }
    running_max[g] = -1e30f;
    running_sum[g] = 0.f;
  }
  const int64_t k_block_stride = static_cast<int64_t>(num_kv_heads) * head_dim * block_size;
  const int64_t v_token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t start = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  for (int64_t b = start / block_size; b * block_size < context_len; ++b) {
    const int j0 = b == start / block_size ? static_cast<int>(start % block_size) : 0;
    const int j1 = static_cast<int>(std::min<int64_t>(block_size, context_len - b * block_size));
    const C* keys = k_cache + table[b] * k_block_stride +
                    static_cast<int64_t>(kv_head) * head_dim * block_size;
    const C* values = v_cache + table[b] * block_size * v_token_stride +
                      static_cast<int64_t>(kv_head) * head_dim;
    // Scores for the whole block (slots outside [j0, j1) are masked below, never used).
    for (int g = 0; g < group; ++g)
      for (int j = 0; j < block_size; ++j) scores[g][j] = 0.f;
    for (int d = 0; d < head_dim; ++d) {
      load_row(keys + d * block_size, row, block_size);
      for (int g = 0; g < group; ++g) {
        const float qd = query[g][d];
#pragma omp simd
        for (int j = 0; j < block_size; ++j) scores[g][j] += qd * row[j];
      }
    }
    for (int g = 0; g < group; ++g) {
      float tile_max = running_max[g];
      for (int j = 0; j < block_size; ++j) {
        const bool inside = j >= j0 && j < j1;
        scores[g][j] = inside ? scores[g][j] : -1e30f;
        tile_max = std::max(tile_max, scores[g][j]);
      }
      const float correction = std::exp(running_max[g] - tile_max);
      running_max[g] = tile_max;
      float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
      for (int j = 0; j < block_size; ++j) {
        scores[g][j] = std::exp(scores[g][j] - tile_max);
        tile_sum += scores[g][j];
      }
      running_sum[g] = running_sum[g] * correction + tile_sum;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) acc[g][d] *= correction;
    }
    for (int j = j0; j < j1; ++j) {  // only written slots: unwritten values may be NaN
      load_row(values + j * v_token_stride, row, head_dim);
      for (int g = 0; g < group; ++g) {
        const float p = scores[g][j];
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const float inv = 1.f / running_sum[g];
    for (int d = 0; d < head_dim; ++d) acc[g][d] *= inv;
    store_row(acc[g], out + (kv_head * group + g) * head_dim, head_dim);
  }
}

template <typename Q, typename C>
using DecodeFn = void (*)(const Q*, const C*, const C*, const int64_t*, int64_t, Q*, int, int,
                          int, int, int, float, int);

// The common (block size, head size) pairs get specialised code; others the generic one.
template <typename Q, typename C>
DecodeFn<Q, C> pick_decode(int block_size, int head_dim) {
  if (block_size == 16 && head_dim == 64) return decode_one<Q, C, 16, 64>;
  if (block_size == 16 && head_dim == 128) return decode_one<Q, C, 16, 128>;
  if (block_size == 32 && head_dim == 64) return decode_one<Q, C, 32, 64>;
  if (block_size == 32 && head_dim == 128) return decode_one<Q, C, 32, 128>;
  return decode_one<Q, C, 0, 0>;
}

template <typename Q, typename C>
int decode_attention(const Q* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                     const int64_t* context_lens, Q* out, int num_seqs, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, int max_blocks,
                     float scale, int window, int num_threads) {
  const int group = num_heads / num_kv_heads;
  if (group > kMaxGroup || head_dim > kMaxHeadDim || block_size > kMaxBlockSize) return 1;
  const DecodeFn<Q, C> decode = pick_decode<Q, C>(block_size, head_dim);
  const int64_t q_stride = static_cast<int64_t>(num_heads) * head_dim;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
  for (int s = 0; s < num_seqs; ++s) {
    for (int h = 0; h < num_kv_heads; ++h) {
      decode(q + s * q_stride, k_cache, v_cache, tables + static_cast<int64_t>(s) * max_blocks,
             context_lens[s], out + s * q_stride, h, num_kv_heads, group, head_dim,
             block_size, scale, window);
    }
  }
  return 0;
}

}  // namespace

// Entry points: <query and output type>_<cache type>.
#define FULCRUM_DECODE_ENTRY(NAME, Q, C)                                                     \
  int NAME(const Q* q, const C* k, const C* v, const int64_t* tables, const int64_t* lens,  \
           Q* out, int s, int h, int hkv, int d, int bs, int mb, float scale, int window,    \
           int threads) {                                                                   \
    return decode_attention(q, k, v, tables, lens, out, s, h, hkv, d, bs, mb, scale, window, \
                            threads);                                                       \
  }

extern "C" {
FULCRUM_DECODE_ENTRY(paged_decode_attention_f32_f32, float, float)
FULCRUM_DECODE_ENTRY(paged_decode_attention_f32_bf16, float, uint16_t)
FULCRUM_DECODE_ENTRY(paged_decode_attention_bf16_bf16, uint16_t, uint16_t)
}  // extern "C"
