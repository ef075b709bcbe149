// Row loops shared by fulcrum's kernels.
#pragma once

namespace fulcrum {

// body(r) for every row r in [0, rows), the rows split between `num_threads` threads. A
// single row (a lone decode's norm, SiLU, RoPE, KV write or argmax) runs on the calling
// thread: there is nothing to share, and a lone decode's step makes several such calls a
// layer, each a microsecond or less of work, where starting and joining a team only adds.
template <typename Body>
inline void for_rows(int rows, int num_threads, const Body& body) {
  if (rows == 1) {
    body(0);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int r = 0; r < rows; ++r) body(r);
}

}  // namespace fulcrum
