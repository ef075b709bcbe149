// The whole decoder stack of one step in one native call (bf16 on CPU, the varlen attention
// backend): the embedding lookup, then for every layer norm -> QKV -> (Qwen3's per-head
// q/k norm ->) RoPE -> KV write -> attention -> O -> norm -> gate/up -> SiLU*up -> down, then the
// model's final norm, with the residual adds fused into the norms, exactly as the Python layers do
// it and through the same kernels (their entry points are handed in; the q/k norm's runs the
// RMSNorm kernel's row code over the heads in place), so the results are the same bit for bit. What
// it removes is the Python between the kernels: a decode step of a 30-layer model makes ~360 kernel
// calls, each with its own wrapper, allocation and ctypes crossing, which cost about as much as
// streaming the weights at batch 1. The lookup and the final norm are here too because any Python
// call next to the forward pass runs cold, the weights having just swept the caches: one norm of
// one row then costs ~15x what it costs warm. Under tensor parallelism (a rank's share of the
// layers and of the vocabulary), the partial sums of the embedding and of the O and down
// projections are added across ranks by the all-reduce handed in (shared memory,
// kernels/shm_collectives.cpp), as the Python layers do. On one rank the LM head can end the call
// too (the rows that sample, into fp32 logits, and each row's argmax, greedy sampling's token), for
// the same reason: their Python calls, after the stack has swept the caches, cost ~0.2 ms and
// ~0.15 ms, 2% and 1.5% of a batch-1 decode step. Asked, it also times each kind of kernel it calls
// (Step::kernel_seconds; benchmarks/stack_profile.py).
#include <chrono>
#include <cstdint>
#include <cstring>

// The kinds of kernel a step's time is split into when asked (Step::kernel_seconds), in the
// order of fulcrum/models/native_stack.py's KERNEL_KINDS.
enum KernelKind { kNorm, kQkv, kRope, kWriteKv, kAttention, kO, kAllReduce, kGateUp, kSiluMul,
                  kDown, kHead };

extern "C" {

typedef int (*LinearFn)(const uint16_t*, int64_t, const uint16_t*, const float*, void*, int64_t,
                        int, int, int, int, int);
typedef int (*LinearInt8Fn)(const uint16_t*, int64_t, const int8_t*, const float*, const float*,
                            void*, int64_t, int, int, int, int, int);
typedef int (*RmsNormFn)(const uint16_t*, int64_t, uint16_t*, const uint16_t*, uint16_t*,
                         int64_t, int, int, float, int);
typedef int (*RmsNormHeadsFn)(uint16_t*, int64_t, const uint16_t*, int, int, int, float, int);
typedef int (*SiluMulFn)(const uint16_t*, uint16_t*, int, int, int);
typedef int (*RopeFn)(uint16_t*, int64_t, const int64_t*, const float*, const float*, int, int,
                      int, int);
typedef int (*WriteKvFn)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*,
                         uint16_t*, const int64_t*, int, int, int, int);
typedef int (*AttentionFn)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                           const int64_t*, const int64_t*, const int64_t*, uint16_t*, int, int,
                           int, int, int, int, float, int, int);
typedef int (*AllReduceFn)(const void*, uint16_t*, int64_t);
typedef int (*ArgmaxFn)(const float*, int64_t, int, int, int64_t*, int);

struct Kernels {
  LinearFn linear;
  LinearInt8Fn linear_int8;
  RmsNormFn rms_norm;
  RmsNormHeadsFn rms_norm_heads;
  SiluMulFn silu_mul;
  RopeFn rope;
  WriteKvFn write_kv;
  AttentionFn attention;
  AllReduceFn all_reduce;  // null: one rank
  const void* all_reduce_group;
  ArgmaxFn argmax;
};

struct Projection {  // a packed weight (bf16 panels, or int8 ones with per-column scales)
  const void* packed;
  const float* scale;  // null: bf16
  const float* bias;   // null: none
};

struct Layer {
  Projection qkv, o, gate_up, down;
  const uint16_t* input_norm;
  const uint16_t* post_norm;
  uint16_t* k_cache;
  uint16_t* v_cache;
  const uint16_t* q_norm;  // each query head's RMSNorm weight (Qwen3); null: none
  const uint16_t* k_norm;  // each key head's; null: none
};

struct Dims {
  int64_t vocab_start, vocab_end;  // the embedding rows this rank holds
  Projection head;                 // the LM head; its packed null: none
  int vocab;                       // the head's outputs
  int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int block_size, max_blocks, window, num_threads;
  float eps, scale;
};

struct Step {
  int num_tokens, num_seqs;
  const int64_t* token_ids;
  const uint16_t* embedding;   // this rank's rows of the table [vocab_end - vocab_start, hidden]
  const uint16_t* final_norm;  // the final norm's weight [hidden]
  uint16_t* normed;            // out: the final norm's output [T, hidden]
  uint16_t *hidden, *residual, *qkv, *attn, *gate_up, *act;  // scratch
  const int64_t* positions;
  const float *cos, *sin;
  const int64_t *slots, *tables, *query_start, *seq_lens;
  float* logits;               // out: the head's [num_logit_rows, vocab]; null: no head
  int64_t* argmax;             // out: each logits row's argmax; null: not wanted
  const int64_t* logit_rows;   // the rows of `normed` the head reads; null: every row
  int num_logit_rows;
  double* kernel_seconds;      // out: each KernelKind's wall time added to its slot; null: none
};

// `call()`'s status, its wall time added to `kind`'s slot of the step's kernel_seconds if any.
extern "C++" template <typename Call>
int timed(const Step& s, KernelKind kind, const Call& call) {
  if (!s.kernel_seconds) return call();
  const auto start = std::chrono::steady_clock::now();
  const int status = call();
  s.kernel_seconds[kind] +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return status;
}

// Each token's row of the table; a row another rank holds is zero here, and the all-reduce
// (if any) fills it in.
static int embed(const Kernels& k, const Dims& d, const Step& s) {
  const int64_t H = d.hidden;
  for (int t = 0; t < s.num_tokens; ++t) {
    const int64_t id = s.token_ids[t];
    uint16_t* row = s.hidden + t * H;
    if (id >= d.vocab_start && id < d.vocab_end)
      std::memcpy(row, s.embedding + (id - d.vocab_start) * H, sizeof(uint16_t) * H);
    else
      std::memset(row, 0, sizeof(uint16_t) * H);
  }
  return k.all_reduce ? k.all_reduce(k.all_reduce_group, s.hidden, s.num_tokens * H) : 0;
}

static int project(const Kernels& k, const Projection& p, const uint16_t* x, int rows, int in,
                   int out, void* y, int threads, int out_f32 = 0) {
  if (p.scale)
    return k.linear_int8(x, in, static_cast<const int8_t*>(p.packed), p.scale, p.bias, y, out,
                         rows, out, in, out_f32, threads);
  return k.linear(x, in, static_cast<const uint16_t*>(p.packed), p.bias, y, out, rows, out, in,
                  out_f32, threads);
}

// The LM head over the rows that sample (others are gathered first into `hidden`, free by
// now), then each row's argmax if asked.
static int head(const Kernels& k, const Dims& d, const Step& s) {
  const uint16_t* rows = s.normed;
  if (s.logit_rows) {
    for (int r = 0; r < s.num_logit_rows; ++r)
      std::memcpy(s.hidden + int64_t{r} * d.hidden, s.normed + s.logit_rows[r] * d.hidden,
                  sizeof(uint16_t) * d.hidden);
    rows = s.hidden;
  }
  int status = project(k, d.head, rows, s.num_logit_rows, d.hidden, d.vocab, s.logits,
                       d.num_threads, 1);
  if (!status && s.argmax)
    status = k.argmax(s.logits, d.vocab, s.num_logit_rows, d.vocab, s.argmax, d.num_threads);
  return status;
}

int fulcrum_decoder_stack(const Kernels* kernels, const Layer* layers, const Dims* dims,
                          const Step* step) {
  const Kernels& k = *kernels;
  const Dims& d = *dims;
  const Step& s = *step;
  const int T = s.num_tokens, H = d.hidden, threads = d.num_threads;
  const int q_size = d.num_heads * d.head_dim, kv_size = d.num_kv_heads * d.head_dim;
  const int qkv_size = q_size + 2 * kv_size;
  int status = embed(k, d, s);
  for (int l = 0; l < d.num_layers && !status; ++l) {
    const Layer& layer = layers[l];
    if (l == 0) std::memcpy(s.residual, s.hidden, sizeof(uint16_t) * T * H);
    status |= timed(s, kNorm, [&] {
      return k.rms_norm(s.hidden, H, l ? s.residual : nullptr, layer.input_norm, s.normed, H,
                        T, H, d.eps, threads);
    });
    status |= timed(s, kQkv, [&] {
      return project(k, layer.qkv, s.normed, T, H, qkv_size, s.qkv, threads);
    });
    if (layer.q_norm)
      status |= timed(s, kNorm, [&] {
        return k.rms_norm_heads(s.qkv, qkv_size, layer.q_norm, T, d.num_heads, d.head_dim,
                                d.eps, threads) |
               k.rms_norm_heads(s.qkv + q_size, qkv_size, layer.k_norm, T, d.num_kv_heads,
                                d.head_dim, d.eps, threads);
      });
    // q and k heads side by side in each row: one rotation call for both
    status |= timed(s, kRope, [&] {
      return k.rope(s.qkv, qkv_size, s.positions, s.cos, s.sin, T,
                    d.num_heads + d.num_kv_heads, d.head_dim, threads);
    });
    status |= timed(s, kWriteKv, [&] {
      return k.write_kv(s.qkv + q_size, qkv_size, s.qkv + q_size + kv_size, qkv_size,
                        layer.k_cache, layer.v_cache, s.slots, T, d.num_kv_heads, d.head_dim,
                        threads);
    });
    status |= timed(s, kAttention, [&] {
      return k.attention(s.qkv, qkv_size, layer.k_cache, layer.v_cache, s.tables,
                         s.query_start, s.seq_lens, s.attn, s.num_seqs, d.num_heads,
                         d.num_kv_heads, d.head_dim, d.block_size, d.max_blocks, d.scale,
                         d.window, threads);
    });
    status |= timed(s, kO, [&] {
      return project(k, layer.o, s.attn, T, q_size, H, s.hidden, threads);
    });
    if (k.all_reduce)
      status |= timed(s, kAllReduce, [&] {
        return k.all_reduce(k.all_reduce_group, s.hidden, int64_t{T} * H);
      });
    status |= timed(s, kNorm, [&] {
      return k.rms_norm(s.hidden, H, s.residual, layer.post_norm, s.normed, H, T, H, d.eps,
                        threads);
    });
    status |= timed(s, kGateUp, [&] {
      return project(k, layer.gate_up, s.normed, T, H, 2 * d.intermediate, s.gate_up, threads);
    });
    status |= timed(s, kSiluMul, [&] {
      return k.silu_mul(s.gate_up, s.act, T, d.intermediate, threads);
    });
    status |= timed(s, kDown, [&] {
      return project(k, layer.down, s.act, T, d.intermediate, H, s.hidden, threads);
    });
    if (k.all_reduce)
      status |= timed(s, kAllReduce, [&] {
        return k.all_reduce(k.all_reduce_group, s.hidden, int64_t{T} * H);
      });
  }
  if (!status)
    status |= timed(s, kNorm, [&] {
      return k.rms_norm(s.hidden, H, s.residual, s.final_norm, s.normed, H, T, H, d.eps,
                        threads);
    });
  if (!status && s.logits && s.num_logit_rows)
    status |= timed(s, kHead, [&] { return head(k, d, s); });
  return status;
}

}  // extern "C"
