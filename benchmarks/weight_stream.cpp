// benchmarks/weight_stream.py's native side: a batch-1 decode step's weights read with no
// arithmetic, and the linear kernels over the same weights, each in one native call, so no
// Python sits between the matrices.
#include <omp.h>

#include <cstdint>

namespace {

typedef int64_t Lanes __attribute__((vector_size(32)));

// The sum of [start, start + bytes) as 32-byte lanes (bytes a multiple of 128), four
// independent sums so the adds never wait on each other: a read bound by memory alone.
Lanes read_range(const char* start, int64_t bytes) {
  Lanes a = {}, b = {}, c = {}, d = {};
  for (int64_t i = 0; i < bytes; i += 128) {
    a += *reinterpret_cast<const Lanes*>(start + i);
    b += *reinterpret_cast<const Lanes*>(start + i + 32);
    c += *reinterpret_cast<const Lanes*>(start + i + 64);
    d += *reinterpret_cast<const Lanes*>(start + i + 96);
  }
  return a + b + c + d;
}

// Thread t's share of a matrix of `bytes`: a contiguous run of whole 128-byte steps.
void share(int64_t bytes, int t, int threads, int64_t& begin, int64_t& end) {
  const int64_t steps = bytes / 128;
  begin = steps * t / threads * 128;
  end = steps * (t + 1) / threads * 128;
}

}  // namespace

extern "C" {

// Every matrix read once, each split between the threads in contiguous shares: with
// `per_matrix`, one parallel region a matrix (as the kernels are called, one call a
// projection), else one region for them all, each thread going on to its share of the next
// matrix without waiting for the others. Returns a value of the sums, so the reads happen.
int64_t weight_stream_read(const char* const* starts, const int64_t* bytes, int count,
                           int threads, int per_matrix) {
  Lanes total = {};
  if (per_matrix) {
    for (int m = 0; m < count; ++m) {
#pragma omp parallel num_threads(threads)
      {
        int64_t begin, end;
        share(bytes[m], omp_get_thread_num(), omp_get_num_threads(), begin, end);
        const Lanes sum = read_range(starts[m] + begin, end - begin);
#pragma omp critical
        total += sum;
      }
    }
  } else {
#pragma omp parallel num_threads(threads)
    {
      Lanes sum = {};
      for (int m = 0; m < count; ++m) {
        int64_t begin, end;
        share(bytes[m], omp_get_thread_num(), omp_get_num_threads(), begin, end);
        sum += read_range(starts[m] + begin, end - begin);
      }
#pragma omp critical
      total += sum;
    }
  }
  return total[0] + total[1] + total[2] + total[3];
}

typedef int (*LinearFn)(const uint16_t*, int64_t, const uint16_t*, const float*, void*, int64_t,
                        int, int, int, int, int);

// fulcrum_linear_bf16 (handed in) over every matrix at one row: `in` and `out` features each,
// the input row `x` (the widest input), the output row `y` (the widest output). Nonzero if a
// call failed.
int weight_stream_linear(LinearFn linear, const uint16_t* const* packed, const int* in,
                         const int* out, int count, const uint16_t* x, uint16_t* y,
                         int threads) {
  int status = 0;
  for (int m = 0; m < count; ++m)
    status |= linear(x, in[m], packed[m], nullptr, y, out[m], 1, out[m], in[m], 0, threads);
  return status;
}

}  // extern "C"
