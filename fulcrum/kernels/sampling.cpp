// Sampling over fp32 logits: greedy (each row's argmax) and random (each row's token drawn
// from softmax(logits / T) after min_p, top_k and top_p, at a uniform u in [0, 1) the caller
// draws, so each seeded request keeps its own stream of draws); and the logprobs a request
// asks for (its token's, its rank, the most likely tokens').
//
// The kernels are built with -ffinite-math-only, under which float comparisons may ignore
// NaN and infinities: values are compared as integers that order like the floats they
// encode (order_key), and infinities told apart by their bits.
//
// Greedy. torch's CPU argmax keeps an index beside every comparison and does not vectorise:
// many times slower than a plain max over the same rows, and at decode batch sizes, with a
// large vocabulary, a visible part of a whole step. Here each row takes two vectorised
// passes: its largest value, then the first chunk that holds it, scanned element by element.
// The same answer as torch.argmax: the first index among equal maxima (-0.0 equals 0.0), and
// a NaN counts as larger than anything (the first NaN wins).
//
// Random. The torch path (worker/sampler.py) divides, exponentiates, pads and sums the whole
// batch over several passes, and top_k / top_p sort every row's whole vocabulary: at a decode
// batch of 64 over a 49k vocabulary that costs more than the forward pass on two cores. Here
// a row takes two vectorised passes over its logits (their max; then the weights, min_p's
// cut and the block sums of the draw), and the filters sort no more than they must: a
// histogram of the tokens by x (8 buckets an octave of weight, the largest x first) finds the
// bucket where top_k's count or top_p's mass is reached; the buckets before it pass whole,
// those after it not at all, and only its own tokens are ranked. The rules are the torch
// path's:
// - x = logit / T; a token's weight is exp(x - max x), 0 for a masked (-inf) logit and for
//   one below e^-87 of the largest (float32's normal range);
// - min_p drops the tokens whose weight is below min_p (probability below min_p times the
//   largest probability), told by (logit - max) / T < ln(min_p);
// - top_k keeps the k largest x (of equal x, the lower token id first);
// - top_p keeps, in that order, each token whose probability mass before it (renormalised
//   over what top_k left) is below top_p (so the first always stays);
// - the draw is the first token, in vocabulary order, whose cumulative weight (summed in
//   float64) exceeds u times the total: a token of weight 0 is never drawn.
// A row with no finite logit, or with a NaN or +inf once divided, gets -1: the caller names
// whose fault that is.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <limits>

#include "for_rows.h"
#include "vector_math.h"

// No multiply-adds fused by the compiler in what follows: weights, ranks and buckets must
// each round their products as written to agree with one another (a fused logit / T - max x
// once left the largest logit's weight under 1). vector_math.h's own FMAs are written out.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int kChunk = 64;  // values tested together in the second pass

inline int32_t order_key(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const int32_t magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return INT32_MAX;  // NaN, either sign
  if (magnitude == 0) return 0;                     // -0.0 == 0.0
  return bits >= 0 ? bits : bits ^ 0x7fffffff;      // negatives: larger magnitude, smaller key
}

int64_t row_argmax(const float* row, int columns) {
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int i = 0; i < columns; ++i) {
    const int32_t key = order_key(row[i]);
    best = key > best ? key : best;
  }
  for (int start = 0; start < columns; start += kChunk) {
    const int end = columns - start < kChunk ? columns : start + kChunk;
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int i = start; i < end; ++i) found |= order_key(row[i]) == best;
    if (!found) continue;
    for (int i = start; i < end; ++i)
      if (order_key(row[i]) == best) return i;
  }
  return 0;  // unreachable: some value has the largest key
}

// ---------------------------------------------------------------- random sampling
constexpr int kBlock = 256;          // tokens per block of the two-level draw
constexpr int kBuckets = 1024;       // x buckets: 8 an octave of weight, from the largest x
constexpr float kPerNat = 11.541561f;  // 8 / ln 2: buckets per unit of x
constexpr float kUnderflow = -87.f;  // exp below this counts as 0 (bucket 1004 at most)
constexpr int kWays = 4;  // histogram copies, so that runs of one bucket do not wait on one add

inline bool is_nan_or_infinite(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return (bits & 0x7F800000u) == 0x7F800000u;
}

// The float a key of order_key's encodes (a NaN's key aside).
inline float from_key(int32_t key) {
  const int32_t bits = key >= 0 ? key : key ^ 0x7fffffff;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

constexpr int32_t kPositiveInfinityKey = 0x7F800000;  // and above: NaN
constexpr int32_t kNegativeInfinityKey = -0x7F800000 - 1;

using Ranked = std::pair<float, int>;  // (x, token)

// Descending x, and of equal x the lower token id first.
inline bool ranks_before(const Ranked& a, const Ranked& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

struct Scratch {
  std::vector<float> weights;
  std::vector<uint16_t> buckets;
  std::vector<double> block_sums;
  std::vector<Ranked> ranked;
  double mass[kBuckets + 1];  // each x bucket's weight and token count; the last: left out
  int64_t count[kBuckets + 1];
  double way_mass[kWays][kBuckets + 1];
  int32_t way_count[kWays][kBuckets + 1];
};

// One row: its logits, the largest of them, 1 / T, and (once `weigh` and `fill_histogram`
// have put them there) each token's weight and bucket. x = logit / T ranks the tokens; a
// weight is exp((logit - largest) / T): exactly 1 for the largest, whatever the rounding of
// x (a fused multiply-add of logit * (1 / T) - max x leaves the largest a little under 1).
struct Row {
  const float* logits;
  float* weights;
  uint16_t* buckets;
  int vocab;
  float inverse_temperature, largest_logit;

  float x_of(float logit) const { return logit * inverse_temperature; }
  float x(int i) const { return x_of(logits[i]); }
  float below_largest(int i) const { return (logits[i] - largest_logit) * inverse_temperature; }
  int bucket(int i) const { return buckets[i]; }
};

// The largest logit; false where the row has nothing to sample (no finite logit, a NaN or
// +inf one, or one the temperature scales out of float32's range, where torch gives NaN).
bool find_largest(const float* logits, int vocab, float inverse_temperature, float& largest) {
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int i = 0; i < vocab; ++i) best = std::max(best, order_key(logits[i]));
  if (best >= kPositiveInfinityKey || best <= kNegativeInfinityKey) return false;
  largest = from_key(best);
  return !is_nan_or_infinite(largest * inverse_temperature);
}

// Each token's weight (0 for masked tokens, those under the e^-87 floor and those min_p cuts),
// each block's sum of them in float64; returns how many are above 0. A weight is the
// probability over the largest's, so min_p cuts where it falls below min_p: where
// (logit - largest) / T falls below ln(min_p), which keeps a prefix of the ranking (the
// exponential's last bit need not grow with its argument).
int weigh(const Row& row, float min_p, std::vector<double>& block_sums) {
  const float min_d = min_p > 0.f ? std::log(min_p) : std::numeric_limits<float>::lowest();
  const int num_blocks = (row.vocab + kBlock - 1) / kBlock;
  block_sums.resize(num_blocks);
  int positive = 0;
  for (int b = 0; b < num_blocks; ++b) {
    const int end = std::min(row.vocab, (b + 1) * kBlock);
    int i = b * kBlock;
    double sum = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
    // AVX2 on AVX-512 machines too: sampling is a small part of a step.
    const __m256 inverse = _mm256_set1_ps(row.inverse_temperature);
    const __m256 top = _mm256_set1_ps(row.largest_logit);
    const __m256 floor = _mm256_set1_ps(std::max(kUnderflow, min_d));
    __m256d sums = _mm256_setzero_pd();
    const auto weigh8 = [&](const float* logits) {
      // masked logits give -inf here, which compares false
      const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(logits), top), inverse);
      const __m256 w = _mm256_and_ps(_mm256_cmp_ps(d, floor, _CMP_GE_OQ), fulcrum::exp256(d));
      sums = _mm256_add_pd(sums, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))));
      positive += __builtin_popcount(
          _mm256_movemask_ps(_mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_GT_OQ)));
      return w;
    };
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(row.weights + i, weigh8(row.logits + i));
    if (i < end) {  // the tail in the same lanes: one exponential for every token (min_p)
      alignas(32) float tail[8], weights[8];
      std::fill(tail, tail + 8, std::numeric_limits<float>::lowest());
      std::copy(row.logits + i, row.logits + end, tail);
      _mm256_store_ps(weights, weigh8(tail));
      std::copy(weights, weights + (end - i), row.weights + i);
      i = end;
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, sums);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; ++i) {  // a build without AVX2
      const float d = row.below_largest(i);
      row.weights[i] = is_nan_or_infinite(d) || !(d >= std::max(kUnderflow, min_d))
          ? 0.f : std::exp(d);
      sum += row.weights[i];
      positive += row.weights[i] > 0.f;
    }
    block_sums[b] = sum;
  }
  return positive;
}

// The first token in vocabulary order whose cumulative weight exceeds `target`: the block
// from the blocks' sums, then the token within it.
int64_t draw_from_blocks(const float* weights, int vocab, const std::vector<double>& block_sums,
                         double target) {
  double before = 0.0;
  int64_t last = -1;  // the last token of weight above 0 seen: a rounding's fallback
  for (size_t b = 0; b < block_sums.size(); ++b) {
    if (before + block_sums[b] <= target) {
      before += block_sums[b];
      continue;
    }
    const int end = std::min<int>(vocab, (b + 1) * kBlock);
    for (int i = b * kBlock; i < end; ++i) {
      if (weights[i] <= 0.f) continue;
      before += weights[i];
      last = i;
      if (before > target) return i;
    }
  }
  for (int i = vocab - 1; last < 0 && i >= 0; --i)
    if (weights[i] > 0.f) last = i;
  return last;
}

// The same draw over the tokens `kept(i)` says pass (`total`: their weight).
template <typename Kept>
int64_t draw_kept(const Row& row, double total, double u, const Kept& kept) {
  const double target = u * total;
  double before = 0.0;
  int64_t last = -1;
  for (int i = 0; i < row.vocab; ++i) {
    if (row.weights[i] <= 0.f || !kept(i)) continue;
    before += row.weights[i];
    last = i;
    if (before > target) break;
  }
  return last;
}

// Each token's bucket (8 an octave of weight below the largest x; kBuckets for one of weight
// `floor` or less, left out), each bucket's weight and count. A bucket is a function of x
// that never falls as x grows (every step is monotone), so buckets in order are a coarse
// ranking and equal x share one; they are computed once, so every later reader sees the
// same one (the compiler may reassociate each copy of a formula differently).
void fill_histogram(const Row& row, float floor, Scratch& scratch) {
  int i = 0;
  const float top_x = row.x_of(row.largest_logit);
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 inverse = _mm256_set1_ps(row.inverse_temperature);
  const __m256 top = _mm256_set1_ps(top_x), per_nat = _mm256_set1_ps(kPerNat);
  const __m256i out = _mm256_set1_epi32(kBuckets), most = _mm256_set1_epi32(kBuckets - 1);
  for (; i + 8 <= row.vocab; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row.logits + i), inverse);
    const __m256 d = _mm256_mul_ps(_mm256_sub_ps(top, x), per_nat);
    __m256i b = _mm256_min_epi32(_mm256_cvttps_epi32(d), most);
    const __m256 in = _mm256_cmp_ps(_mm256_loadu_ps(row.weights + i),
                                    _mm256_set1_ps(floor), _CMP_GT_OQ);
    b = _mm256_blendv_epi8(out, b, _mm256_castps_si256(in));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                            _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row.buckets + i), packed);
  }
#endif
  for (; i < row.vocab; ++i)
    row.buckets[i] = row.weights[i] > floor
        ? static_cast<uint16_t>(std::min(
              kBuckets - 1, static_cast<int>((top_x - row.x(i)) * kPerNat)))
        : kBuckets;
  for (int w = 0; w < kWays; ++w) {
    std::fill(scratch.way_mass[w], scratch.way_mass[w] + kBuckets + 1, 0.0);
    std::fill(scratch.way_count[w], scratch.way_count[w] + kBuckets + 1, 0);
  }
  for (i = 0; i < row.vocab; ++i) {
    scratch.way_mass[i % kWays][row.buckets[i]] += row.weights[i];
    ++scratch.way_count[i % kWays][row.buckets[i]];
  }
  for (int b = 0; b <= kBuckets; ++b) {
    scratch.mass[b] = (scratch.way_mass[0][b] + scratch.way_mass[1][b]) +
                      (scratch.way_mass[2][b] + scratch.way_mass[3][b]);
    scratch.count[b] = scratch.way_count[0][b] + scratch.way_count[1][b] +
                       scratch.way_count[2][b] + scratch.way_count[3][b];
  }
}

// The tokens in buckets [first, last] that `keep(i)` passes, as (x, token).
template <typename Keep>
void rank_buckets(const Row& row, int first, int last, Scratch& scratch, const Keep& keep) {
  scratch.ranked.clear();
  for (int i = 0; i < row.vocab; ++i) {
    const int b = row.bucket(i);
    if (b >= first && b <= last && keep(i)) scratch.ranked.emplace_back(row.x(i), i);
  }
}

// top_k (0: off) then top_p (1: off) over the tokens of weight above 0 (`total`: their
// weight), sorting no more than the bucket where a cut falls: top_k's k-th token is put in
// place among its bucket's tokens (the buckets before it pass whole); top_p's nucleus passes
// every bucket before the ones where its mass, of what top_k left, reaches top_p (within
// rounding: [first, last]), whose tokens alone are ranked to find where it ends.
int64_t sample_filtered(const Row& row, int64_t top_k, float top_p, double total, double u,
                        Scratch& scratch) {
  // With top_p alone, tokens of weight at most (1 - top_p) / 2 of the total over the
  // vocabulary size are left out of the histogram: all together they hold at most half the
  // mass the nucleus leaves out, so it ends before them (most of a trained model's tail).
  const bool only_top_p = top_k == 0;
  fill_histogram(row, only_top_p ? static_cast<float>((1.0 - top_p) * total / (2.0 * row.vocab))
                                 : 0.f, scratch);
  int k_bucket = kBuckets;  // the bucket of top_k's k-th token (kBuckets: no top_k)
  Ranked k_th{0.f, -1};
  double k_bucket_mass = 0.0;  // the weight of its bucket's tokens up to the k-th
  if (!only_top_p) {
    int64_t before = 0;
    for (k_bucket = 0; before + scratch.count[k_bucket] < top_k; ++k_bucket)
      before += scratch.count[k_bucket];
    rank_buckets(row, k_bucket, k_bucket, scratch, [](int) { return true; });
    auto& ranked = scratch.ranked;
    const auto k_th_place = ranked.begin() + (top_k - before - 1);
    std::nth_element(ranked.begin(), k_th_place, ranked.end(), ranks_before);
    k_th = *k_th_place;
    for (auto it = ranked.begin(); it <= k_th_place; ++it) k_bucket_mass += row.weights[it->second];
    total = k_bucket_mass;
    for (int b = 0; b < k_bucket; ++b) total += scratch.mass[b];
  }
  const auto in_top_k = [&](int i) {
    const int b = row.bucket(i);
    return b < k_bucket || (b == k_bucket && !ranks_before(k_th, {row.x(i), i}));
  };
  if (top_p >= 1.f) return draw_kept(row, total, u, in_top_k);
  const double needed = static_cast<double>(top_p) * total;
  int first = -1, last = std::min(k_bucket, kBuckets - 1);
  double above = 0.0, mass = 0.0;  // above: the buckets before `first`
  for (int b = 0; b <= std::min(k_bucket, kBuckets - 1); ++b) {
    mass += b == k_bucket ? k_bucket_mass : scratch.mass[b];
    if (first < 0 && mass >= needed * (1.0 - 1e-9)) first = b;
    if (first < 0) above = mass;
    if (mass >= needed * (1.0 + 1e-9)) {
      last = b;
      break;
    }
  }
  rank_buckets(row, first, last, scratch, in_top_k);
  auto& ranked = scratch.ranked;
  std::sort(ranked.begin(), ranked.end(), ranks_before);
  double before = above;  // ends as the kept tokens' weight
  size_t keep = 0;  // (the most likely token always stays: nothing is before it, top_p > 0)
  for (; keep < ranked.size() && static_cast<float>(before / total) < top_p; ++keep)
    before += row.weights[ranked[keep].second];
  const Ranked cut = keep > 0 ? ranked[keep - 1] : Ranked{0.f, -1};
  return draw_kept(row, before, u, [&](int i) {
    const int b = row.bucket(i);
    return b < first || (keep > 0 && b <= last && !ranks_before(cut, {row.x(i), i}));
  });
}

int64_t sample_row(const float* logits, int vocab, float temperature, float min_p, int64_t top_k,
                   float top_p, double u, Scratch& scratch) {
  const float inverse_temperature = 1.f / temperature;
  float largest = 0.f;
  if (!find_largest(logits, vocab, inverse_temperature, largest)) return -1;
  scratch.weights.resize(vocab);
  scratch.buckets.resize(vocab);
  const Row row{logits, scratch.weights.data(), scratch.buckets.data(), vocab,
                inverse_temperature, largest};
  const int positive = weigh(row, min_p, scratch.block_sums);
  double total = 0.0;
  for (const double sum : scratch.block_sums) total += sum;
  const bool use_top_k = top_k > 0 && positive > top_k;
  if (!use_top_k && top_p >= 1.f)
    return draw_from_blocks(row.weights, vocab, scratch.block_sums, u * total);
  return sample_filtered(row, use_top_k ? top_k : 0, top_p, total, u, scratch);
}

// ---------------------------------------------------------------- logprobs
// A row's log-softmax at its chosen token, that token's rank and the row's most likely
// tokens, without writing the log-softmax out (torch's log_softmax, the comparison for the
// rank and topk read or write the whole row four times, and the batch's rows again for each).
// A token's value is (logit - max) - log(sum of exp(logit - max)), in float as torch's CPU
// log_softmax computes it (the sum in float64 here, where torch's is in float); its rank is
// 1 + the number of tokens of a larger logit (a larger value, but for logits so close that
// their values round alike, which torch then counts as equal); the top tokens are the
// largest logits, of equal logits the lower id first. Logits compare through order_key (the
// build assumes finite math, and reassociates arithmetic: values computed in a vectorised
// loop need not equal one computed alone). A row with a NaN or +inf logit, or none finite,
// is left to the caller (false).

using Keyed = std::pair<int32_t, int>;  // (order_key(logit), token)

// Descending key, and of equal keys the lower token id first.
inline bool keyed_before(const Keyed& a, const Keyed& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

double exp_sum_below(const float* logits, int vocab, float largest) {
  double sum = 0.0;
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 top = _mm256_set1_ps(largest);
  const __m256 floor = _mm256_set1_ps(kUnderflow);
  __m256d sums = _mm256_setzero_pd();
  for (; i + 8 <= vocab; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(logits + i), top);  // -inf: compares false
    const __m256 w = _mm256_and_ps(_mm256_cmp_ps(d, floor, _CMP_GE_OQ), fulcrum::exp256(d));
    sums = _mm256_add_pd(sums, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, sums);
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < vocab; ++i) {
    const float d = logits[i] - largest;
    if (!is_nan_or_infinite(d) && d >= kUnderflow) sum += std::exp(d);
  }
  return sum;
}

// The `count` largest logits' (key, token), best first, from one pass of chunks: a chunk
// whose largest key cannot enter the kept ones is skipped whole.
void top_tokens(const float* logits, int vocab, int count, std::vector<Keyed>& kept) {
  kept.clear();
  if (count <= 0) return;
  const auto worse_first = [](const Keyed& a, const Keyed& b) { return keyed_before(a, b); };
  for (int start = 0; start < vocab; start += kChunk) {
    const int end = vocab - start < kChunk ? vocab : start + kChunk;
    if (static_cast<int>(kept.size()) == count) {
      int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
      for (int i = start; i < end; ++i) best = std::max(best, order_key(logits[i]));
      if (best <= kept.front().first) continue;  // an equal key has a higher id: it ranks after
    }
    for (int i = start; i < end; ++i) {
      const Keyed candidate{order_key(logits[i]), i};
      if (static_cast<int>(kept.size()) < count) {
        kept.push_back(candidate);
        std::push_heap(kept.begin(), kept.end(), worse_first);  // the worst kept at the front
      } else if (candidate.first > kept.front().first) {
        std::pop_heap(kept.begin(), kept.end(), worse_first);
        kept.back() = candidate;
        std::push_heap(kept.begin(), kept.end(), worse_first);
      }
    }
  }
  std::sort(kept.begin(), kept.end(), keyed_before);
}

bool row_logprobs(const float* logits, int vocab, int64_t token, int num_top, float& chosen,
                  int64_t& rank, float* top_values, int64_t* top_ids, std::vector<Keyed>& kept) {
  if (token < 0 || token >= vocab) return false;  // the caller's torch path names it
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int i = 0; i < vocab; ++i) best = std::max(best, order_key(logits[i]));
  if (best >= kPositiveInfinityKey || best <= kNegativeInfinityKey) return false;
  const float largest = from_key(best);
  const float log_sum = static_cast<float>(std::log(exp_sum_below(logits, vocab, largest)));
  const auto value = [&](float logit) { return (logit - largest) - log_sum; };
  chosen = value(logits[token]);
  const int32_t chosen_key = order_key(logits[token]);
  int64_t larger = 0;
#pragma omp simd reduction(+ : larger)
  for (int i = 0; i < vocab; ++i) larger += order_key(logits[i]) > chosen_key;
  rank = larger + 1;
  top_tokens(logits, vocab, num_top, kept);
  for (int j = 0; j < num_top; ++j) {
    top_ids[j] = kept[j].second;
    top_values[j] = value(logits[kept[j].second]);
  }
  return true;
}

}  // namespace

extern "C" {

// out[r] = argmax of the `columns` values of row r (rows `ld` floats apart).
int fulcrum_argmax_f32(const float* x, int64_t ld, int rows, int columns, int64_t* out,
                       int num_threads) {
  if (columns <= 0) return 1;
  fulcrum::for_rows(rows, num_threads, [&](int r) { out[r] = row_argmax(x + r * ld, columns); });
  return 0;
}

// out[r] = row r's token (-1: nothing to sample), rows `ld` floats apart; per row its
// temperature (> 0), min_p (0: off), top_k (0: off), top_p (1: off) and uniform u in [0, 1).
int fulcrum_sample_f32(const float* logits, int64_t ld, int rows, int vocab,
                       const float* temperature, const float* min_p, const int64_t* top_k,
                       const float* top_p, const double* u, int64_t* out, int num_threads) {
  if (vocab <= 0) return 1;
  fulcrum::for_rows(rows, num_threads, [&](int r) {
    thread_local Scratch scratch;
    out[r] = sample_row(logits + r * ld, vocab, temperature[r], min_p[r], top_k[r], top_p[r],
                        u[r], scratch);
  });
  return 0;
}

// Row r's logprob at tokens[r] (chosen[r]), its rank (rank[r]), and its num_top most likely
// tokens (top_ids / top_values, num_top a row); ok[r] = 0 where the row has a NaN or +inf
// logit or none finite, or where tokens[r] is outside the vocabulary (the caller's torch path
// then answers for it).
int fulcrum_logprobs_f32(const float* logits, int64_t ld, int rows, int vocab,
                         const int64_t* tokens, int num_top, float* chosen, int64_t* rank,
                         float* top_values, int64_t* top_ids, int32_t* ok, int num_threads) {
  if (vocab <= 0 || num_top < 0 || num_top > vocab) return 1;
  fulcrum::for_rows(rows, num_threads, [&](int r) {
    thread_local std::vector<Keyed> kept;
    ok[r] = row_logprobs(logits + r * ld, vocab, tokens[r], num_top, chosen[r], rank[r],
                         top_values + static_cast<int64_t>(r) * num_top,
                         top_ids + static_cast<int64_t>(r) * num_top, kept);
  });
  return 0;
}

}  // extern "C"
