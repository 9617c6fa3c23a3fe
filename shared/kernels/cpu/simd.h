// Sixteen-lane vectors for the CPU kernels, on AVX-512 (F/BW/VL + VNNI) or on AVX2 (+ FMA, F16C).
//
// The kernels are written once against these types. On AVX-512 each is one zmm register; on AVX2
// it is two ymm registers (lanes 0-7 and 8-15) and every operation is done lane for lane the same
// way, so a lane's result is the same on both: the integer dot products are exact on both, and
// each floating-point lane sees the same operations in the same order. (Horizontal sums add the
// two halves first, then within a half, as GCC's _mm512_reduce_add_ps does.)
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PDSERVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_AVX512 0
#else
#error "the CPU kernels need AVX-512 (F, BW, VL, VNNI) or AVX2 with FMA and F16C"
#endif

namespace pdserve::simd {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// sum of 4 products u8 * s8 into each int32 lane of acc, exact. On AVX2 the pair sums of maddubs
// saturate at 2^15: callers keep |u * s| + |u' * s'| below that (u <= 15 for nibbles; see dot_s8).
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if PDSERVE_AVX512
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if PDSERVE_AVX512

struct vf {
  __m512 v;
};
struct vi {
  __m512i v;
};
struct vb {  // 64 bytes
  __m512i v;
};

inline vf zero() { return {_mm512_setzero_ps()}; }
inline vf set1(float x) { return {_mm512_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
inline vf load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline vf load_bf16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline vf add(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf sub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf mul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf div(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf min(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf max(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf abs(vf a) { return {_mm512_abs_ps(a.v)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline vf fnmadd(vf a, vf b, vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline vf round(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline float reduce_add(vf a) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a.v), hi));
}
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a.v); }
// a * 2^n for integral n in [-252, 254] (n as floats)
inline vf scale2(vf a, vf n) { return {_mm512_scalef_ps(a.v, n.v)}; }

inline vi cvt_i(vf a) { return {_mm512_cvtps_epi32(a.v)}; }  // round to nearest even
inline vf cvt_f(vi a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline vi clamp127(vi a) { return {_mm512_max_epi32(_mm512_min_epi32(a.v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127))}; }
inline vi zero_i() { return {_mm512_setzero_si512()}; }
inline vi load_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline vi add_i(vi a, vi b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline vi sub_i(vi a, vi b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline vi shl8(vi a) { return {_mm512_slli_epi32(a.v, 8)}; }
inline int32_t reduce_add_i(vi a) { return _mm512_reduce_add_epi32(a.v); }
inline void store_i8(int8_t* p, vi a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }

inline vb load_b(const void* p) { return {_mm512_loadu_si512(p)}; }
// 32 bytes into the low half, zeros above
inline vb load_b32(const void* p) { return {_mm512_zextsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(p)))}; }
// per 128-bit chunk, as _mm_unpack{lo,hi}_epi{32,64}
inline vi unpacklo32(vi a, vi b) { return {_mm512_unpacklo_epi32(a.v, b.v)}; }
inline vi unpackhi32(vi a, vi b) { return {_mm512_unpackhi_epi32(a.v, b.v)}; }
inline vi unpacklo64(vi a, vi b) { return {_mm512_unpacklo_epi64(a.v, b.v)}; }
inline vi unpackhi64(vi a, vi b) { return {_mm512_unpackhi_epi64(a.v, b.v)}; }
// 128-bit chunks: (c1, c0, c3, c2) of a; (a0, a2, b0, b2)
inline vi swap_chunk_pairs(vi a) { return {_mm512_shuffle_i32x4(a.v, a.v, _MM_SHUFFLE(2, 3, 0, 1))}; }
inline vi even_chunks(vi a, vi b) { return {_mm512_shuffle_i32x4(a.v, b.v, _MM_SHUFFLE(2, 0, 2, 0))}; }
inline vb lo_nibbles(vb a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline vb hi_nibbles(vb a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
// per int32 lane: the sum of 4 products u * s plus 4 products v * t (u, v: u8 at most 15; s, t: s8)
inline vi dot_u4x2(vb u, vb s, vb v, vb t) { return {_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u.v, s.v), v.v, t.v)}; }
// acc + sum of 4 products (u - 128) * s per int32 lane, for u8 codes biased by 128, less the
// correction: here sum u * s, so callers subtract 128 * sum s (kQ8Biased)
constexpr bool kQ8Biased = true;
inline vi dot_q8(vi acc, vb u, vb s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }

// 16 x 16 transpose: r[i] lane j <- r[j] lane i
__attribute__((always_inline)) inline void transpose16(vf r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  __m512 u[16];
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; i++) {
    r[i].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
// a lane holding two bf16 values (the first in its low half, as in memory) -> each as fp32, exactly
inline vf bf16_lo(vf a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(a.v), 16))}; }
inline vf bf16_hi(vf a) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

#else  // AVX2

struct vf {
  __m256 lo, hi;
};
struct vi {
  __m256i lo, hi;
};
struct vb {
  __m256i lo, hi;
};

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline vf load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline vf load_bf16(const uint16_t* p) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
#define PDSERVE_BINOP(name, op) \
  inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
PDSERVE_BINOP(add, _mm256_add_ps)
PDSERVE_BINOP(sub, _mm256_sub_ps)
PDSERVE_BINOP(mul, _mm256_mul_ps)
PDSERVE_BINOP(div, _mm256_div_ps)
PDSERVE_BINOP(min, _mm256_min_ps)
PDSERVE_BINOP(max, _mm256_max_ps)
#undef PDSERVE_BINOP
inline vf abs(vf a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf round(vf a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline float reduce_add(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(vf a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// a * 2^n for integral n in [-252, 254], in two exact steps of 2^(n/2) (each a normal float)
inline __m256 scale2_8(__m256 a, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
inline vf scale2(vf a, vf n) { return {scale2_8(a.lo, n.lo), scale2_8(a.hi, n.hi)}; }

inline vi cvt_i(vf a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline vf cvt_f(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline vi clamp127(vi a) {
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  return {_mm256_max_epi32(_mm256_min_epi32(a.lo, lim), nlim), _mm256_max_epi32(_mm256_min_epi32(a.hi, lim), nlim)};
}
inline vi zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi load_i(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline vi add_i(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline vi sub_i(vi a, vi b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline vi shl8(vi a) { return {_mm256_slli_epi32(a.lo, 8), _mm256_slli_epi32(a.hi, 8)}; }
inline int32_t reduce_add_i(vi a) { return hsum8i(_mm256_add_epi32(a.lo, a.hi)); }
// 16 int32 lanes in [-128, 127] -> 16 bytes, in lane order
inline void store_i8(int8_t* p, vi a) {
  const __m256i w = _mm256_packs_epi32(a.lo, a.hi);  // per 128-bit half: lo0-3 hi0-3 | lo4-7 hi4-7
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  // b = lo0-3 hi0-3 lo4-7 hi4-7 (as dwords: 0 1 2 3) -> lo0-7 hi0-7
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(b, 0xD8));
}

inline vb load_b(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline vb load_b32(const void* p) { return {_mm256_loadu_si256(static_cast<const __m256i*>(p)), _mm256_setzero_si256()}; }
inline vi unpacklo32(vi a, vi b) { return {_mm256_unpacklo_epi32(a.lo, b.lo), _mm256_unpacklo_epi32(a.hi, b.hi)}; }
inline vi unpackhi32(vi a, vi b) { return {_mm256_unpackhi_epi32(a.lo, b.lo), _mm256_unpackhi_epi32(a.hi, b.hi)}; }
inline vi unpacklo64(vi a, vi b) { return {_mm256_unpacklo_epi64(a.lo, b.lo), _mm256_unpacklo_epi64(a.hi, b.hi)}; }
inline vi unpackhi64(vi a, vi b) { return {_mm256_unpackhi_epi64(a.lo, b.lo), _mm256_unpackhi_epi64(a.hi, b.hi)}; }
inline vi swap_chunk_pairs(vi a) { return {_mm256_permute2x128_si256(a.lo, a.lo, 0x01), _mm256_permute2x128_si256(a.hi, a.hi, 0x01)}; }
inline vi even_chunks(vi a, vi b) { return {_mm256_permute2x128_si256(a.lo, a.hi, 0x20), _mm256_permute2x128_si256(b.lo, b.hi, 0x20)}; }
inline vb lo_nibbles(vb a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline vb hi_nibbles(vb a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}
// as on AVX-512; the two products' int16 pair sums are added before widening (each at most
// 2 * 15 * 127, so their sum cannot saturate): one madd instead of two
inline __m256i dot_u4x2_8(__m256i u, __m256i s, __m256i v, __m256i t) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
inline vi dot_u4x2(vb u, vb s, vb v, vb t) { return {dot_u4x2_8(u.lo, s.lo, v.lo, t.lo), dot_u4x2_8(u.hi, s.hi, v.hi, t.hi)}; }
// acc + sum of 4 products (u - 128) * s per int32 lane, exact: |u - 128| as u8 times s with the
// sign of u - 128 (pair sums at most 2 * 128 * 127 < 2^15); no correction needed
constexpr bool kQ8Biased = false;
inline __m256i dot_q8_8(__m256i acc, __m256i u, __m256i s) {
  const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed code
  return dpbusd8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}
inline vi dot_q8(vi acc, vb u, vb s) { return {dot_q8_8(acc.lo, u.lo, s.lo), dot_q8_8(acc.hi, u.hi, s.hi)}; }

__attribute__((always_inline)) inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
// 16 x 16 transpose as four 8 x 8 ones: r[i] lane j <- r[j] lane i
__attribute__((always_inline)) inline void transpose16(vf r[16]) {
  __m256 a[8], b[8], c[8], d[8];
  for (int i = 0; i < 8; i++) {
    a[i] = r[i].lo;
    b[i] = r[i].hi;
    c[i] = r[i + 8].lo;
    d[i] = r[i + 8].hi;
  }
  transpose8(a);
  transpose8(b);
  transpose8(c);
  transpose8(d);
  for (int i = 0; i < 8; i++) {
    r[i] = {a[i], c[i]};
    r[i + 8] = {b[i], d[i]};
  }
}
inline __m256 bf16_lo8(__m256 a) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(a), 16)); }
inline __m256 bf16_hi8(__m256 a) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline vf bf16_lo(vf a) { return {bf16_lo8(a.lo), bf16_lo8(a.hi)}; }
inline vf bf16_hi(vf a) { return {bf16_hi8(a.lo), bf16_hi8(a.hi)}; }

#endif

}  // namespace pdserve::simd
