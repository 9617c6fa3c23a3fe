// Matrix products against weights kept as the checkpoint's blocks of 32 values.
//
// Weight rows, in memory (the loader repacks each row of the file's blocks so that the codes of
// consecutive blocks are contiguous; the values are the file's, bit for bit):
//
//   Q4_1:  qs[nb][16] | d[nb] fp16 | m[nb] fp16     w[j] = (qs[j] & 15) * d + m,  w[j+16] = (qs[j] >> 4) * d + m
//   Q8_0:  u[nb][32]  | d[nb] fp16                  w[j] = (u[j] - 128) * d        (u = the file's int8 code + 128)
//   F32:   w[k]
//
// nb is the number of blocks rounded up to even (a padding block has d = m = 0).
//
// Q4_1 and Q8_0 multiply with exact integer dot products (AVX-512 VNNI, AMX, or AVX2 maddubs +
// madd: simd.h): each block of 32 activations is written as two int8 digits, x ~= s1*x1 + s2*x2
// with s1 = max|x|/127 and s2 = s1/256, so the activation keeps ~16 bits (error <= max|x| * 1.6e-5,
// against bf16's 2^-9 relative), and
//
//   sum_j w_j x_j = d * (s1 * sum q x1 + s2 * sum q x2) + m * sum x      (sum x in fp32)
//
// The order of every floating-point operation of one output (row m, column n) is fixed and does
// not depend on how many rows share the call or which tile or instruction set computes it: a
// sequence's numbers are the same alone, in a batch, in a prefill chunk or in a decode step. That
// order is, with I_b = sum over block b of q * (256 x1 + x2), an exact integer (Q4_1: < 2^24):
//
//   acc[b % 4] = fma(float(I_b) * s2_b, d_b, acc[b % 4]);  acc[b % 4] = fma(m_b, xs_b, acc[b % 4]) (Q4_1)
//   y = (acc[0] + acc[1]) + (acc[2] + acc[3])
//
// which VNNI computes 4 columns x 4 blocks to a vector (lane = block * 4 + column: the weights are
// repacked per 4 columns so that a tile reads one contiguous stream) and AMX 16
// columns to a vector, one block at a time (each block's integer sums from the tile unit). AMX is
// used where the CPU and the OS allow it (PDSERVE_AMX=0 turns it off) for calls of 16+ rows.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace pdserve {

// 64-byte aligned storage: a tile row or vector that straddles two cache lines costs two accesses
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
template <typename T>
using avector = std::vector<T, Aligned64<T>>;

enum WeightType : int { kF32 = 0, kQ4_1 = 3, kQ8_0 = 8 };  // ggml type ids

struct QuantWeight {
  const uint8_t* data = nullptr;  // n rows of row_bytes each (Q4_1/Q8_0: read only by make_weight)
  int64_t n = 0, k = 0;           // out features, in features (k % 32 == 0)
  int64_t nb = 0;                 // blocks per row, padded to even
  int64_t row_bytes = 0;
  int type = kF32;
  // Q4_1 and Q8_0, made by make_weight from the rows (the same values, laid out for the kernels):
  std::shared_ptr<const avector<uint8_t>> groups;      // per 4 columns x 4 blocks: codes, d (, m) (quant_matmul.cpp)
  std::shared_ptr<const avector<int8_t>> amx_codes;  // [n/16][nb][8][64]: AMX B tiles of the codes
  std::shared_ptr<const std::vector<float>> amx_dm;      // [n/16][nb][d | m][16 columns]
};

// Whether AMX is on (the CPU has it, the OS granted it, PDSERVE_AMX is not 0, set_amx did not
// turn it off); set_amx(true) can only turn it back on where it is available.
bool amx_enabled();
bool amx_available();
void set_amx(bool on);

QuantWeight make_weight(const void* data, int type, int64_t n, int64_t k);  // throws on bad type/shape
int64_t weight_bytes(int type, int64_t n, int64_t k);

// Activations in the kernel's form for one weight type: M rows of k values.
struct PreparedX {
  int type = kF32;
  int64_t M = 0, k = 0, nb = 0;
  const float* x = nullptr;  // F32: the rows themselves
  int64_t ldx = 0;
  std::vector<int8_t> d1, d2;  // [M][nb * 32]: digits (Q4_1: per 4 blocks, [x[0:16] of each | x[16:32] of each])
  std::vector<float> s2;       // [Mp][quads][16]: the digit-2 scale of each block, 4 lanes a block
  std::vector<float> xs4;      // Q4_1: [Mp][quads][16] block sums of x, as s2
  std::vector<int32_t> corr;   // Q8_0 with biased codes (AVX-512): [Mp][quads][16] 128 * sum (256 x1 + x2)
  bool amx = false;            // a12 is filled, and calls of 16+ rows use AMX
  avector<int8_t> a12;         // with AMX: the digits as AMX A tiles [Mp/16][nb/2][2][16][64]
};
// (Mp = M rounded up to 16 rows; s2, xs4 and corr are zero past M and past the last block.)

// Rows [m0, m1) of x (row stride ldx) into p (which must already be sized by prepare_resize).
void prepare_resize(PreparedX& p, int type, int64_t M, int64_t k, const float* x, int64_t ldx);
void prepare_rows(PreparedX& p, int64_t m0, int64_t m1);

// y[m, n] for rows m in [m0, m1) (m1 < 0: all M rows) and n in [n0, n1); y has row stride ldy.
// Serial: callers split rows and columns (in blocks that keep a block of prepared rows in L2).
void matmul_cols(const QuantWeight& w, const PreparedX& x, float* y, int64_t ldy, int64_t n0, int64_t n1,
                 int64_t m0 = 0, int64_t m1 = -1);

// out[t, :] = row ids[t] of w, dequantized (the embedding lookup of a tied head), from the groups.
void dequantize_rows(const QuantWeight& w, const int64_t* ids, int64_t T, float* out);

}  // namespace pdserve
