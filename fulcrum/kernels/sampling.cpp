// Sampling over fp32 logits: greedy (each row's argmax) and random (each row's token drawn
// from softmax(logits / T) after min_p, top_k and top_p, at a uniform u in [0, 1) the caller
// draws, so each seeded request keeps its own stream of draws).
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
// those after it not at all, and only its own tokens are ranked (top_k's k are then sorted
// for top_p). The rules are the torch path's:
// - x = logit / T; a token's weight is exp(x - max x), 0 for a masked (-inf) logit and for
//   one below e^-87 of the largest (float32's normal range);
// - min_p drops the tokens whose weight is below min_p (probability below min_p times the
//   largest probability);
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

#include "for_rows.h"
#include "vector_math.h"

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

inline bool is_nan_or_infinite(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return (bits & 0x7F800000u) == 0x7F800000u;
}

inline float scaled(float logit, float inverse_temperature) { return logit * inverse_temperature; }

using Ranked = std::pair<float, int>;  // (x, token)

// Descending x, and of equal x the lower token id first.
inline bool ranks_before(const Ranked& a, const Ranked& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

constexpr int kWays = 4;  // histogram copies, so that runs of one bucket do not wait on one add

struct Scratch {
  std::vector<float> weights;
  std::vector<uint16_t> buckets;
  std::vector<double> block_sums;
  std::vector<Ranked> ranked;
  double mass[kBuckets];  // each x bucket's weight and token count
  int64_t count[kBuckets];
  double way_mass[kWays][kBuckets + 1];  // the last: tokens left out
  int32_t way_count[kWays][kBuckets + 1];
};

// One row's logits, weights and (once `fill_histogram` has put them there) buckets, kBuckets
// for a token left out.
struct Row {
  const float* logits;
  const float* weights;
  uint16_t* buckets;
  int vocab;
  float inverse_temperature, largest;

  float x(int i) const { return scaled(logits[i], inverse_temperature); }
  int bucket(int i) const { return buckets[i]; }
};

// The float a key of order_key's encodes (a NaN's key aside).
inline float from_key(int32_t key) {
  const int32_t bits = key >= 0 ? key : key ^ 0x7fffffff;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

constexpr int32_t kPositiveInfinityKey = 0x7F800000;  // and above: NaN
constexpr int32_t kNegativeInfinityKey = -0x7F800000 - 1;

// Each token's weight, exp(x - max x) (0 for masked tokens, those under the e^-87 floor and
// those min_p cuts: a weight is the probability over the largest's), each block's sum of
// them in float64, how many are above 0 and the largest x; false where the row has nothing
// to sample.
bool weigh(const float* logits, int vocab, float inverse_temperature, float min_p,
           float* weights, std::vector<double>& block_sums, float& largest, int& positive) {
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int i = 0; i < vocab; ++i) best = std::max(best, order_key(logits[i]));
  if (best >= kPositiveInfinityKey || best <= kNegativeInfinityKey) return false;
  largest = scaled(from_key(best), inverse_temperature);  // scaling keeps the order
  if (is_nan_or_infinite(largest)) return false;  // out of float32's range: torch gives NaN
  const int num_blocks = (vocab + kBlock - 1) / kBlock;
  block_sums.resize(num_blocks);
  positive = 0;
  for (int b = 0; b < num_blocks; ++b) {
    const int end = std::min(vocab, (b + 1) * kBlock);
    int i = b * kBlock;
    double sum = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
    // AVX2 on AVX-512 machines too: sampling is a small part of a step.
    const __m256 inverse = _mm256_set1_ps(inverse_temperature), top = _mm256_set1_ps(largest);
    const __m256 floor = _mm256_set1_ps(kUnderflow), cut = _mm256_set1_ps(min_p);
    __m256d sums = _mm256_setzero_pd();
    for (; i + 8 <= end; i += 8) {
      // masked logits and those scaled to -inf give -inf or NaN here: both compare false
      const __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(logits + i), inverse), top);
      __m256 w = _mm256_and_ps(_mm256_cmp_ps(d, floor, _CMP_GE_OQ), fulcrum::exp256(d));
      w = _mm256_and_ps(_mm256_cmp_ps(w, cut, _CMP_GE_OQ), w);
      _mm256_storeu_ps(weights + i, w);
      sums = _mm256_add_pd(sums, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))));
      positive += __builtin_popcount(
          _mm256_movemask_ps(_mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_GT_OQ)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, sums);
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; ++i) {
      const float d = scaled(logits[i], inverse_temperature) - largest;
      const float w = is_nan_or_infinite(d) || !(d >= kUnderflow) ? 0.f : std::exp(d);
      weights[i] = w >= min_p ? w : 0.f;
      sum += weights[i];
      positive += weights[i] > 0.f;
    }
    block_sums[b] = sum;
  }
  return true;
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

// Each token's bucket (8 an octave of weight from the largest x; kBuckets for one of weight
// `floor` or less, left out), each bucket's weight and count. A bucket's index never falls
// as x grows (every step from x to it is monotone), so buckets in order are a coarse ranking;
// they are computed once, so every later reader sees the same one (the compiler may
// reassociate each copy of a formula differently).
void fill_histogram(const Row& row, float floor, Scratch& scratch) {
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 inverse = _mm256_set1_ps(row.inverse_temperature);
  const __m256 top = _mm256_set1_ps(row.largest), per_nat = _mm256_set1_ps(kPerNat);
  const __m256i out = _mm256_set1_epi32(kBuckets), most = _mm256_set1_epi32(kBuckets - 1);
  for (; i + 8 <= row.vocab; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row.logits + i), inverse);
    __m256i b = _mm256_min_epi32(
        _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sub_ps(top, x), per_nat)), most);
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
        ? static_cast<uint16_t>(std::min(kBuckets - 1,
                                         static_cast<int>((row.largest - row.x(i)) * kPerNat)))
        : kBuckets;
  for (int w = 0; w < kWays; ++w) {
    std::fill(scratch.way_mass[w], scratch.way_mass[w] + kBuckets + 1, 0.0);
    std::fill(scratch.way_count[w], scratch.way_count[w] + kBuckets + 1, 0);
  }
  for (i = 0; i < row.vocab; ++i) {
    scratch.way_mass[i % kWays][row.buckets[i]] += row.weights[i];
    ++scratch.way_count[i % kWays][row.buckets[i]];
  }
  for (int b = 0; b < kBuckets; ++b) {
    scratch.mass[b] = (scratch.way_mass[0][b] + scratch.way_mass[1][b]) +
                      (scratch.way_mass[2][b] + scratch.way_mass[3][b]);
    scratch.count[b] = scratch.way_count[0][b] + scratch.way_count[1][b] +
                       scratch.way_count[2][b] + scratch.way_count[3][b];
  }
}

// The tokens in buckets [first, last], as (x, token).
void rank_buckets(const Row& row, int first, int last, Scratch& scratch) {
  scratch.ranked.clear();
  for (int i = 0; i < row.vocab; ++i) {
    const int b = row.bucket(i);
    if (b >= first && b <= last) scratch.ranked.emplace_back(row.x(i), i);
  }
}

// top_k (then top_p over the k): the buckets up to the one where the count reaches k hold the
// k; the k are put first, then sorted for top_p's masses and cut.
int64_t sample_top_k(const Row& row, int64_t top_k, float top_p, double u, Scratch& scratch) {
  fill_histogram(row, 0.f, scratch);
  int last = 0;
  for (int64_t count = scratch.count[0]; count < top_k && last + 1 < kBuckets;)
    count += scratch.count[++last];
  rank_buckets(row, 0, last, scratch);
  auto& ranked = scratch.ranked;
  std::nth_element(ranked.begin(), ranked.begin() + (top_k - 1), ranked.end(), ranks_before);
  ranked.resize(top_k);
  double total = 0.0;
  for (const auto& token : ranked) total += row.weights[token.second];
  if (top_p < 1.f) {
    std::sort(ranked.begin(), ranked.end(), ranks_before);
    double before = 0.0;
    size_t keep = 1;
    for (; keep < ranked.size(); ++keep) {
      before += row.weights[ranked[keep - 1].second] / total;
      if (static_cast<float>(before) >= top_p) break;
    }
    ranked.resize(keep);
    total = 0.0;
    for (const auto& token : ranked) total += row.weights[token.second];
  }
  std::sort(ranked.begin(), ranked.end(),
            [](const Ranked& a, const Ranked& b) { return a.second < b.second; });
  const double target = u * total;
  double before = 0.0;
  int64_t drawn = -1;  // ends on the last token of weight above 0: a rounding's fallback
  for (const Ranked& token : ranked) {
    if (row.weights[token.second] <= 0.f) continue;
    before += row.weights[token.second];
    drawn = token.second;
    if (before > target) break;
  }
  return drawn;
}

// top_p alone: the nucleus passes every bucket before the ones where its mass reaches top_p
// of `total` (within rounding: [first, last]); only those are ranked, to find where it ends.
// Tokens of weight at most (1 - top_p) / 2 of the total over the vocabulary size are left out
// of the histogram: all of them together hold at most half the mass the nucleus leaves out,
// so it ends before them (a trained model's long tail: most of the vocabulary).
int64_t sample_top_p(const Row& row, float top_p, double total, double u, Scratch& scratch) {
  fill_histogram(row, static_cast<float>((1.0 - top_p) * total / (2.0 * row.vocab)), scratch);
  const double needed = static_cast<double>(top_p) * total;
  int first = -1, last = kBuckets - 1;
  double above = 0.0, mass = 0.0;  // above: the buckets before `first`
  for (int b = 0; b < kBuckets; ++b) {
    mass += scratch.mass[b];
    if (first < 0 && mass >= needed * (1.0 - 1e-9)) first = b;
    if (first < 0) above = mass;
    if (mass >= needed * (1.0 + 1e-9)) {
      last = b;
      break;
    }
  }
  rank_buckets(row, first, last, scratch);
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
  scratch.weights.resize(vocab);
  float* weights = scratch.weights.data();
  float largest = 0.f;
  int positive = 0;
  if (!weigh(logits, vocab, inverse_temperature, min_p, weights, scratch.block_sums, largest,
             positive))
    return -1;
  double total = 0.0;
  for (const double sum : scratch.block_sums) total += sum;
  scratch.buckets.resize(vocab);
  const Row row{logits, weights, scratch.buckets.data(), vocab, inverse_temperature, largest};
  if (top_k > 0 && positive > top_k) return sample_top_k(row, top_k, top_p, u, scratch);
  if (top_p < 1.f) return sample_top_p(row, top_p, total, u, scratch);
  return draw_from_blocks(weights, vocab, scratch.block_sums, u * total);
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

}  // extern "C"
