// Paged attention on CPU, reading keys and values once, straight from the block tables, one
// block at a time with an online softmax: no gathered copy of the context is ever made.
//
// - paged_decode_attention_*: single-token queries (decodes) in any dtype pair; one work
//   item is one (sequence, KV head), the query heads sharing that KV head (GQA) together.
// - paged_varlen_attention_bf16: every query token of a step, decodes and prefill chunks,
//   on bf16 dot-product instructions over a cache stored in their operand layout.
// Built at first use by fulcrum/kernels/__init__.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "bf16.h"
#include "for_rows.h"
#include "vector_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FULCRUM_VARLEN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FULCRUM_VARLEN_AVX2 1
#endif
#if defined(FULCRUM_VARLEN_AVX512) || defined(FULCRUM_VARLEN_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 128;

using fulcrum::bf16_to_float;
using fulcrum::float_to_bf16;

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

constexpr int kMaxVectors = 32;  // query vectors (rows x heads of a group) per work item

// A span's tiles to fetch ahead of their use: up to 4 blocks x (keys, values), `bytes` each.
struct SpanTiles {
  const char* tiles[8];
  int count = 0;
  int64_t bytes = 0;
};

// The tiles of blocks [begin, end) (at most 4) of the sequence with block `table`, for its
// KV heads [kv_head, kv_head + heads), which sit side by side in each block.
template <int kDim>
SpanTiles span_tiles(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                     int num_kv_heads, int kv_head, int heads, int64_t begin, int64_t end) {
  constexpr int64_t kTile = kDim * 16;  // bf16 values of one block and head
  SpanTiles span;
  span.bytes = int64_t{heads} * kTile * 2;
  for (int64_t b = begin; b < end; ++b)
    for (const uint16_t* cache : {k_cache, v_cache})
      span.tiles[span.count++] = reinterpret_cast<const char*>(
          cache + (table[b] * num_kv_heads + kv_head) * kTile);
  return span;
}

// The bf16 cache layouts of the varlen path (fulcrum/attention.py, CpuVarlenAttentionBackend),
// both [blocks, kv_heads, ...] so one block's heads are contiguous:
//   keys   [blocks, kv_heads, head_dim / 2, 16 tokens, 2]: (dim, dim + 1) pairs per token;
//   values [blocks, kv_heads, 8 token pairs, head_dim, 2]: (token, token + 1) pairs per dim.
// Both are the operand order of vdpbf16ps, so the AVX-512 kernel feeds cache lines to it
// unchanged; the AVX2 kernel widens each 32-bit pair to two fp32 lanes (a shift, a mask).
//
// A work item queries `rows` consecutive positions of one sequence for KV heads [kv_head,
// kv_head + heads): row r sees the first `first_len + r` tokens of the context (causal), less
// any sliding window. Each block is read once per work item and serves all its rows x group
// query vectors, so a prefill chunk costs one pass over its context, not one per row; with
// all heads in one item (decodes), a block's bytes are one contiguous read.
//
// With `partial` set, the item covers a piece of its context (a decode split between
// threads): instead of bf16 rows at `out`, it writes each query vector's fp32 output over
// the piece and that piece's log-sum-exp of scores, kDim + 1 floats a vector, which
// `merge_pieces` combines. `after` is the first span of the item the thread will likely take
// next, fetched while the item's own last span runs (which has no next span to fetch).
using AttendFn = void (*)(const uint16_t*, int64_t, int, int64_t, const uint16_t*,
                          const uint16_t*, const int64_t*, uint16_t*, int64_t, int, int, int,
                          int, float, int, float*, const SpanTiles&);

// The first token a row of context length `len` may see (a sliding window's start).
inline int64_t window_start(int64_t len, int window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
}

// Bit j set when token j of 16-token block b is one a row of context length `len` sees.
inline unsigned visible_tokens(int64_t b, int64_t len, int window) {
  const int64_t lo = std::max<int64_t>(window_start(len, window) - b * 16, 0);
  const int64_t hi = std::min<int64_t>(len - b * 16, 16);
  if (hi <= lo) return 0;
  return ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}

#if defined(FULCRUM_VARLEN_AVX512)
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// The next span's tiles, fetched a few lines per step of the score and the value loops alike:
// blocks sit anywhere in the cache, beyond the hardware prefetcher's guess, one burst of the
// whole span (a decode's 768 lines) stalls on the miss buffers, and fetches in the score
// loops alone leave memory idle while the values are summed. Measured on a Zen 4 EPYC
// (`benchmarks/attention_ab.py`), 4 lines a step of both loops, into L2, took decodes 0.83-0.92x
// the time of 8 lines a step of the score loops alone; 3 or 6 lines, or the span after
// next, 0.93-0.99x. Into L1, bursts took 1.2-1.3x.
struct SpanPrefetch {
  static constexpr int kLinesPerStep = 4;
  SpanTiles span;
  int next = 0;
  const char* line = nullptr;
  const char* end = nullptr;

  void step() {
    if (line >= end) {
      if (next == span.count) return;
      line = span.tiles[next++];
      end = line + span.bytes;
    }
    for (int k = 0; k < kLinesPerStep; ++k) _mm_prefetch(line + 64 * k, _MM_HINT_T1);
    line += 64 * kLinesPerStep;
  }
};

// kChunk query vectors' scores against a span of kSpan blocks: kChunk x kSpan independent
// dot-product chains, each broadcast query pair feeding kSpan of them. Its own function, so
// that the chains stay registers: inlined into the kernel, which reads the scores at run-time
// indices, GCC kept them in memory too, a store per dot product (twice the time of a prefill
// chunk, after an unrelated change to the kernel).
template <int kChunk, int kSpan, int kDimPairs>
__attribute__((noinline)) void score_span(const __m512i* const* key_pairs,
                                          const int32_t* const* query,
                                          __m512 (&out)[kChunk][kSpan], SpanPrefetch& ahead) {
  __m512 scores[kChunk][kSpan];
#pragma GCC unroll 4
  for (int c = 0; c < kChunk; ++c)
#pragma GCC unroll 4
    for (int j = 0; j < kSpan; ++j) scores[c][j] = _mm512_setzero_ps();
  for (int dp = 0; dp < kDimPairs; ++dp) {
    ahead.step();
    __m512bh keys[kSpan];
#pragma GCC unroll 4
    for (int j = 0; j < kSpan; ++j) keys[j] = as_bh(_mm512_loadu_si512(key_pairs[j] + dp));
#pragma GCC unroll 4
    for (int c = 0; c < kChunk; ++c) {
      const __m512bh query_pair = as_bh(_mm512_set1_epi32(query[c][dp]));
#pragma GCC unroll 4
      for (int j = 0; j < kSpan; ++j)
        scores[c][j] = _mm512_dpbf16_ps(scores[c][j], query_pair, keys[j]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < kChunk; ++c)
#pragma GCC unroll 4
    for (int j = 0; j < kSpan; ++j) out[c][j] = scores[c][j];
}

// kChunk query vectors' outputs += their weights (bf16 pairs) times a span's value pairs, over
// the token pairs some row sees, read from the cache where they are: `pair_masks` zero the
// unwritten slots (which may hold NaN). Its own function for the reason score_span is:
// inlined, the outputs (read at run-time indices elsewhere) were stored on every token pair.
template <int kChunk, int kSpan, int kVecs>
__attribute__((noinline)) void add_values(__m512 (*acc)[kVecs],
                                          const int32_t (&p_pairs)[kChunk][kSpan][8],
                                          const uint16_t* const* values,
                                          const __mmask32 (&pair_masks)[kSpan][8], int span,
                                          const int* first_pair, const int* end_pair,
                                          SpanPrefetch& ahead) {
  constexpr int kDim = 16 * kVecs;
  __m512 sum[kChunk][kVecs];
#pragma GCC unroll 4
  for (int c = 0; c < kChunk; ++c)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) sum[c][v] = acc[c][v];
  for (int j = 0; j < span; ++j) {
    for (int tp = first_pair[j]; tp < end_pair[j]; ++tp) {
      ahead.step();
#pragma GCC unroll 4
      for (int c = 0; c < kChunk; ++c) {
        const __m512bh weight = as_bh(_mm512_set1_epi32(p_pairs[c][j][tp]));
#pragma GCC unroll 16
        for (int v = 0; v < kVecs; ++v)
          sum[c][v] = _mm512_dpbf16_ps(sum[c][v], weight, as_bh(_mm512_maskz_loadu_epi16(
              pair_masks[j][tp], values[j] + (tp * kDim + 16 * v) * 2)));
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < kChunk; ++c)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) acc[c][v] = sum[c][v];
}

// bf16 queries over a bf16 cache with 16-token blocks: the common serving case, on
// vdpbf16ps (pairs of bf16 products accumulated in fp32). The cache holds keys and values
// as (dim, dim+1) and (token, token+1) pairs, so each query head of the group needs one
// dot-product instruction per 16 scores or 16 output dims. Probabilities are rounded to bf16
// for the value product, as FlashAttention does on GPUs; the softmax itself is fp32.
template <int kDim, int kChunk>
void attend_bf16_block16(const uint16_t* q, int64_t q_row_stride, int rows, int64_t first_len,
                         const uint16_t* k_cache, const uint16_t* v_cache,
                         const int64_t* table, uint16_t* out, int64_t out_row_stride,
                         int kv_head, int heads, int num_kv_heads, int group, float scale,
                         int window, float* partial, const SpanTiles& after) {
  constexpr int kBlock = 16;
  constexpr int kSpan = 4;  // blocks scored together: 64 keys per softmax update
  static_assert(2 * kSpan <= std::size(SpanTiles{}.tiles), "the next span's tiles");
  constexpr int kDimPairs = kDim / 2;
  constexpr int kVecs = kDim / 16;  // fp32 accumulators of one head
  constexpr int kTile = kDim * kBlock;  // bf16 values of one block and head
  const int per_head = rows * group;  // query vectors of one KV head
  const int vectors = heads * per_head;
  // Padded to whole chunks: padding lanes accumulate zeros and are never stored. The sums
  // of the weights stay vectors until the end (one reduction per vector, not per block).
  __m512 acc[kMaxVectors + kChunk][kVecs];
  __m512 running_sum[kMaxVectors + kChunk];
  float running_max[kMaxVectors + kChunk];
  for (int i = 0; i < vectors + kChunk; ++i) {
    for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_setzero_ps();
    running_sum[i] = _mm512_setzero_ps();
    running_max[i] = -1e30f;
  }
  const int64_t last_len = first_len + rows - 1;
  auto block_mask = [&](int64_t b, int64_t len) -> __mmask16 {
    return static_cast<__mmask16>(visible_tokens(b, len, window));
  };
  auto tile = [&](const uint16_t* cache, int64_t b, int h) {
    return cache + (table[b] * num_kv_heads + h) * kTile;
  };
  // Per query vector, fixed for the whole pass: its row and its query's bf16 pairs.
  int row_of[kMaxVectors];
  const int32_t* queries[kMaxVectors];
  for (int i = 0; i < vectors; ++i) {
    const int h = i / per_head, r = i % per_head / group, g = i % group;
    row_of[i] = r;
    queries[i] = reinterpret_cast<const int32_t*>(q + r * q_row_stride +
                                                  ((kv_head + h) * group + g) * kDim);
  }
  const int64_t end_block = (last_len + kBlock - 1) / kBlock;
  __mmask16 row_masks[kSpan][kMaxVectors];
  __mmask32 pair_masks[kSpan][kBlock / 2];
  int first_pair[kSpan], end_pair[kSpan];
  unsigned used[kSpan];
  for (int64_t b0 = window_start(first_len, window) / kBlock; b0 < end_block;
       b0 += kSpan) {
    const int span = static_cast<int>(std::min<int64_t>(kSpan, end_block - b0));
    for (int j = 0; j < kSpan; ++j) {
      used[j] = 0;
      if (j < span) {
        used[j] = block_mask(b0 + j, last_len) | block_mask(b0 + j, first_len);
        for (int r = 0; r < rows; ++r) row_masks[j][r] = block_mask(b0 + j, first_len + r);
      } else {
        for (int r = 0; r < rows; ++r) row_masks[j][r] = 0;
      }
      // Token pairs that some row sees; slots outside may be unwritten (NaN), so their
      // values are loaded as zeros.
      first_pair[j] = used[j] ? __builtin_ctz(used[j]) / 2 : 0;
      end_pair[j] = used[j] ? (16 - __builtin_clz(used[j] << 16) + 1) / 2 : 0;
      for (int tp = first_pair[j]; tp < end_pair[j]; ++tp) {
        const unsigned pair = (used[j] >> (2 * tp)) & 3u;
        pair_masks[j][tp] = (pair & 1u ? 0x55555555u : 0u) | (pair & 2u ? 0xAAAAAAAAu : 0u);
      }
    }
    SpanPrefetch ahead;
    ahead.span = b0 + kSpan < end_block
        ? span_tiles<kDim>(k_cache, v_cache, table, num_kv_heads, kv_head, heads, b0 + kSpan,
                           std::min<int64_t>(b0 + 2 * kSpan, end_block))
        : after;
    for (int h = 0; h < heads; ++h) {
      const __m512i* key_pairs[kSpan];
      const uint16_t* values[kSpan];
      for (int j = 0; j < kSpan; ++j) {
        // A span's missing blocks score the first block again, masked out below.
        key_pairs[j] = reinterpret_cast<const __m512i*>(
            tile(k_cache, b0 + (j < span ? j : 0), kv_head + h));
        values[j] = tile(v_cache, b0 + (j < span ? j : 0), kv_head + h);
      }
      // Query vectors kChunk at a time against the span's kSpan blocks: kChunk x kSpan
      // independent dot-product chains, and each broadcast query pair feeds kSpan of them.
      const int head_end = (h + 1) * per_head;
      for (int i0 = h * per_head; i0 < head_end; i0 += kChunk) {
        __mmask16 valid[kChunk][kSpan];
        const int32_t* query[kChunk];
        __m512 scores[kChunk][kSpan];
        __mmask16 any_valid = 0;
        for (int c = 0; c < kChunk; ++c) {
          const int i = std::min(i0 + c, head_end - 1);
          query[c] = queries[i];
          for (int j = 0; j < kSpan; ++j) {
            valid[c][j] = i0 + c < head_end ? row_masks[j][row_of[i]] : 0;
            any_valid |= valid[c][j];
          }
        }
        if (!any_valid) continue;
        score_span<kChunk, kSpan, kDimPairs>(key_pairs, query, scores, ahead);
        alignas(64) int32_t p_pairs[kChunk][kSpan][kBlock / 2];
        // The chunk's maxima first, then its kChunk x kSpan exponentials together: a
        // vector's own (a maximum, exponentials, a sum) is one long dependent chain, and the
        // others' fill its gaps. Scores stay unscaled: with scale > 0 the largest is the
        // largest scaled one, and the scale joins the exponent's multiplier.
        float tile_max[kChunk];
        for (int c = 0; c < kChunk; ++c) {
          __m512 span_max = _mm512_set1_ps(-1e30f);
          for (int j = 0; j < kSpan; ++j)
            span_max = _mm512_mask_max_ps(span_max, valid[c][j], span_max, scores[c][j]);
          tile_max[c] = std::max(running_max[i0 + c], _mm512_reduce_max_ps(span_max));
        }
        const __m512 log2e_scale = _mm512_set1_ps(scale * fulcrum::kLog2e);
        __m512 span_sum[kChunk];
        for (int c = 0; c < kChunk; ++c) {
          span_sum[c] = _mm512_setzero_ps();
          const __m512 shift = _mm512_set1_ps(-tile_max[c] * scale * fulcrum::kLog2e);
          for (int j = 0; j < kSpan; ++j) {
            // Lanes outside `valid` (unwritten slots, padding) may be NaN or huge: zeroed.
            const __m512 p = _mm512_maskz_mov_ps(valid[c][j], fulcrum::exp2_weights(
                _mm512_fmadd_ps(scores[c][j], log2e_scale, shift)));
            const __m256bh p_bf16 = _mm512_cvtneps_pbh(p);
            std::memcpy(p_pairs[c][j], &p_bf16, sizeof p_pairs[c][j]);
            // The sum of the rounded weights, so the output stays their exact average.
            span_sum[c] = _mm512_add_ps(span_sum[c], _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(p_bf16)), 16)));
          }
        }
        for (int c = 0; c < kChunk; ++c) {
          const int i = i0 + c;  // >= head_end: a padding lane, its weights all 0
          if (tile_max[c] > running_max[i]) {
            // In registers: a call to libm's exp would spill every live vector register.
            const __m512 corr = fulcrum::exp2_weights(_mm512_set1_ps(
                (running_max[i] - tile_max[c]) * scale * fulcrum::kLog2e));
            for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_mul_ps(acc[i][v], corr);
            running_sum[i] = _mm512_mul_ps(running_sum[i], corr);
            running_max[i] = tile_max[c];
          }
          running_sum[i] = _mm512_add_ps(running_sum[i], span_sum[c]);
        }
        add_values<kChunk, kSpan, kVecs>(acc + i0, p_pairs, values, pair_masks, span,
                                         first_pair, end_pair, ahead);
      }
    }
  }
  for (int i = 0; i < vectors; ++i) {
    const int h = i / per_head, r = i % per_head / group, g = i % group;
    const float sum = _mm512_reduce_add_ps(running_sum[i]);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    if (partial) {
      float* piece = partial + i * (kDim + 1);
      for (int v = 0; v < kVecs; ++v)
        _mm512_storeu_ps(piece + 16 * v, _mm512_mul_ps(acc[i][v], inv));
      piece[kDim] = running_max[i] * scale + std::log(sum);
      continue;
    }
    uint16_t* o = out + r * out_row_stride + ((kv_head + h) * group + g) * kDim;
    for (int v = 0; v < kVecs; ++v) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][v], inv));
      std::memcpy(o + 16 * v, &y, sizeof y);
    }
  }
}

// A decode has `group` vectors per head: chunks of 3 waste no lane when 3 divides it.
template <int kDim>
AttendFn pick_attend(int rows, int group) {
  return rows == 1 && group % 3 == 0 ? attend_bf16_block16<kDim, 3>
                                     : attend_bf16_block16<kDim, 4>;
}

#elif defined(FULCRUM_VARLEN_AVX2)
// All-ones lanes where `bits` has the lane's bit (`lane_bits`: one distinct bit per lane).
inline __m256 lanes(unsigned bits, __m256i lane_bits) {
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(
      _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bits), lane_bits));
}

// A 32-bit lane's (low, high) bf16 pair widened to fp32: the low value (a shift), the high
// one (a mask).
inline __m256 low_halves(__m256i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline __m256 high_halves(__m256i bits) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// A decode's next block (or a prefill chunk's, which serves all its rows) is fetched as the
// block is read: blocks sit anywhere in the cache, beyond the hardware prefetcher's guess,
// and bursts overflow the miss buffers. Each head's first chunk fetches the head's tiles of
// the next block, a key line per step of its score loop (kDim / 2 steps, kDim / 2 lines) and
// a value line per value pair it reads (kGroup / 2 a step of its value loop), so every step
// fetches what it reads, and with no test in the loops (split by hand) that a step does.
// On a Zen 3 EPYC (`benchmarks/attention_ab.py`), against a cursor stepped in every loop
// (a test a step) which itself had taken prefill chunks 0.80-0.87x and decodes from memory
// 0.89-0.99x the time of a loop alternating between the tiles: decodes 0.97-0.99x from
// memory, 0.89-0.95x with their cache in L2 or L3, prefill chunks 0.94x (both changes
// together: benchmarks/results/attention_ab-avx2.md as of ce84012). Fetching the block after
// next instead: 1.02-1.05x.

// kChunk query vectors' outputs (rows of `acc`) rescaled by their `correction`, plus their
// weights `p` times a block's widened value pairs, over the token pairs some row sees
// (`keep` zeroes the unwritten slots' halves, which may hold NaN). kGroup output vectors of
// each query vector stay in registers over the block's token pairs. Its own function, so
// that they do (as for the AVX-512 kernel's add_values). kFull: every token pair is written
// and seen (no `keep`, no test); kFetch: each token pair fetches kGroup / 2 lines at `fetch`.
template <int kChunk, int kGroup, int kVecs, bool kFull, bool kFetch>
__attribute__((noinline)) void add_values_avx2(float (*acc)[kVecs * 8],
                                               const float (*p)[16], const float* correction,
                                               const uint16_t* values, const __m256i* keep,
                                               unsigned used, const char* fetch) {
  for (int v0 = 0; v0 < kVecs; v0 += kGroup) {
    __m256 sum[kChunk][kGroup];
    for (int c = 0; c < kChunk; ++c)
      for (int v = 0; v < kGroup; ++v)
        sum[c][v] = _mm256_mul_ps(_mm256_load_ps(acc[c] + 8 * (v0 + v)),
                                  _mm256_set1_ps(correction[c]));
    for (int tp = 0; tp < 8; ++tp) {
      if constexpr (kFetch)
        for (int f = 0; f < kGroup / 2; ++f, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T0);
      if (!kFull && !(used >> (2 * tp) & 3u)) continue;
      const uint16_t* pairs = values + tp * kVecs * 8 * 2;
      for (int v = 0; v < kGroup; ++v) {
        __m256i bits = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(pairs + 16 * (v0 + v)));
        if (!kFull) bits = _mm256_and_si256(keep[tp], bits);
        const __m256 even = low_halves(bits), odd = high_halves(bits);
        for (int c = 0; c < kChunk; ++c) {
          sum[c][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[c][2 * tp]), even, sum[c][v]);
          sum[c][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[c][2 * tp + 1]), odd, sum[c][v]);
        }
      }
    }
    for (int c = 0; c < kChunk; ++c)
      for (int v = 0; v < kGroup; ++v) _mm256_store_ps(acc[c] + 8 * (v0 + v), sum[c][v]);
  }
}

// The same contract on AVX2 and FMA, in fp32: each query vector takes a block's 16 scores as
// two vectors of 8 tokens, the keys' (dim, dim + 1) pairs widened in registers; then its
// exact (fp32) weights times the values' widened (token, token + 1) pairs. kChunk query
// vectors go together through both: each widened key pair feeds 4 x kChunk independent FMA
// chains, and each widened value pair 2 x kChunk, so a widening (a shift, a mask) is paid
// once per chunk, not per vector. Chunks of 3 (a GQA group of 3, or 6: 12 score chains, all
// used) fill the 16 ymm registers; chunks of 2 leave less to waste on a last partial chunk.
template <int kDim, int kChunk>
void attend_chunks_avx2(const uint16_t* q, int64_t q_row_stride, int rows, int64_t first_len,
                        const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                        uint16_t* out, int64_t out_row_stride, int kv_head, int heads,
                        int num_kv_heads, int group, float scale, int window, float* partial,
                        const SpanTiles& after) {
  constexpr int kBlock = 16;
  constexpr int kVecs = kDim / 8;
  constexpr int kTile = kDim * kBlock;
  // Output vectors of a chunk summed at once: kChunk x kGroup accumulators in registers
  // (with 3 x 4 of them, GCC spilled some).
  constexpr int kGroup = kChunk == 3 ? 2 : 4;
  static_assert(kVecs % kGroup == 0, "whole groups of output vectors");
  const int per_head = rows * group;
  const int vectors = heads * per_head;
  // Padded to whole chunks: a padding vector is scored (zeros) and weighted 0, never stored.
  alignas(32) float query[kMaxVectors + kChunk][kDim];
  alignas(32) float acc[kMaxVectors + kChunk][kDim];
  float running_max[kMaxVectors + kChunk], running_sum[kMaxVectors + kChunk];
  // A block's scores, then weights, of every query vector, and their softmax updates (the
  // rescale factors are computed eight at a time from a head's first vector: room for 7 more).
  constexpr int kSlots = kMaxVectors + kChunk + 7;
  alignas(32) float p[kSlots][kBlock];
  float shift[kSlots] = {}, correction[kSlots], block_sum[kSlots];
  int row_of[kMaxVectors + kChunk];
  for (int i = 0; i < vectors; ++i) {
    const int h = i / per_head, r = i % per_head / group, g = i % group;
    row_of[i] = r;
    const uint16_t* source = q + r * q_row_stride + ((kv_head + h) * group + g) * kDim;
    for (int d = 0; d < kDim; ++d) query[i][d] = bf16_to_float(source[d]) * scale;
  }
  for (int i = 0; i < vectors + kChunk; ++i) {
    if (i >= vectors) std::memset(query[i], 0, sizeof query[i]);
    std::memset(acc[i], 0, sizeof acc[i]);
    running_max[i] = -1e30f;
    running_sum[i] = 0.f;
  }
  const __m256i low_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i high_bits = _mm256_slli_epi32(low_bits, 8);
  const __m256 floor = _mm256_set1_ps(-1e30f);
  const int64_t last_len = first_len + rows - 1;
  const int64_t end_block = (last_len + kBlock - 1) / kBlock;
  for (int64_t b = window_start(first_len, window) / kBlock; b < end_block; ++b) {
    const unsigned used = visible_tokens(b, last_len, window) |
                          visible_tokens(b, first_len, window);
    if (!used) continue;
    // Per token pair, the halves to keep: unwritten slots may hold NaN, and 0 * NaN is NaN.
    __m256i keep[kBlock / 2];
    for (int tp = 0; tp < kBlock / 2; ++tp)
      keep[tp] = _mm256_set1_epi32(static_cast<int>((used >> (2 * tp) & 1u ? 0xFFFFu : 0u) |
                                                    (used >> (2 * tp) & 2u ? 0xFFFF0000u : 0u)));
    const bool all_used = used == 0xFFFFu;
    // The last block fetches the first of the item the thread likely takes next (`after`).
    const char *next_keys = nullptr, *next_values = nullptr;
    int next_heads = 0;
    if (b + 1 < end_block) {
      const int64_t next = (table[b + 1] * num_kv_heads + kv_head) * kTile;
      next_keys = reinterpret_cast<const char*>(k_cache + next);
      next_values = reinterpret_cast<const char*>(v_cache + next);
      next_heads = heads;
    } else if (after.count >= 2) {
      next_keys = after.tiles[0];
      next_values = after.tiles[1];
      next_heads = static_cast<int>(after.bytes / (kTile * 2));
    }
    for (int h = 0; h < heads; ++h) {
      const int64_t offset = (table[b] * num_kv_heads + kv_head + h) * kTile;
      const __m256i* keys = reinterpret_cast<const __m256i*>(k_cache + offset);
      const uint16_t* values = v_cache + offset;
      // The head's vectors [first, last), its chunks' slots up to `end` (past `last`: the
      // next head's first vectors, or padding, weighted 0 here).
      const int first = h * per_head, last = first + per_head;
      const int end = first + (per_head + kChunk - 1) / kChunk * kChunk;
      // A head's first chunk fetches the head's tiles of the next block.
      const bool fetch_head = h < next_heads;
      const int64_t tile_bytes = int64_t{h} * kTile * 2;
      // Three passes over the head's chunks: their scores, then each vector's softmax
      // update, then their value products. An update is a long dependent chain (a maximum,
      // exponentials, a sum) that the value products wait for: the chains of a prefill
      // tile's 30 vectors overlap when done together, where one chunk's three could not
      // hide theirs between its scores and its values (on a Zen 3 EPYC, prefill chunks
      // 0.90-0.93x the time: benchmarks/results/attention_ab-avx2.md). A decode's head is
      // one chunk, its order as before: passes over all the heads at once made decodes from
      // memory 1.07-1.19x slower (0.96x with their cache in L2; why, not established).
      for (int i0 = first; i0 < last; i0 += kChunk) {
        // [vector][tokens 0-7, 8-15][dim even, odd]
        __m256 scores[kChunk][2][2];
        for (int c = 0; c < kChunk; ++c)
          for (int half = 0; half < 2; ++half)
            scores[c][half][0] = scores[c][half][1] = _mm256_setzero_ps();
        const auto score_step = [&](int dp) __attribute__((always_inline)) {
          // The key pairs loaded again for the high halves: the chunk's 12 chains, two
          // widened keys and a broadcast take every register.
          for (int parity = 0; parity < 2; ++parity) {
            const __m256i lo = _mm256_loadu_si256(keys + 2 * dp);
            const __m256i hi = _mm256_loadu_si256(keys + 2 * dp + 1);
            const __m256 k_lo = parity ? high_halves(lo) : low_halves(lo);
            const __m256 k_hi = parity ? high_halves(hi) : low_halves(hi);
            for (int c = 0; c < kChunk; ++c) {
              const __m256 qd = _mm256_broadcast_ss(&query[i0 + c][2 * dp + parity]);
              scores[c][0][parity] = _mm256_fmadd_ps(qd, k_lo, scores[c][0][parity]);
              scores[c][1][parity] = _mm256_fmadd_ps(qd, k_hi, scores[c][1][parity]);
            }
          }
        };
        if (fetch_head && i0 == first) {
          for (int dp = 0; dp < kDim / 2; ++dp) {
            _mm_prefetch(next_keys + tile_bytes + 64 * dp, _MM_HINT_T0);
            score_step(dp);
          }
        } else {
          for (int dp = 0; dp < kDim / 2; ++dp) score_step(dp);
        }
        // Summed at constant indices, so the accumulators stay registers: read at run-time
        // indices, GCC kept them in memory, a store per FMA.
#pragma GCC unroll 4
        for (int c = 0; c < kChunk; ++c)
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half)
            _mm256_store_ps(p[i0 + c] + 8 * half,
                            _mm256_add_ps(scores[c][half][0], scores[c][half][1]));
      }
      // Scores become weights in place (a vector its row does not see in this block, or a
      // slot past the head's vectors, gets weights 0 and a rescale of 1).
      for (int i = first; i < end; ++i) {
        const unsigned visible =
            i < last ? visible_tokens(b, first_len + row_of[i], window) : 0u;
        if (!visible) {
          std::memset(p[i], 0, sizeof p[i]);
          shift[i] = block_sum[i] = 0.f;
          continue;
        }
        __m256 s[2] = {_mm256_load_ps(p[i]), _mm256_load_ps(p[i] + 8)};
        const bool full = visible == 0xFFFFu;  // no mask: most blocks of a prefill
        __m256 seen[2];
        if (!full) {
          seen[0] = lanes(visible, low_bits);
          seen[1] = lanes(visible, high_bits);
          for (int half = 0; half < 2; ++half)
            s[half] = _mm256_blendv_ps(floor, s[half], seen[half]);
        }
        const float tile_max =
            std::max(running_max[i], fulcrum::max_of(_mm256_max_ps(s[0], s[1])));
        shift[i] = running_max[i] - tile_max;
        running_max[i] = tile_max;
        __m256 total = _mm256_setzero_ps();
        for (int half = 0; half < 2; ++half) {
          __m256 weight = fulcrum::exp256(_mm256_sub_ps(s[half], _mm256_set1_ps(tile_max)));
          if (!full) weight = _mm256_and_ps(weight, seen[half]);
          _mm256_store_ps(p[i] + 8 * half, weight);
          total = _mm256_add_ps(total, weight);
        }
        block_sum[i] = fulcrum::sum_of(total);
      }
      // The rescale factors eight at a time in one vector exponential: a call to libm's
      // would spill every vector register. (Its clamp at e^-87 leaves a first block's
      // factor above 0, but what that factor scales is still all zeros.)
      for (int i = first; i < end; i += 8)
        _mm256_storeu_ps(correction + i, fulcrum::exp256(_mm256_loadu_ps(shift + i)));
      for (int i = first; i < last; ++i)
        running_sum[i] = running_sum[i] * correction[i] + block_sum[i];
      for (int i0 = first; i0 < last; i0 += kChunk) {
        const char* value_fetch =
            fetch_head && i0 == first ? next_values + tile_bytes : nullptr;
        // Direct calls: through a table of the four, decodes took 1.01-1.04x the time.
        if (all_used && value_fetch)
          add_values_avx2<kChunk, kGroup, kVecs, true, true>(acc + i0, p + i0, correction + i0,
                                                             values, keep, used, value_fetch);
        else if (all_used)
          add_values_avx2<kChunk, kGroup, kVecs, true, false>(acc + i0, p + i0, correction + i0,
                                                              values, keep, used, value_fetch);
        else if (value_fetch)
          add_values_avx2<kChunk, kGroup, kVecs, false, true>(acc + i0, p + i0, correction + i0,
                                                              values, keep, used, value_fetch);
        else
          add_values_avx2<kChunk, kGroup, kVecs, false, false>(acc + i0, p + i0, correction + i0,
                                                               values, keep, used, value_fetch);
      }
    }
  }
  for (int i = 0; i < vectors; ++i) {
    const int h = i / per_head, r = i % per_head / group, g = i % group;
    const float inv = 1.f / running_sum[i];
    if (partial) {
      float* piece = partial + i * (kDim + 1);
      for (int d = 0; d < kDim; ++d) piece[d] = acc[i][d] * inv;
      piece[kDim] = running_max[i] + std::log(running_sum[i]);
      continue;
    }
    uint16_t* o = out + r * out_row_stride + ((kv_head + h) * group + g) * kDim;
    for (int d = 0; d < kDim; ++d) o[d] = float_to_bf16(acc[i][d] * inv);
  }
}

template <int kDim>
AttendFn pick_attend(int, int group) {
  return group % 3 == 0 ? attend_chunks_avx2<kDim, 3> : attend_chunks_avx2<kDim, 2>;
}
#endif

#if defined(FULCRUM_VARLEN_AVX512) || defined(FULCRUM_VARLEN_AVX2)
// A decode's context is split between threads only into pieces of at least this many
// tokens: on a Zen 3 EPYC (AVX2), two 64-token pieces took as long as the whole context on
// one thread plus its heads' share on the other, and longer pieces less.
constexpr int64_t kMinPieceTokens = 64;

// One work item: `rows` query rows from `row` for KV heads [kv_head, kv_head + heads), the
// first row seeing `first_len` tokens (less `window`); `partial` >= 0: a piece of a split
// decode, written to that slot of the pieces' scratch.
struct AttendItem {
  int seq;
  int64_t row;
  int kv_head, heads;
  int64_t first_len;
  int window, partial;
};

// A scratch slot: a piece's kDim + 1 floats for each of an item's query vectors.
template <int kDim>
constexpr int64_t kPieceSlot = kMaxVectors * (kDim + 1);

// A decode split into `pieces` items, in consecutive scratch slots from `first`.
struct SplitDecode {
  int64_t row;
  int kv_head, heads, first, pieces;
};

// Flash-decoding's reduction: each query vector's pieces weighed by their share of the
// softmax's denominator, exp(lse_p - max lse).
template <int kDim>
void merge_pieces(const SplitDecode& split, const float* scratch, int group,
                  uint16_t* out, int64_t out_stride) {
  for (int i = 0; i < split.heads * group; ++i) {
    auto piece = [&](int p) {
      return scratch + (split.first + p) * kPieceSlot<kDim> + i * (kDim + 1);
    };
    float top = piece(0)[kDim];
    for (int p = 1; p < split.pieces; ++p) top = std::max(top, piece(p)[kDim]);
    float merged[kDim] = {}, total = 0.f;
    for (int p = 0; p < split.pieces; ++p) {
      const float weight = std::exp(piece(p)[kDim] - top);
      total += weight;
      for (int d = 0; d < kDim; ++d) merged[d] += weight * piece(p)[d];
    }
    uint16_t* o = out + split.row * out_stride + (split.kv_head * group + i) * kDim;
    for (int d = 0; d < kDim; ++d) o[d] = float_to_bf16(merged[d] / total);
  }
}

// The tiles of an item of `rows` query rows: its first span (up to 4 blocks), keys and values.
template <int kDim>
SpanTiles first_span(const AttendItem& item, int rows, const int64_t* tables, int max_blocks,
                     const uint16_t* k_cache, const uint16_t* v_cache, int num_kv_heads) {
  const int64_t begin = window_start(item.first_len, item.window) / 16;
  return span_tiles<kDim>(k_cache, v_cache, tables + static_cast<int64_t>(item.seq) * max_blocks,
                          num_kv_heads, item.kv_head, item.heads, begin,
                          std::min<int64_t>((item.first_len + rows - 1 + 15) / 16, begin + 4));
}

template <int kDim>
int varlen_bf16_block16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                        const uint16_t* v_cache, const int64_t* tables,
                        const int64_t* query_start, const int64_t* seq_lens, uint16_t* out,
                        int num_seqs, int num_heads, int num_kv_heads, int max_blocks,
                        float scale, int window, int num_threads) {
  const int group = num_heads / num_kv_heads;
  if (group > kMaxVectors) return 1;
  const int tile_rows = kMaxVectors / group;
  // Work items: a single-token query (a decode) takes its KV heads together when they fit,
  // so each cache block is one contiguous read; a prefill chunk is cut into tiles of rows,
  // one item per tile and KV head. With fewer items than threads (a lone decode), a decode
  // is split between threads too, or all but one would idle: its context into pieces
  // (flash-decoding; each piece reads its blocks once, for all heads) where the context is
  // long enough, else its heads.
  int decodes = 0, prefill_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int64_t rows = query_start[s + 1] - query_start[s];
    if (rows == 1) ++decodes;
    else prefill_items += static_cast<int>((rows + tile_rows - 1) / tile_rows) * num_kv_heads;
  }
  const int decode_heads = group * num_kv_heads <= kMaxVectors ? num_kv_heads : 1;
  const int head_items = (num_kv_heads + decode_heads - 1) / decode_heads;
  // Items each decode should become for every thread to have one.
  int wanted = 1;
  if (decodes > 0 && decodes * head_items + prefill_items < num_threads)
    wanted = (num_threads - prefill_items) / decodes;
  std::vector<AttendItem> items;
  std::vector<SplitDecode> splits;
  int slots = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int64_t row = query_start[s], len = seq_lens[s];
    if (query_start[s + 1] - row > 1) {
      // Row r is query number r - row of the sequence's new tokens.
      for (int64_t r = row; r < query_start[s + 1]; r += tile_rows)
        for (int h = 0; h < num_kv_heads; ++h)
          items.push_back({s, r, h, 1, len - (query_start[s + 1] - r) + 1, window, -1});
      continue;
    }
    const int64_t begin = window_start(len, window);
    const int pieces = static_cast<int>(std::min<int64_t>(
        (wanted + head_items - 1) / head_items, (len - begin) / kMinPieceTokens));
    if (pieces < 2) {  // whole context; with a short one, heads apart if threads would idle
      const int heads = std::min(decode_heads, (num_kv_heads + wanted - 1) / wanted);
      for (int h = 0; h < num_kv_heads; h += heads)
        items.push_back({s, row, h, std::min(heads, num_kv_heads - h), len, window, -1});
      continue;
    }
    // Pieces of whole 16-token blocks (the first may start inside one, at a window's edge).
    const int64_t first_block = begin / 16, blocks = (len + 15) / 16 - first_block;
    for (int h = 0; h < num_kv_heads; h += decode_heads) {
      const int heads = std::min(decode_heads, num_kv_heads - h);
      splits.push_back({row, h, heads, slots, pieces});
      for (int p = 0; p < pieces; ++p) {
        const int64_t lo = std::max(begin, (first_block + blocks * p / pieces) * 16);
        const int64_t hi = std::min(len, (first_block + blocks * (p + 1) / pieces) * 16);
        items.push_back({s, row, h, heads, hi, static_cast<int>(hi - lo), slots++});
      }
    }
  }
  std::vector<float> scratch(slots * kPieceSlot<kDim>);
  const int64_t out_stride = static_cast<int64_t>(num_heads) * kDim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (size_t index = 0; index < items.size(); ++index) {
    const AttendItem& item = items[index];
    auto rows_of = [&](const AttendItem& it) {
      return static_cast<int>(std::min<int64_t>(tile_rows, query_start[it.seq + 1] - it.row));
    };
    const int rows = rows_of(item);
    float* partial = item.partial < 0 ? nullptr : scratch.data() + item.partial * kPieceSlot<kDim>;
    const size_t guess = index + num_threads;  // the item this thread takes next, if alike
    const SpanTiles after = guess < items.size()
        ? first_span<kDim>(items[guess], rows_of(items[guess]), tables, max_blocks, k_cache,
                           v_cache, num_kv_heads) : SpanTiles{};
    pick_attend<kDim>(rows, group)(
        q + item.row * q_stride, q_stride, rows, item.first_len, k_cache, v_cache,
        tables + static_cast<int64_t>(item.seq) * max_blocks, out + item.row * out_stride,
        out_stride, item.kv_head, item.heads, num_kv_heads, group, scale, item.window,
        partial, after);
  }
  for (const SplitDecode& split : splits)
    merge_pieces<kDim>(split, scratch.data(), group, out, out_stride);
  return 0;
}
#endif

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

// Store a step's new keys and values (bf16, [tokens, kv_heads, head_dim] rows `k_stride` and
// `v_stride` apart, e.g. views into the fused QKV output) at their cache slots, in the pair
// layouts of paged_varlen_attention_bf16 (16-token blocks).
int paged_write_kv_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v,
                        int64_t v_stride, uint16_t* k_cache, uint16_t* v_cache,
                        const int64_t* slots, int num_tokens, int num_kv_heads, int head_dim,
                        int num_threads) {
  constexpr int kBlock = 16;
  const int64_t tile = static_cast<int64_t>(head_dim) * kBlock;
  fulcrum::for_rows(num_tokens, num_threads, [&](int t) {
    const int64_t block = slots[t] / kBlock, offset = slots[t] % kBlock;
    for (int h = 0; h < num_kv_heads; ++h) {
      const uint16_t* key = k + t * k_stride + h * head_dim;
      const uint16_t* value = v + t * v_stride + h * head_dim;
      uint16_t* keys = k_cache + (block * num_kv_heads + h) * tile;
      uint16_t* values = v_cache + (block * num_kv_heads + h) * tile +
                         (offset / 2) * head_dim * 2 + offset % 2;
      for (int d = 0; d < head_dim; ++d) {
        keys[(d / 2) * kBlock * 2 + offset * 2 + d % 2] = key[d];
        values[d * 2] = value[d];
      }
    }
  });
  return 0;
}

int paged_varlen_attention_bf16_supported() {
#if defined(FULCRUM_VARLEN_AVX512) || defined(FULCRUM_VARLEN_AVX2)
  return 1;
#else
  return 0;
#endif
}

// Every query token of a step (decodes and prefill chunks alike) over the paged cache:
// sequence s owns query rows [query_start[s], query_start[s + 1]), the newest tokens of its
// seq_lens[s]-token context. Query rows are q_stride values apart (each row's heads side by
// side, so a view into the fused QKV output serves); the output's rows are contiguous. bf16
// queries and cache, 16-token blocks, head size 64 or 128, scale > 0 (the softmax takes a
// row's largest unscaled score as its largest scaled one); returns nonzero for any other
// case, which the caller then routes elsewhere.
int paged_varlen_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                                const uint16_t* v, const int64_t* tables,
                                const int64_t* query_start, const int64_t* seq_lens,
                                uint16_t* out, int num_seqs, int num_heads, int num_kv_heads,
                                int head_dim, int block_size, int max_blocks, float scale,
                                int window, int num_threads) {
#if defined(FULCRUM_VARLEN_AVX512) || defined(FULCRUM_VARLEN_AVX2)
  if (!(scale > 0.f)) return 1;
  if (block_size == 16 && head_dim == 64)
    return varlen_bf16_block16<64>(q, q_stride, k, v, tables, query_start, seq_lens, out,
                                   num_seqs, num_heads, num_kv_heads, max_blocks, scale,
                                   window, num_threads);
  if (block_size == 16 && head_dim == 128)
    return varlen_bf16_block16<128>(q, q_stride, k, v, tables, query_start, seq_lens, out,
                                    num_seqs, num_heads, num_kv_heads, max_blocks, scale,
                                    window, num_threads);
#endif
  return 1;
}
}  // extern "C"
