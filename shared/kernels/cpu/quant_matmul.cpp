// See quant_matmul.h. Written against simd.h: AVX-512 (F/BW/VL + VNNI) or AVX2 (+ FMA, F16C).
#include "quant_matmul.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "simd.h"

namespace pdserve {

namespace {

using namespace simd;

// Q4_1 codes are read 4 blocks (64 bytes) at a time, then a last pair (32 bytes); within a group of
// g blocks the digits are laid out to match the nibbles:  [x[0:16] of each block | x[16:32] of each block].
// Q8_0 codes are read 2 blocks (64 bytes) at a time; digits in natural order.
constexpr int kLanesQ4 = 4;  // int32 lanes per block after the dot product (16 bytes of a block per half)
constexpr int kLanesQ8 = 8;
constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead a tile prefetches its weight rows

int64_t padded_blocks(int64_t k) { return (k / 32 + 1) / 2 * 2; }

// Ask for the weight rows a later tile reads ([n, n + count) of w, clipped), so that their misses
// overlap this tile's work: a weight row is read once a step, from L3 or memory.
inline void prefetch_rows(const QuantWeight& w, int64_t n, int64_t count) {
  if (n >= w.n) return;
  const char* p = reinterpret_cast<const char*>(w.data + n * w.row_bytes);
  const int64_t bytes = std::min(count, w.n - n) * w.row_bytes;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// ------------------------------------------------------------------------------------------ F32

template <int MT, int NT>
void tile_f32(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t m, int64_t n) {
  vf acc_lo[MT][NT], acc_hi[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc_lo[i][j] = acc_hi[i][j] = zero();
  for (int64_t b = 0; b < w.k / 32; b++) {
    vf wlo[NT], whi[NT];
    for (int j = 0; j < NT; j++) {
      const float* row = reinterpret_cast<const float*>(w.data + (n + j) * w.row_bytes) + b * 32;
      wlo[j] = load(row);
      whi[j] = load(row + 16);
    }
    for (int i = 0; i < MT; i++) {
      const float* x = px.x + (m + i) * px.ldx + b * 32;
      const vf xlo = load(x), xhi = load(x + 16);
      for (int j = 0; j < NT; j++) {
        acc_lo[i][j] = fmadd(wlo[j], xlo, acc_lo[i][j]);
        acc_hi[i][j] = fmadd(whi[j], xhi, acc_hi[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) y[(m + i) * ldy + n + j] = reduce_add(add(acc_lo[i][j], acc_hi[i][j]));
}

// ----------------------------------------------------------------------------------------- Q4_1

template <int MT, int NT>
void tile_q4_1(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t m, int64_t n) {
  const int64_t nb = w.nb, nquad = nb / 4;
  const bool pair_tail = nb % 4 != 0;
  const uint8_t* qs[NT];
  const uint16_t *ds[NT], *ms[NT];
  for (int j = 0; j < NT; j++) {
    qs[j] = w.data + (n + j) * w.row_bytes;
    ds[j] = reinterpret_cast<const uint16_t*>(qs[j] + nb * 16);
    ms[j] = ds[j] + nb;
  }
  const int64_t xrow = nb * 32, srow = nb * kLanesQ4;
  prefetch_rows(w, n + kPrefetchTiles * NT, NT);
  vf acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = zero();
  for (int64_t q = 0; q < nquad; q++) {
    vb lo[NT], hi[NT];
    vf dv[NT];
    for (int j = 0; j < NT; j++) {
      const vb c = load_b(qs[j] + q * 64);
      lo[j] = lo_nibbles(c);
      hi[j] = hi_nibbles(c);
      dv[j] = bcast4x4(ds[j] + q * 4);
    }
    for (int i = 0; i < MT; i++) {
      const int8_t* x1 = px.d1.data() + (m + i) * xrow + q * 128;
      const int8_t* x2 = px.d2.data() + (m + i) * xrow + q * 128;
      const vb x1lo = load_b(x1), x1hi = load_b(x1 + 64), x2lo = load_b(x2), x2hi = load_b(x2 + 64);
      const vf s2 = load(px.s2.data() + (m + i) * srow + q * 16);
      for (int j = 0; j < NT; j++) {
        const vi i1 = dot_u4x2(lo[j], x1lo, hi[j], x1hi);
        const vi i2 = dot_u4x2(lo[j], x2lo, hi[j], x2hi);
        const vi iv = add_i(shl8(i1), i2);  // sum q * (256 x1 + x2)
        acc[i][j] = fmadd(mul(cvt_f(iv), s2), dv[j], acc[i][j]);
      }
    }
  }
  __m256 acc2[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc2[i][j] = _mm256_setzero_ps();
  if (pair_tail) {
    const int64_t b0 = nquad * 4;
    const __m256i nib2 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < NT; j++) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[j] + b0 * 16));
      const __m256i lo2 = _mm256_and_si256(c, nib2), hi2 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib2);
      const __m256 dv2 = bcast2x4(ds[j] + b0);
      for (int i = 0; i < MT; i++) {
        const __m256i* x1 = reinterpret_cast<const __m256i*>(px.d1.data() + (m + i) * xrow + b0 * 32);
        const __m256i* x2 = reinterpret_cast<const __m256i*>(px.d2.data() + (m + i) * xrow + b0 * 32);
        const __m256i i1 = dpbusd8(dpbusd8(_mm256_setzero_si256(), lo2, _mm256_loadu_si256(x1)), hi2, _mm256_loadu_si256(x1 + 1));
        const __m256i i2 = dpbusd8(dpbusd8(_mm256_setzero_si256(), lo2, _mm256_loadu_si256(x2)), hi2, _mm256_loadu_si256(x2 + 1));
        const __m256i iv = _mm256_add_epi32(_mm256_slli_epi32(i1, 8), i2);
        const __m256 s2 = _mm256_loadu_ps(px.s2.data() + (m + i) * srow + b0 * kLanesQ4);
        acc2[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(iv), s2), dv2, acc2[i][j]);
      }
    }
  }
  // + sum_b m_b * xs_b, 16 blocks at a time, the rest one by one (in registers: a zero-padded copy
  // read back as a vector stalls store forwarding, which cost a fifth of the AVX2 step)
  for (int j = 0; j < NT; j++)
    for (int i = 0; i < MT; i++) {
      const float* xs = px.xs.data() + (m + i) * nb;
      vf macc = zero();
      int64_t b = 0;
      for (; b + 16 <= nb; b += 16) macc = fmadd(load_f16(ms[j] + b), load(xs + b), macc);
      float tail = 0.0f;
      for (; b < nb; b++) tail = std::fma(_cvtsh_ss(ms[j][b]), xs[b], tail);
      y[(m + i) * ldy + n + j] = reduce_add(acc[i][j]) + hsum8(acc2[i][j]) + (reduce_add(macc) + tail);
    }
}

// ----------------------------------------------------------------------------------------- Q8_0

template <int MT, int NT>
void tile_q8_0(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t m, int64_t n) {
  const int64_t nb = w.nb;
  const uint8_t* us[NT];
  const uint16_t* ds[NT];
  for (int j = 0; j < NT; j++) {
    us[j] = w.data + (n + j) * w.row_bytes;
    ds[j] = reinterpret_cast<const uint16_t*>(us[j] + nb * 32);
  }
  const int64_t xrow = nb * 32, srow = nb * kLanesQ8;
  prefetch_rows(w, n + kPrefetchTiles * NT, NT);
  vf acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = zero();
  for (int64_t p = 0; p < nb / 2; p++) {
    vb u[NT];
    vf dv[NT];
    for (int j = 0; j < NT; j++) {
      u[j] = load_b(us[j] + p * 64);
      dv[j] = bcast2x8(ds[j] + p * 2);
    }
    for (int i = 0; i < MT; i++) {
      const vb x1 = load_b(px.d1.data() + (m + i) * xrow + p * 64);
      const vb x2 = load_b(px.d2.data() + (m + i) * xrow + p * 64);
      const vf s2 = load(px.s2.data() + (m + i) * srow + p * 16);
      for (int j = 0; j < NT; j++) {
        vi iv = add_i(shl8(dot_q8(zero_i(), u[j], x1)), dot_q8(zero_i(), u[j], x2));
        // biased codes: sum (q + 128) * (256 x1 + x2) - 128 * sum (256 x1 + x2) = sum q * (256 x1 + x2)
        if constexpr (kQ8Biased) iv = sub_i(iv, load_i(px.c1.data() + (m + i) * srow + p * 16));
        acc[i][j] = fmadd(mul(cvt_f(iv), s2), dv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) y[(m + i) * ldy + n + j] = reduce_add(acc[i][j]);
}

// Rows in tiles of 4 (then 1), columns in tiles of 2 (then 1). Every (m, n) gets the same sequence
// of floating-point operations whatever tile computes it (see the header). AVX2 has 16 vector
// registers, not 32: its 4-row tiles take one column (measured on 2 Zen 3 cores, batch 8: 56 ms
// a step against 59 ms with 2 x 2 tiles).
constexpr int kRowTile = 4;
constexpr bool kWideRowTile = PDSERVE_AVX512;  // 4 x 2 tiles
template <void (*T41)(const QuantWeight&, const PreparedX&, float*, int64_t, int64_t, int64_t),
          void (*T42)(const QuantWeight&, const PreparedX&, float*, int64_t, int64_t, int64_t),
          void (*T14)(const QuantWeight&, const PreparedX&, float*, int64_t, int64_t, int64_t),
          void (*T12)(const QuantWeight&, const PreparedX&, float*, int64_t, int64_t, int64_t),
          void (*T11)(const QuantWeight&, const PreparedX&, float*, int64_t, int64_t, int64_t)>
void tiles(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t m0,
           int64_t m1) {
  int64_t m = m0;
  for (; m + kRowTile <= m1; m += kRowTile) {
    int64_t n = n0;
    if constexpr (kWideRowTile)
      for (; n + 2 <= n1; n += 2) T42(w, px, y, ldy, m, n);
    for (; n < n1; n++) T41(w, px, y, ldy, m, n);
  }
  for (; m < m1; m++) {
    int64_t n = n0;
    if constexpr (kWideRowTile)
      for (; n + 4 <= n1; n += 4) T14(w, px, y, ldy, m, n);
    for (; n + 2 <= n1; n += 2) T12(w, px, y, ldy, m, n);
    for (; n < n1; n++) T11(w, px, y, ldy, m, n);
  }
}

}  // namespace

int64_t weight_bytes(int type, int64_t n, int64_t k) {
  if (k % 32 != 0) throw std::invalid_argument("in_features must be a multiple of 32, got " + std::to_string(k));
  const int64_t nb = padded_blocks(k);
  switch (type) {
    case kF32: return n * k * 4;
    case kQ4_1: return n * nb * 20;
    case kQ8_0: return n * nb * 34;
  }
  throw std::invalid_argument("unsupported weight type " + std::to_string(type));
}

QuantWeight make_weight(const void* data, int type, int64_t n, int64_t k) {
  QuantWeight w;
  w.data = static_cast<const uint8_t*>(data);
  w.type = type;
  w.n = n;
  w.k = k;
  w.nb = padded_blocks(k);
  w.row_bytes = weight_bytes(type, 1, k);
  return w;
}

void prepare_resize(PreparedX& p, int type, int64_t M, int64_t k, const float* x, int64_t ldx) {
  p.type = type;
  p.M = M;
  p.k = k;
  p.nb = padded_blocks(k);
  p.x = x;
  p.ldx = ldx;
  if (type == kF32) return;
  const int lanes = type == kQ4_1 ? kLanesQ4 : kLanesQ8;
  p.d1.resize(M * p.nb * 32);
  p.d2.resize(M * p.nb * 32);
  p.s2.resize(M * p.nb * lanes);
  if (type == kQ4_1) p.xs.resize(M * p.nb);
  if (type == kQ8_0 && kQ8Biased) p.c1.resize(M * p.nb * lanes);
}

void prepare_rows(PreparedX& p, int64_t m0, int64_t m1) {
  if (p.type == kF32) return;
  const int64_t nb = p.nb, nreal = p.k / 32, nquad = nb / 4;
  const int lanes = p.type == kQ4_1 ? kLanesQ4 : kLanesQ8;
  for (int64_t m = m0; m < m1; m++) {
    const float* x = p.x + m * p.ldx;
    int8_t* d1 = p.d1.data() + m * nb * 32;
    int8_t* d2 = p.d2.data() + m * nb * 32;
    float* s2v = p.s2.data() + m * nb * lanes;
    for (int64_t b = 0; b < nb; b++) {
      alignas(64) int8_t q1[32], q2[32];
      float s2 = 0.0f, xs = 0.0f;
      int32_t sum1 = 0, sum2 = 0;
      if (b < nreal) {
        const vf lo = load(x + b * 32), hi = load(x + b * 32 + 16);
        xs = reduce_add(add(lo, hi));
        const float amax = std::max(reduce_max(abs(lo)), reduce_max(abs(hi)));
        if (amax > 0.0f) {
          const float s1 = amax / 127.0f;
          s2 = s1 / 256.0f;  // exact: s1 = 256 * s2
          const vf vs1 = set1(s1), vs2 = set1(s2);
          for (int h = 0; h < 2; h++) {
            const vf v = h ? hi : lo;
            const vi a = clamp127(cvt_i(div(v, vs1)));
            const vf r = fnmadd(cvt_f(a), vs1, v);
            const vi c = clamp127(cvt_i(div(r, vs2)));
            store_i8(q1 + 16 * h, a);
            store_i8(q2 + 16 * h, c);
            sum1 += reduce_add_i(a);
            sum2 += reduce_add_i(c);
          }
        } else {
          std::fill(q1, q1 + 32, 0);
          std::fill(q2, q2 + 32, 0);
        }
      } else {  // padding block
        std::fill(q1, q1 + 32, 0);
        std::fill(q2, q2 + 32, 0);
      }
      for (int l = 0; l < lanes; l++) s2v[b * lanes + l] = s2;
      if (p.type == kQ4_1) {
        p.xs[m * nb + b] = xs;
        // group of g blocks starting at g0: [x[0:16] of each | x[16:32] of each]
        const int64_t g0 = b < nquad * 4 ? b / 4 * 4 : nquad * 4, g = b < nquad * 4 ? 4 : 2, at = b - g0;
        for (int h = 0; h < 2; h++) {
          std::copy(q1 + 16 * h, q1 + 16 * h + 16, d1 + g0 * 32 + h * g * 16 + at * 16);
          std::copy(q2 + 16 * h, q2 + 16 * h + 16, d2 + g0 * 32 + h * g * 16 + at * 16);
        }
      } else {
        std::copy(q1, q1 + 32, d1 + b * 32);
        std::copy(q2, q2 + 32, d2 + b * 32);
        if (kQ8Biased) {
          int32_t* c = p.c1.data() + m * nb * lanes + b * lanes;
          c[0] = 128 * (256 * sum1 + sum2);
          for (int l = 1; l < lanes; l++) c[l] = 0;
        }
      }
    }
  }
}

void matmul_cols(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t m0,
                 int64_t m1) {
  if (px.type != w.type || px.k != w.k) throw std::invalid_argument("activations prepared for another weight");
  if (m1 < 0) m1 = px.M;
  switch (w.type) {
    case kQ4_1:
      return tiles<tile_q4_1<kRowTile, 1>, tile_q4_1<kRowTile, 2>, tile_q4_1<1, 4>, tile_q4_1<1, 2>, tile_q4_1<1, 1>>(w, px, y, ldy, n0, n1, m0, m1);
    case kQ8_0:
      return tiles<tile_q8_0<kRowTile, 1>, tile_q8_0<kRowTile, 2>, tile_q8_0<1, 4>, tile_q8_0<1, 2>, tile_q8_0<1, 1>>(w, px, y, ldy, n0, n1, m0, m1);
    case kF32:
      return tiles<tile_f32<kRowTile, 1>, tile_f32<kRowTile, 2>, tile_f32<1, 4>, tile_f32<1, 2>, tile_f32<1, 1>>(w, px, y, ldy, n0, n1, m0, m1);
  }
  throw std::invalid_argument("unsupported weight type " + std::to_string(w.type));
}

void dequantize_rows(const QuantWeight& w, const int64_t* ids, int64_t T, float* out) {
  for (int64_t t = 0; t < T; t++) {
    const uint8_t* row = w.data + ids[t] * w.row_bytes;
    float* o = out + t * w.k;
    if (w.type == kF32) {
      std::copy(reinterpret_cast<const float*>(row), reinterpret_cast<const float*>(row) + w.k, o);
      continue;
    }
    for (int64_t b = 0; b < w.k / 32; b++) {
      if (w.type == kQ4_1) {
        const uint16_t* dm = reinterpret_cast<const uint16_t*>(row + w.nb * 16);
        const float d = _cvtsh_ss(dm[b]), mn = _cvtsh_ss(dm[w.nb + b]);
        for (int j = 0; j < 16; j++) {
          const uint8_t c = row[b * 16 + j];
          o[b * 32 + j] = std::fma(static_cast<float>(c & 15), d, mn);
          o[b * 32 + j + 16] = std::fma(static_cast<float>(c >> 4), d, mn);
        }
      } else {
        const float d = _cvtsh_ss(reinterpret_cast<const uint16_t*>(row + w.nb * 32)[b]);
        for (int j = 0; j < 32; j++) o[b * 32 + j] = static_cast<float>(static_cast<int>(row[b * 32 + j]) - 128) * d;
      }
    }
  }
}

}  // namespace pdserve
