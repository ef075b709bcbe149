// The index of each row's largest fp32 value: greedy sampling over the logits.
//
// torch's CPU argmax keeps an index beside every comparison and does not vectorise: many
// times slower than a plain max over the same rows, and at decode batch sizes, with a large
// vocabulary, a visible part of a whole step. Here each row takes two vectorised passes: its
// largest value, then the first chunk that holds it, scanned element by element.
//
// The same answer as torch.argmax: the first index among equal maxima (-0.0 equals 0.0), and
// a NaN counts as larger than anything (the first NaN wins). The kernels are built with
// -ffinite-math-only, under which float comparisons may ignore NaN, so values are compared
// as integers that order like the floats they encode.
#include <cstdint>
#include <cstring>

#include "for_rows.h"

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

}  // namespace

extern "C" {

// out[r] = argmax of the `columns` values of row r (rows `ld` floats apart).
int fulcrum_argmax_f32(const float* x, int64_t ld, int rows, int columns, int64_t* out,
                       int num_threads) {
  if (columns <= 0) return 1;
  fulcrum::for_rows(rows, num_threads, [&](int r) { out[r] = row_argmax(x + r * ld, columns); });
  return 0;
}

}  // extern "C"
