// All-reduce of bf16 tensors between the tensor-parallel ranks of one machine, through the
// shared buffer of fulcrum/distributed/shm.py (its layout and protocol, in C so the native
// decoder stack can reduce between its layers without the interpreter): each rank copies its
// tensor into its slot, raises its `ready` flag, spins until every rank's flag is up, sums
// the slots in rank order (each sum rounded to bf16, as torch's bf16 add_ does, so every
// rank gets the same bits and Python's path the same as this one), then raises `done`.
// Two slots per rank alternate, so a rank waits for the others to have read a slot before it
// writes it again.
#include <immintrin.h>

#include <time.h>

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "vector_math.h"

extern "C" {

struct ShmGroup {
  int64_t* ready;     // [world]: the round whose data each rank has published
  int64_t* done;      // [world]: the round each rank has finished reading
  uint8_t* slots;     // [world][2][slot_bytes]
  int64_t slot_bytes;
  int64_t* seq;       // this rank's round counter (shared with the Python side)
  int32_t rank, world;
  double timeout_s;   // a rank that has not arrived by then is taken for gone
  const int64_t* abort;  // raised by a rank that learns another has ended: stop waiting
};

static double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Spin until every rank's flag reaches `round`: 0; 2 after the group's timeout (ranks run in
// lockstep, so the wait is the others' lag behind this rank, normally microseconds); 3 once
// the group is aborted.
static int wait_all(const ShmGroup& g, const int64_t* flags, int64_t round) {
  double deadline = 0;
  for (int r = 0; r < g.world; ++r) {
    for (int spins = 0; __atomic_load_n(flags + r, __ATOMIC_ACQUIRE) < round; ++spins) {
      _mm_pause();
      if ((spins & 4095) == 4095) {
        if (__atomic_load_n(g.abort, __ATOMIC_RELAXED)) return 3;
        if (deadline == 0) deadline = now_s() + g.timeout_s;
        else if (now_s() > deadline) return 2;
      }
    }
  }
  return 0;
}

static uint16_t* slot(const ShmGroup& g, int rank, int64_t round) {
  return reinterpret_cast<uint16_t*>(g.slots + (rank * 2 + round % 2) * g.slot_bytes);
}

// x [n] bf16, summed over the ranks in place. 0 on success, 1 if it does not fit a slot,
// 2 if a rank did not arrive within the timeout, 3 if the group was aborted.
int fulcrum_shm_all_reduce_bf16(const ShmGroup* group, uint16_t* x, int64_t n) {
  const ShmGroup& g = *group;
  if (n * 2 > g.slot_bytes) return 1;
  const int64_t round = ++*g.seq;
  if (const int status = wait_all(g, g.done, round - 2)) return status;
  std::memcpy(slot(g, g.rank, round), x, n * 2);
  __atomic_store_n(g.ready + g.rank, round, __ATOMIC_RELEASE);
  if (const int status = wait_all(g, g.ready, round)) return status;
  std::memcpy(x, slot(g, 0, round), n * 2);
  for (int r = 1; r < g.world; ++r) {
    const uint16_t* other = slot(g, r, round);
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i < n; i += 16) {
      const __mmask16 mask = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
      fulcrum::store_bf16(x + i, _mm512_add_ps(fulcrum::load_bf16(x + i, mask),
                                               fulcrum::load_bf16(other + i, mask)), mask);
    }
#endif
    for (; i < n; ++i)
      x[i] = fulcrum::float_to_bf16(fulcrum::bf16_to_float(x[i]) + fulcrum::bf16_to_float(other[i]));
  }
  __atomic_store_n(g.done + g.rank, round, __ATOMIC_RELEASE);
  return 0;
}

}  // extern "C"
