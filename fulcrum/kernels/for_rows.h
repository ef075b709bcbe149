// Row loops shared by fulcrum's kernels.
#pragma once

namespace fulcrum {

// body(r) for every row r in [0, rows), the rows split between `num_threads` threads. Fewer
// than `shared_from` rows (by default a single row: a lone decode's norm, SiLU, RoPE, KV write
// or argmax) run on the calling thread: there is little or nothing to share, and a lone
// decode's step makes several such calls a layer, each a microsecond or less of work, where
// starting and joining a team only adds. A plain branch, not an `if` clause on the pragma,
// under which libgomp still starts (and joins) a team of one thread.
template <typename Body>
inline void for_rows(int rows, int num_threads, const Body& body, int shared_from = 2) {
  if (rows < shared_from) {
    for (int r = 0; r < rows; ++r) body(r);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int r = 0; r < rows; ++r) body(r);
}

}  // namespace fulcrum
