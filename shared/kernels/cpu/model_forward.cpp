// The forward pass of a Llama model in one C++ call — decode tokens and prefill chunks alike — and
// the quantized matmul for the torch path. Why: at batch 1 this model's step is ~300 small ops (30
// layers x ~10); from Python each costs microseconds of dispatch, so the eager step was bound by
// overhead, not by reading weights. Here one OpenMP team runs the step, with a barrier between
// dependent phases:
//
//   embed -> for each layer: rmsnorm -> qkv -> rotary + KV write (every row) -> paged attention
//   (per row, split over positions, merged by log-sum-exp) -> o_proj + residual -> rmsnorm
//   -> gate|up -> silu*mul -> down + residual -> final rmsnorm -> head (the rows asked for)
//
// Activations are fp32; weights are the checkpoint's blocks (quant_matmul.h); the KV cache is
// fp32, bf16 or fp16. With a bf16 cache on a CPU with AVX512_BF16, the attention scores multiply
// the query rounded to bf16 by the keys as they are stored, two products a lane per instruction
// (vdpbf16ps): 8% faster prefill of 2,000 tokens and ~10% faster decode at that context, for a
// mean KL of 0.000056 instead of 0.000033 nats against the fp32 evaluation.
//
// A row is one token: every result of a row is computed by the same
// operations in the same order whatever else is in the call (no reduction crosses rows; a
// prefill row attends exactly as a decode step at its position would), so a sequence's tokens do
// not depend on its batch, on how its prompt was chunked, or on which of its blocks were cached.
#include <omp.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "quant_matmul.h"
#include "simd.h"

namespace pdserve {
namespace {

constexpr int64_t kColChunk = 16;   // output columns per work item of a matmul (one vector: see silu)
constexpr int64_t kPosChunk = 256;  // cache positions per attention work item
constexpr int64_t kUnitRows = 16;   // rows of one sequence per attention work item (they share its keys)
constexpr int64_t kRowBlock = 64;   // rows per matmul work item: their prepared activations stay in L2

using namespace simd;

// exp(x) for 16 lanes: Cody-Waite range reduction + degree-6 polynomial, ~1 ulp on [-87, 88].
inline vf exp16(vf x) {
  x = max(min(x, set1(88.3762626647949f)), set1(-87.0f));
  const vf n = round(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500E-4f);
  p = fmadd(p, r, set1(1.3981999507E-3f));
  p = fmadd(p, r, set1(8.3334519073E-3f));
  p = fmadd(p, r, set1(4.1665795894E-2f));
  p = fmadd(p, r, set1(1.6666665459E-1f));
  p = fmadd(p, r, set1(5.0000001201E-1f));
  p = fmadd(mul(p, r), r, add(r, set1(1.0f)));
  return scale2(p, n);
}

// 16 cache values -> fp32
inline vf load16(const float* p) { return load(p); }
inline vf load16(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline vf load16(const c10::Half* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }

// ask for the cache lines of bytes [p, p + n) (kHint: _MM_HINT_T0 into L1, _MM_HINT_T1 into L2)
template <int kHint>
inline void prefetch(const void* p, int64_t n) {
  for (int64_t off = 0; off < n; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, static_cast<_mm_hint>(kHint));
}

template <typename T>
inline void store_cache(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = static_cast<T>(src[i]);
}

void rmsnorm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  vf ss = zero();
  for (int64_t i = 0; i < d; i += 16) {
    const vf v = load(x + i);
    ss = fmadd(v, v, ss);
  }
  const float scale = 1.0f / std::sqrt(reduce_add(ss) / static_cast<float>(d) + eps);
  const vf s = set1(scale);
  for (int64_t i = 0; i < d; i += 16) store(out + i, mul(mul(load(x + i), s), load(w + i)));
}

QuantWeight as_weight(const torch::Tensor& t, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "weight must be a contiguous CPU tensor");
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32, got ", k);
  const int64_t bytes = weight_bytes(static_cast<int>(type), n, k);
  TORCH_CHECK(t.nbytes() == static_cast<size_t>(bytes), "weight of type ", type, " [", n, ", ", k, "] needs ", bytes,
              " bytes, got ", t.nbytes());
  if (type == kF32) TORCH_CHECK(t.scalar_type() == torch::kFloat32, "an F32 weight must be float32");
  return make_weight(t.data_ptr(), static_cast<int>(type), n, k);
}

}  // namespace

// A weight matrix in checkpoint blocks. Q4_1 and Q8_0 keep only the kernels' copy (make_weight's
// groups: the same values), so the rows they were made from can be freed; F32 keeps its tensor.
struct Weight {
  torch::Tensor tensor;
  QuantWeight w;
  Weight(torch::Tensor t, int64_t type, int64_t n, int64_t k) : tensor(std::move(t)), w(as_weight(tensor, type, n, k)) {
    if (w.type != kF32) {
      tensor = torch::Tensor();
      w.data = nullptr;
    }
  }
};

// x [M, K] fp32 -> [M, N] fp32, rows prepared and columns split across the OpenMP team
torch::Tensor matmul(const torch::Tensor& x, const Weight& weight) {
  const QuantWeight& w = weight.w;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "x must be [M, ", w.k, "] float32 with unit stride in its last dim");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, w.n}, x.options());
  PreparedX px;
  prepare_resize(px, w.type, M, w.k, x.data_ptr<float>(), x.stride(0));
  float* yp = y.data_ptr<float>();
  const int64_t chunks = (w.n + kColChunk - 1) / kColChunk, rblocks = (M + kRowBlock - 1) / kRowBlock;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) prepare_rows(px, m, m + 1);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rblocks * chunks; it++) {
      const int64_t m0 = it / chunks * kRowBlock, n0 = it % chunks * kColChunk;
      matmul_cols(w, px, yp, w.n, n0, std::min(w.n, n0 + kColChunk), m0, std::min(M, m0 + kRowBlock));
    }
  }
  return y;
}

torch::Tensor embed(const torch::Tensor& ids, const Weight& weight) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(), "ids must be [T] int64");
  auto out = torch::empty({ids.size(0), weight.w.k}, torch::dtype(torch::kFloat32));
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); t++)
    TORCH_CHECK(p[t] >= 0 && p[t] < weight.w.n, "token id ", p[t], " out of range [0, ", weight.w.n, ")");
  dequantize_rows(weight.w, p, ids.size(0), out.data_ptr<float>());
  return out;
}

struct LayerWeights {
  Weight qkv, o, gate_up, down;
  torch::Tensor attn_norm, mlp_norm;  // [D] fp32
};

class DecodeModel {
 public:
  DecodeModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<Weight> linears,
              std::vector<torch::Tensor> norms, Weight embed_w, Weight head_w, torch::Tensor final_norm,
              torch::Tensor cos, torch::Tensor sin)
      : hq_(num_heads), hkv_(num_kv_heads), dh_(head_dim), eps_(static_cast<float>(eps)), embed_(std::move(embed_w)),
        head_(std::move(head_w)), final_norm_(final_norm.contiguous()), cos_(cos.contiguous()), sin_(sin.contiguous()) {
    TORCH_CHECK(linears.size() % 4 == 0 && norms.size() == linears.size() / 2, "4 linears and 2 norms per layer");
    TORCH_CHECK(head_dim % 16 == 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16,
                "head_dim must be a multiple of 16, and at most 16 query heads per kv head");
    for (size_t l = 0; l < linears.size() / 4; l++)
      layers_.push_back({linears[4 * l], linears[4 * l + 1], linears[4 * l + 2], linears[4 * l + 3],
                         norms[2 * l].contiguous(), norms[2 * l + 1].contiguous()});
    for (const LayerWeights& lw : layers_)
      TORCH_CHECK(lw.qkv.w.type == layers_[0].qkv.w.type && lw.o.w.type == layers_[0].o.w.type &&
                      lw.gate_up.w.type == layers_[0].gate_up.w.type && lw.down.w.type == layers_[0].down.w.type,
                  "each projection must have one weight type across layers");
    TORCH_CHECK(head_dim <= 256, "head_dim must be at most 256");
    d_ = embed_.w.k;
    f_ = layers_.at(0).gate_up.w.n / 2;
    TORCH_CHECK(cos_.size(1) == dh_ / 2 && cos_.scalar_type() == torch::kFloat32, "rotary table must be [P, Dh/2] fp32");
  }

  // Rows of tokens: decode tokens (one row of a sequence) and prefill chunks (consecutive rows of a
  // sequence, in position order) alike. Row r is token ids[r] at position positions[r] of the
  // sequence whose block table is block_tables[row_seq[r]]; it attends to positions 0..positions[r]
  // of that sequence (the cache before this call, plus the rows of this call before it).
  // kv: [num_blocks, L, 2, block_size, Hkv, Dh]. Returns logits [len(logit_rows), V] fp32 for the rows named.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& row_seq,
                        const torch::Tensor& block_tables, const torch::Tensor& logit_rows, const torch::Tensor& kv) {
    const int64_t NT = ids.size(0), S = block_tables.size(0), W = block_tables.size(1);
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && row_seq.dim() == 1 && positions.size(0) == NT &&
                    row_seq.size(0) == NT && block_tables.dim() == 2 && logit_rows.dim() == 1,
                "ids, positions, row_seq: [T]; block_tables: [S, W]; logit_rows: [R]");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && row_seq.scalar_type() == torch::kInt32 &&
                    block_tables.scalar_type() == torch::kInt32 && logit_rows.scalar_type() == torch::kInt64 &&
                    positions.is_contiguous() && row_seq.is_contiguous() && block_tables.is_contiguous() &&
                    logit_rows.is_contiguous(),
                "positions/logit_rows int64, row_seq/block_tables int32, all contiguous");
    TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous() && kv.size(1) == static_cast<int64_t>(layers_.size()) &&
                    kv.size(4) == hkv_ && kv.size(5) == dh_, "kv cache must be [blocks, L, 2, bs, Hkv, Dh], contiguous");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int32_t* rs = row_seq.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t bs = kv.size(3);
    for (int64_t r = 0; r < NT; r++) {
      TORCH_CHECK(rs[r] >= 0 && rs[r] < S && pos[r] >= 0 && pos[r] < cos_.size(0) && pos[r] / bs < W,
                  "row ", r, ": sequence index, position within the rotary table and its block table");
      if (r > 0 && rs[r] == rs[r - 1]) TORCH_CHECK(pos[r] == pos[r - 1] + 1, "row ", r, ": a chunk's positions must be consecutive");
      for (int64_t i = 0; i <= pos[r] / bs; i++) {
        const int32_t blk = tables[rs[r] * W + i];
        TORCH_CHECK(blk >= 0 && blk < kv.size(0), "row ", r, ": block ", blk, " outside the cache");
      }
    }
    const int64_t* lr = logit_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.size(0); i++) TORCH_CHECK(lr[i] >= 0 && lr[i] < NT, "logit row out of range");
    auto logits = torch::empty({logit_rows.size(0), head_.w.n}, torch::dtype(torch::kFloat32));
    if (NT == 0) return logits;
    switch (kv.scalar_type()) {
      case torch::kFloat32: run<float>(ids, pos, rs, tables, W, lr, logit_rows.size(0), kv, logits); break;
      case torch::kBFloat16: run<c10::BFloat16>(ids, pos, rs, tables, W, lr, logit_rows.size(0), kv, logits); break;
      case torch::kHalf: run<c10::Half>(ids, pos, rs, tables, W, lr, logit_rows.size(0), kv, logits); break;
      default: TORCH_CHECK(false, "kv cache dtype must be float32, bfloat16 or float16");
    }
    return logits;
  }

 private:
  // attention work item: rows [r0, r1) of one sequence (consecutive positions), kv heads [h0, h1),
  // and the cache positions [t0, t0 + kPosChunk) — for each row, those of them up to its own position
  struct Unit {
    int64_t r0, r1, h0, h1, t0;
  };

  template <typename T>
  void run(const torch::Tensor& ids_t, const int64_t* pos, const int32_t* rs, const int32_t* tables, int64_t tstride,
           const int64_t* lr, int64_t R, const torch::Tensor& kv, torch::Tensor& logits) {
    const int64_t NT = ids_t.size(0), D = d_, F = f_, G = hq_ / hkv_, Dh = dh_;
    const int64_t q_size = hq_ * Dh, kv_size = hkv_ * Dh, qkv_n = q_size + 2 * kv_size;
    const int64_t L = static_cast<int64_t>(layers_.size()), bs = kv.size(3);
    const int64_t s_block = kv.stride(0), s_layer = kv.stride(1), s_kv = kv.stride(2);
    T* cache = kv.data_ptr<T>();
    const float* cosp = cos_.data_ptr<float>();
    const float* sinp = sin_.data_ptr<float>();

    // where each row's K and V go, its attention work items, and for each (row, kv head) the first item
    // A row's attention is split into partials over positions [0, 256), [256, 512), … up to its own
    // position, merged in order — the same split for a decode row and a prefill row at that position.
    // Partial (r, h, j) is at first[r * Hkv + h] + j.
    std::vector<int64_t> slot(NT);
    std::vector<int64_t> first(NT * hkv_ + 1);
    int64_t P = 0;
    for (int64_t r = 0; r < NT; r++) {
      slot[r] = static_cast<int64_t>(tables[rs[r] * tstride + pos[r] / bs]) * bs + pos[r] % bs;
      for (int64_t h = 0; h < hkv_; h++) {
        first[r * hkv_ + h] = P;
        P += pos[r] / kPosChunk + 1;
      }
    }
    first[NT * hkv_] = P;
    const int64_t part = G * (Dh + 2);  // per partial: G x (max, sum, o[Dh])
    // work items: blocks of up to kUnitRows rows of one sequence, which share the positions they read;
    // every kv head of a chunk in one item (a position's heads are adjacent in the cache: the item
    // reads each block's keys and values as two runs) unless the rows have fewer chunks than there
    // are threads (then one item a head, so short contexts still spread over the team). The numbers
    // are the same either way: each (row, head, chunk) partial is computed alike.
    const int nthreads = at::get_num_threads();
    std::vector<Unit> units;
    for (int64_t r0 = 0; r0 < NT;) {
      int64_t r1 = r0 + 1;
      while (r1 < NT && r1 - r0 < kUnitRows && rs[r1] == rs[r0]) r1++;
      const int64_t heads = pos[r1 - 1] / kPosChunk + 1 >= nthreads ? hkv_ : 1;
      for (int64_t t0 = 0; t0 <= pos[r1 - 1]; t0 += kPosChunk)
        for (int64_t h = 0; h < hkv_; h += heads) units.push_back({r0, r1, h, h + heads, t0});
      r0 = r1;
    }
    const int64_t U = static_cast<int64_t>(units.size());

    auto f32 = torch::dtype(torch::kFloat32);
    torch::Tensor x_t = embed(ids_t, embed_);
    auto h_t = torch::empty({NT, D}, f32), qkv_t = torch::empty({NT, qkv_n}, f32), attn_t = torch::empty({NT, q_size}, f32);
    auto tmp_t = torch::empty({NT, D}, f32), act_t = torch::empty({NT, F}, f32), part_t = torch::empty({P, part}, f32);
    const int64_t scratch = hkv_ * Dh * kPosChunk + G * (kPosChunk + Dh);  // see attend()
    auto scores_t = torch::empty({nthreads, scratch}, f32);
    auto gu_all = torch::empty({nthreads, kRowBlock, 2 * kColChunk}, f32);
    float *x = x_t.data_ptr<float>(), *h = h_t.data_ptr<float>(), *qkv = qkv_t.data_ptr<float>();
    float *attn = attn_t.data_ptr<float>(), *tmp = tmp_t.data_ptr<float>(), *act = act_t.data_ptr<float>();
    float *parts = part_t.data_ptr<float>(), *scores_all = scores_t.data_ptr<float>(), *gu_buf = gu_all.data_ptr<float>();
    float* out = logits.data_ptr<float>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    const float* fnorm = final_norm_.data_ptr<float>();
    const LayerWeights& l0 = layers_[0];
    prepare_resize(px_qkv_, l0.qkv.w.type, NT, D, h, D);
    prepare_resize(px_o_, l0.o.w.type, NT, q_size, attn, q_size);
    prepare_resize(px_gu_, l0.gate_up.w.type, NT, D, h, D);
    prepare_resize(px_down_, l0.down.w.type, NT, F, act, F);
    prepare_resize(px_head_, head_.w.type, R, D, h, D);
    const int64_t rblocks = (NT + kRowBlock - 1) / kRowBlock, fchunks = (F + kColChunk - 1) / kColChunk;

#pragma omp parallel num_threads(nthreads)
    {
      const int tid = omp_get_thread_num();
      float* work = scores_all + tid * scratch;
      float* gu = gu_buf + tid * kRowBlock * 2 * kColChunk;
      for (int64_t l = 0; l < L; l++) {
        const LayerWeights& lw = layers_[l];
        const float* an = lw.attn_norm.data_ptr<float>();
        const float* mn = lw.mlp_norm.data_ptr<float>();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < NT; r++) {
          rmsnorm_row(x + r * D, an, h + r * D, D, eps_);
          prepare_rows(px_qkv_, r, r + 1);
        }
        columns(lw.qkv.w, px_qkv_, qkv, qkv_n, nullptr);
        // every row's rotated key and its value into the cache, before any row attends
#pragma omp for schedule(static)
        for (int64_t r = 0; r < NT; r++) {
          const float* row = qkv + r * qkv_n;
          const float* c = cosp + pos[r] * (Dh / 2);
          const float* sn = sinp + pos[r] * (Dh / 2);
          T* dst = cache + (slot[r] / bs) * s_block + l * s_layer + (slot[r] % bs) * kv_size;
          for (int64_t kh = 0; kh < hkv_; kh++) {
            float krot[256];
            rotate(row + q_size + kh * Dh, c, sn, krot, Dh);
            store_cache(dst + kh * Dh, krot, Dh);
            store_cache(dst + s_kv + kh * Dh, row + q_size + kv_size + kh * Dh, Dh);
          }
        }
        // attention partials
#pragma omp for schedule(dynamic)
        for (int64_t u = 0; u < U; u++)
          attend(units[u], qkv, qkv_n, pos, cosp, sinp, tables + rs[units[u].r0] * tstride, cache + l * s_layer, s_block,
                 s_kv, bs, kv_size, scale, work, parts, part, first.data());
        // merge the partials of each (row, kv head), in position order
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < NT * hkv_; rh++)
          merge(parts, part, first[rh], first[rh + 1], attn + (rh / hkv_) * q_size + (rh % hkv_) * G * Dh, G);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < NT; r++) prepare_rows(px_o_, r, r + 1);
        columns(lw.o.w, px_o_, tmp, D, x);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < NT; r++) {
          rmsnorm_row(x + r * D, mn, h + r * D, D, eps_);
          prepare_rows(px_gu_, r, r + 1);
        }
        // gate|up for a block of rows and a chunk of columns, then silu(gate) * up for that chunk
#pragma omp for schedule(static)
        for (int64_t it = 0; it < rblocks * fchunks; it++) {
          const int64_t m0 = it / fchunks * kRowBlock, m1 = std::min(NT, m0 + kRowBlock);
          const int64_t c0 = it % fchunks * kColChunk, c1 = std::min(F, c0 + kColChunk), w = c1 - c0;
          constexpr int64_t ld = 2 * kColChunk;
          matmul_cols(lw.gate_up.w, px_gu_, gu - m0 * ld - c0, ld, c0, c1, m0, m1);
          matmul_cols(lw.gate_up.w, px_gu_, gu - m0 * ld + kColChunk - (F + c0), ld, F + c0, F + c1, m0, m1);
          for (int64_t m = m0; m < m1; m++) {
            const float* g = gu + (m - m0) * ld;
            float* a = act + m * F + c0;
            if (w == 16) {  // silu(g) * up = g * up / (1 + exp(-g))
              const vf gv = load(g);
              const vf den = add(set1(1.0f), exp16(sub(zero(), gv)));
              store(a, div(mul(gv, load(g + kColChunk)), den));
            } else {
              for (int64_t i = 0; i < w; i++) a[i] = g[i] * g[kColChunk + i] / (1.0f + std::exp(-g[i]));
            }
          }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < NT; r++) prepare_rows(px_down_, r, r + 1);
        columns(lw.down.w, px_down_, tmp, D, x);
      }
      // the head only for the rows whose next token is wanted (h is free again: it holds them compactly)
#pragma omp for schedule(static)
      for (int64_t i = 0; i < R; i++) {
        rmsnorm_row(x + lr[i] * D, fnorm, h + i * D, D, eps_);
        prepare_rows(px_head_, i, i + 1);
      }
      columns(head_.w, px_head_, out, head_.w.n, nullptr);
    }
  }

  // y = x @ w^T over (row block, column chunk) items split across the team (ends in a barrier);
  // with `residual`, each item is also added into residual[rows, chunk] (y is then scratch).
  static void columns(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, float* residual) {
    const int64_t chunks = (w.n + kColChunk - 1) / kColChunk, rblocks = (px.M + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < rblocks * chunks; it++) {
      const int64_t m0 = it / chunks * kRowBlock, m1 = std::min(px.M, m0 + kRowBlock);
      const int64_t n0 = it % chunks * kColChunk, n1 = std::min(w.n, n0 + kColChunk);
      matmul_cols(w, px, y, ldy, n0, n1, m0, m1);
      if (residual != nullptr)
        for (int64_t m = m0; m < m1; m++)
          for (int64_t n = n0; n < n1; n++) residual[m * ldy + n] += y[m * ldy + n];
    }
  }

  // rotate-half rotary: pairs (i, i + Dh/2) turn by the position's angle
  static void rotate(const float* v, const float* c, const float* s, float* out, int64_t Dh) {
    for (int64_t i = 0; i < Dh / 2; i++) {
      const float x1 = v[i], x2 = v[i + Dh / 2];
      out[i] = x1 * c[i] - x2 * s[i];
      out[i + Dh / 2] = x2 * c[i] + x1 * s[i];
    }
  }

  // kt[i][0..16) = key i of the m <= 16 positions k[0..m) as fp32 (zeros past m), 16 x 16 at a time
  // through registers; bf16 pairs are transposed as one 32-bit lane and split after (half the shuffles)
  template <typename T>
  void transpose_keys(const T* const* k, int64_t m, float* kt) const {
    const int64_t Dh = dh_;
    vf r[16];
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (Dh % 32 == 0) {
        for (int64_t i0 = 0; i0 < Dh; i0 += 32) {
          for (int64_t j = 0; j < 16; j++) r[j] = j < m ? load(reinterpret_cast<const float*>(k[j] + i0)) : zero();
          transpose16(r);
          for (int64_t d = 0; d < 16; d++) {
            store(kt + (i0 + 2 * d) * kPosChunk, bf16_lo(r[d]));
            store(kt + (i0 + 2 * d + 1) * kPosChunk, bf16_hi(r[d]));
          }
        }
        return;
      }
    }
    for (int64_t i0 = 0; i0 < Dh; i0 += 16) {
      for (int64_t j = 0; j < 16; j++) r[j] = j < m ? load16(k[j] + i0) : zero();
      transpose16(r);
      for (int64_t d = 0; d < 16; d++) store(kt + (i0 + d) * kPosChunk, r[d]);
    }
  }

  // s[g][t] = scale * (the sum `step` accumulates over i < steps) for NG query heads and t < n
  // (rounded up to 16), each lane's sum in order of i; two blocks of 16 positions at a time (2 x NG
  // independent sums in flight). step(a, i, tb) adds term i to the NG sums of positions tb..tb+16.
  template <int NG, typename Step>
  static void score_blocks(int64_t steps, int64_t n, float scale, float* s, const Step& step) {
    const vf vscale = set1(scale);
    int64_t tb = 0;
    for (; tb + 16 < n; tb += 32) {
      vf a0[NG], a1[NG];
      for (int g = 0; g < NG; g++) a0[g] = a1[g] = zero();
      for (int64_t i = 0; i < steps; i++) {
        step(a0, i, tb);
        step(a1, i, tb + 16);
      }
      for (int g = 0; g < NG; g++) {
        store(s + g * kPosChunk + tb, mul(a0[g], vscale));
        store(s + g * kPosChunk + tb + 16, mul(a1[g], vscale));
      }
    }
    if (tb < n) {
      vf a0[NG];
      for (int g = 0; g < NG; g++) a0[g] = zero();
      for (int64_t i = 0; i < steps; i++) step(a0, i, tb);
      for (int g = 0; g < NG; g++) store(s + g * kPosChunk + tb, mul(a0[g], vscale));
    }
  }

  // s[g][t] = scale * sum_i q[g][i] kt[i][t], i in order
  template <int NG>
  void scores(const float* q, const float* kt, int64_t n, float scale, float* s) const {
    const int64_t Dh = dh_;
    score_blocks<NG>(Dh, n, scale, s, [&](vf* a, int64_t i, int64_t tb) {
      const vf k = load(kt + i * kPosChunk + tb);
      for (int g = 0; g < NG; g++) a[g] = fmadd(set1(q[g * Dh + i]), k, a[g]);
    });
  }

#if defined(__AVX512BF16__)
  // whether a bf16 cache's keys are staged as bf16 pairs and scored by scores_bf16
  bool key_pairs() const { return dh_ % 32 == 0; }

  // kp[i2][t] = the pair (k_t[2 i2], k_t[2 i2 + 1]) of bf16 keys as one 32-bit lane, m <= 16 positions
  void transpose_key_pairs(const c10::BFloat16* const* k, int64_t m, float* kp) const {
    vf r[16];
    for (int64_t i0 = 0; i0 < dh_; i0 += 32) {
      for (int64_t j = 0; j < 16; j++) r[j] = j < m ? load(reinterpret_cast<const float*>(k[j] + i0)) : zero();
      transpose16(r);
      for (int64_t d = 0; d < 16; d++) store(kp + (i0 / 2 + d) * kPosChunk, r[d]);
    }
  }

  // scores with the query rounded to bf16: each lane accumulates (q_2i k_2i + q_2i+1 k_2i+1) per
  // pair, i in order (vdpbf16ps: two products a lane per instruction)
  template <int NG>
  void scores_bf16(const uint32_t* qp, const float* kp, int64_t n, float scale, float* s) const {
    const int64_t D2 = dh_ / 2;
    score_blocks<NG>(D2, n, scale, s, [&](vf* a, int64_t i, int64_t tb) {
      const __m512bh k = (__m512bh)_mm512_loadu_ps(kp + i * kPosChunk + tb);
      for (int g = 0; g < NG; g++)
        a[g].v = _mm512_dpbf16_ps(a[g].v, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g * D2 + i])), k);
    });
  }
#endif

  // every query head's scores of one row over the item's staged keys (scores, or scores_bf16 where
  // the keys were staged as bf16 pairs: see key_pairs)
  template <typename T>
  void row_scores(const float* qrot, const float* kt, int64_t n, float scale, float* scores_buf) const {
    const int64_t G = hq_ / hkv_, Dh = dh_;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (key_pairs()) {  // the query as bf16 pairs, rounded to nearest even
        uint32_t qp[16 * 128];
        for (int64_t g = 0; g < G; g++)
          for (int64_t i = 0; i < Dh / 2; i++)
            qp[g * (Dh / 2) + i] = static_cast<uint32_t>(c10::BFloat16(qrot[g * Dh + 2 * i]).x) |
                                   (static_cast<uint32_t>(c10::BFloat16(qrot[g * Dh + 2 * i + 1]).x) << 16);
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const uint32_t* q = qp + g0 * (Dh / 2);
          float* so = scores_buf + g0 * kPosChunk;
          switch (std::min<int64_t>(4, G - g0)) {
            case 1: scores_bf16<1>(q, kt, n, scale, so); break;
            case 2: scores_bf16<2>(q, kt, n, scale, so); break;
            case 3: scores_bf16<3>(q, kt, n, scale, so); break;
            default: scores_bf16<4>(q, kt, n, scale, so); break;
          }
        }
        return;
      }
    }
#endif
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: scores<1>(qrot + g0 * Dh, kt, n, scale, scores_buf + g0 * kPosChunk); break;
        case 2: scores<2>(qrot + g0 * Dh, kt, n, scale, scores_buf + g0 * kPosChunk); break;
        case 3: scores<3>(qrot + g0 * Dh, kt, n, scale, scores_buf + g0 * kPosChunk); break;
        default: scores<4>(qrot + g0 * Dh, kt, n, scale, scores_buf + g0 * kPosChunk); break;
      }
    }
  }

  // One work item: the partials (max, sum, unnormalised o per query head) of its rows and kv heads
  // over its positions. The item's keys are gathered once, a head's transposed to fp32 (kt[i][t];
  // with bf16 scores, left as bf16 pairs: kt[i/2][t]), all its heads of a position together (adjacent
  // in the cache); the values are read where they are, when they are summed. Then each head and row:
  //   scores[t] = scale * sum_i q[i] k_t[i]   (16 positions per vector, i in order)
  //   softmax numerators and their sum;  o = sum_t p_t v_t  (t in order)
  // Every number of a row is computed the same way whichever rows share the item, so a prefill row
  // equals the decode step at its position.
  template <typename T>
  void attend(const Unit& un, const float* qkv, int64_t qkv_n, const int64_t* pos, const float* cosp, const float* sinp,
              const int32_t* table, const T* layer_cache, int64_t s_block, int64_t s_kv, int64_t bs, int64_t kv_size,
              float scale, float* work, float* parts, int64_t part, const int64_t* first) const {
    const int64_t G = hq_ / hkv_, Dh = dh_, H = un.h1 - un.h0;
    const int64_t n_max = std::min<int64_t>(un.t0 + kPosChunk, pos[un.r1 - 1] + 1) - un.t0;
    float* kts = work;                                 // per head: [Dh][kPosChunk]
    float* scores_buf = work + hkv_ * Dh * kPosChunk;  // [G][kPosChunk]
    float* qrot = scores_buf + G * kPosChunk;          // [G][Dh]
    const T* vp[kPosChunk];                            // each position's values of head h0, in the cache
    const int64_t run = H * Dh * static_cast<int64_t>(sizeof(T));  // bytes of a position's heads [h0, h1)
    // 16 positions at a time, so each line of kt is written whole, transposed in registers (lanes
    // past n_max are computed, never used: zeros keep them finite)
    for (int64_t tb = 0; tb < n_max; tb += 16) {
      const int64_t m = std::min<int64_t>(16, n_max - tb);
      // the cache is read from memory, 16 positions at a time: ask for the next 16's keys and values
      // (into L2) now, so that their misses overlap this block's work (one thread has few loads in flight)
      for (int64_t p = un.t0 + tb + 16; p < std::min(un.t0 + n_max, un.t0 + tb + 32); p++) {
        const T* kp = layer_cache + table[p / bs] * s_block + (p % bs) * kv_size + un.h0 * Dh;
        prefetch<_MM_HINT_T1>(kp, run);
        prefetch<_MM_HINT_T1>(kp + s_kv, run);
      }
      const T* pk[16];
      for (int64_t j = 0; j < m; j++) {
        const int64_t p = un.t0 + tb + j;
        pk[j] = layer_cache + table[p / bs] * s_block + (p % bs) * kv_size + un.h0 * Dh;
        vp[tb + j] = pk[j] + s_kv;
      }
      for (int64_t hh = 0; hh < H; hh++) {
        float* kt = kts + hh * Dh * kPosChunk;
        const T* k[16];
        for (int64_t j = 0; j < m; j++) k[j] = pk[j] + hh * Dh;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (key_pairs()) {
            transpose_key_pairs(k, m, kt + tb);
            continue;
          }
        }
#endif
        transpose_keys(k, m, kt + tb);
      }
    }
    for (int64_t hh = 0; hh < H; hh++) {
      const int64_t h = un.h0 + hh;
      for (int64_t r = un.r0; r < un.r1; r++) {
        if (pos[r] < un.t0) continue;
        const int64_t n = std::min<int64_t>(un.t0 + kPosChunk, pos[r] + 1) - un.t0;
        const float* q = qkv + r * qkv_n + h * G * Dh;
        const float* c = cosp + pos[r] * (Dh / 2);
        const float* sn = sinp + pos[r] * (Dh / 2);
        for (int64_t g = 0; g < G; g++) rotate(q + g * Dh, c, sn, qrot + g * Dh, Dh);
        row_partial<T>(qrot, kts + hh * Dh * kPosChunk, vp, hh * Dh, n, scale, scores_buf,
                       parts + (first[r * hkv_ + h] + un.t0 / kPosChunk) * part);
      }
    }
  }

  // The partial (max, sum, unnormalised o) of one row's G query heads (rotated: qrot) over the first n
  // positions of an item: their kv head's staged keys (kt) and its values, at vp[t] + voff in the
  // cache; scores_buf is scratch.
  template <typename T>
  void row_partial(const float* qrot, const float* kt, const T* const* vp, int64_t voff, int64_t n, float scale,
                   float* scores_buf, float* pr) const {
    const int64_t G = hq_ / hkv_, Dh = dh_;
    row_scores<T>(qrot, kt, n, scale, scores_buf);
    for (int64_t g = 0; g < G; g++) {
      float* sg = scores_buf + g * kPosChunk;
      vf vmx = set1(-INFINITY);
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) vmx = max(vmx, load(sg + t));
      float mx = reduce_max(vmx);
      for (; t < n; t++) mx = std::max(mx, sg[t]);
      const vf m = set1(mx);
      vf sum = zero();
      t = 0;
      for (; t + 16 <= n; t += 16) {
        const vf e = exp16(sub(load(sg + t), m));
        store(sg + t, e);
        sum = add(sum, e);
      }
      float tail = 0.0f;
      for (; t < n; t++) {
        sg[t] = std::exp(sg[t] - mx);
        tail += sg[t];
      }
      pr[g * (Dh + 2)] = mx;
      pr[g * (Dh + 2) + 1] = reduce_add(sum) + tail;
    }
    // o[g] = sum_t p[g, t] v[t], t in order. Head size 64 with up to 4 query heads per kv head keeps
    // the sums in registers; the general loop below does the same operations in the same order.
    if (Dh == 64 && G <= 4) {
      vf acc[4][4];
      for (int g = 0; g < 4; g++)
        for (int cc = 0; cc < 4; cc++) acc[g][cc] = zero();
      for (int64_t t = 0; t < n; t++) {
        const T* v = vp[t] + voff;
        if (t + 16 < n) prefetch<_MM_HINT_T0>(vp[t + 16] + voff, Dh * static_cast<int64_t>(sizeof(T)));
        const vf v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
        for (int g = 0; g < 4; g++) {
          if (g >= G) break;
          const vf w = set1(scores_buf[g * kPosChunk + t]);
          acc[g][0] = fmadd(w, v0, acc[g][0]);
          acc[g][1] = fmadd(w, v1, acc[g][1]);
          acc[g][2] = fmadd(w, v2, acc[g][2]);
          acc[g][3] = fmadd(w, v3, acc[g][3]);
        }
      }
      for (int64_t g = 0; g < G; g++)
        for (int cc = 0; cc < 4; cc++) store(pr + g * (Dh + 2) + 2 + 16 * cc, acc[g][cc]);
      return;
    }
    for (int64_t g = 0; g < G; g++)
      for (int64_t i = 0; i < Dh; i++) pr[g * (Dh + 2) + 2 + i] = 0.0f;
    for (int64_t t = 0; t < n; t++)
      for (int64_t i = 0; i < Dh; i += 16) {
        const vf vv = load16(vp[t] + voff + i);
        for (int64_t g = 0; g < G; g++) {
          float* o = pr + g * (Dh + 2) + 2 + i;
          store(o, fmadd(set1(scores_buf[g * kPosChunk + t]), vv, load(o)));
        }
      }
  }

  // o = sum_u e^(m_u - M) o_u / sum_u e^(m_u - M) l_u over the units [u0, u1) of one (sequence, kv head)
  void merge(const float* parts, int64_t part, int64_t u0, int64_t u1, float* o, int64_t G) const {
    const int64_t Dh = dh_;
    for (int64_t g = 0; g < G; g++) {
      float m = -INFINITY, sum = 0.0f;
      for (int64_t u = u0; u < u1; u++) m = std::max(m, parts[u * part + g * (Dh + 2)]);
      float* og = o + g * Dh;
      for (int64_t i = 0; i < Dh; i++) og[i] = 0.0f;
      for (int64_t u = u0; u < u1; u++) {
        const float* pr = parts + u * part + g * (Dh + 2);
        const float w = std::exp(pr[0] - m);
        sum += w * pr[1];
        for (int64_t i = 0; i < Dh; i++) og[i] += w * pr[2 + i];
      }
      for (int64_t i = 0; i < Dh; i++) og[i] /= sum;
    }
  }

  int64_t hq_, hkv_, dh_, d_ = 0, f_ = 0;
  PreparedX px_qkv_, px_o_, px_gu_, px_down_, px_head_;  // activations in digit form (one step at a time)
  float eps_;
  std::vector<LayerWeights> layers_;
  Weight embed_, head_;
  torch::Tensor final_norm_, cos_, sin_;
};

}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pdserve;
  py::class_<Weight>(m, "Weight")
      .def(py::init<torch::Tensor, int64_t, int64_t, int64_t>(), py::arg("tensor"), py::arg("type"), py::arg("n"), py::arg("k"))
      .def_property_readonly("n", [](const Weight& w) { return w.w.n; })
      .def_property_readonly("k", [](const Weight& w) { return w.w.k; })
      .def_property_readonly("type", [](const Weight& w) { return w.w.type; });
  m.def("matmul", &matmul, "x [M, K] fp32 @ weight^T -> [M, N] fp32", py::call_guard<py::gil_scoped_release>());
  m.def("embed", &embed, "rows of a weight, dequantized to fp32");
  m.def("amx_available", &amx_available, "whether the CPU and the OS allow AMX (and PDSERVE_AMX is not 0)");
  m.def("amx_enabled", &amx_enabled, "whether Q4_1 calls of several rows use AMX now");
  m.def("set_amx", &set_amx, "turn AMX off (or back on where available); the numbers do not change");
  py::class_<DecodeModel>(m, "DecodeModel")
      .def(py::init<int64_t, int64_t, int64_t, double, std::vector<Weight>, std::vector<torch::Tensor>, Weight, Weight,
                    torch::Tensor, torch::Tensor, torch::Tensor>())
      .def("forward", &DecodeModel::forward, py::call_guard<py::gil_scoped_release>());
}
