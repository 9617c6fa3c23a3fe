// See quant_matmul.h. Written against simd.h: AVX-512 (F/BW/VL + VNNI) or AVX2 (+ FMA, F16C).
#include "quant_matmul.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "simd.h"

#if PDSERVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PDSERVE_AMX 1
#else
#define PDSERVE_AMX 0
#endif

namespace pdserve {

namespace {

using namespace simd;

// Q4_1 codes are read 4 blocks (64 bytes) at a time, then a last pair (32 bytes); within a group of
// g blocks the digits are laid out to match the nibbles:  [x[0:16] of each block | x[16:32] of each block].
// Q8_0 codes are read 4 blocks at a time as two 64-byte halves; digits in natural order.
constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead a tile prefetches its weights

int64_t padded_blocks(int64_t k) { return (k / 32 + 1) / 2 * 2; }

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

int64_t quads(int64_t nb) { return (nb + 3) / 4; }
// QuantWeight::groups, per 4 columns and 4 blocks ("quad"; a last pair of blocks is padded with
// zeros): the columns' codes (Q4_1: 64 bytes each, Q8_0: 128), then d (and Q4_1's m) as fp16,
// lane = block * 4 + column
constexpr int64_t kQuadBytesQ4 = 4 * 64 + 2 * 32, kQuadBytesQ8 = 4 * 128 + 32;
inline int64_t quad_bytes(int type) { return type == kQ4_1 ? kQuadBytesQ4 : kQuadBytesQ8; }

// The group of columns [n, n + 4) in QuantWeight::groups (quads of qbytes each), after asking for
// the group a later tile reads (kPrefetchTiles on), so that its misses overlap this tile's work
inline const uint8_t* group_of(const QuantWeight& w, int64_t n, int64_t qbytes) {
  const int64_t bytes = quads(w.nb) * qbytes;
  const uint8_t* group = w.groups->data() + n / 4 * bytes;
  if (n + kPrefetchTiles * 4 < w.n) {
    const char* ahead = reinterpret_cast<const char*>(group + kPrefetchTiles * bytes);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
  }
  return group;
}
int64_t padded_rows(int64_t M) { return (M + 15) / 16 * 16; }

// 4 vectors of 4 blocks x 4 partial sums (lane = block * 4 + partial), one per column -> one vector
// of the blocks' sums, lane = block * 4 + column. Exact (integers).
inline vi block_sums(const vi iv[4]) {
  const vi s01 = add_i(unpacklo32(iv[0], iv[1]), unpackhi32(iv[0], iv[1]));  // c0 p02, c1 p02, c0 p13, c1 p13
  const vi s23 = add_i(unpacklo32(iv[2], iv[3]), unpackhi32(iv[2], iv[3]));
  return add_i(unpacklo64(s01, s23), unpackhi64(s01, s23));
}

// y = (acc[0] + acc[1]) + (acc[2] + acc[3]) for the 4 columns of a lane = block * 4 + column vector
inline void store_4cols(vf acc, float* y, int ncols) {
  alignas(64) float a[16];
  store(a, acc);
  for (int j = 0; j < ncols; j++) y[j] = (a[j] + a[4 + j]) + (a[8 + j] + a[12 + j]);
}

// MT rows x 4 columns [n, n + 4), n % 4 == 0, of which the first ncols are stored (columns past
// w.n have zero weights). Reads the 4 columns' group of QuantWeight::groups, one contiguous stream.
template <int MT>
void tile_q4_1(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t m, int64_t n, int ncols) {
  const int64_t nb = w.nb, nquad = nb / 4, nq = quads(nb);
  const uint8_t* group = group_of(w, n, kQuadBytesQ4);
  const int64_t xrow = nb * 32, srow = nq * 16;
  vf acc[MT];
  for (int i = 0; i < MT; i++) acc[i] = zero();
  for (int64_t q = 0; q < nq; q++) {
    const bool pair = q == nquad;  // a last group of 2 blocks: 32 bytes, the upper lanes zero
    const uint8_t* quad = group + q * kQuadBytesQ4;
    vb lo[4], hi[4];
    for (int j = 0; j < 4; j++) {
      const vb c = load_b(quad + j * 64);
      lo[j] = lo_nibbles(c);
      hi[j] = hi_nibbles(c);
    }
    const uint16_t* dm = reinterpret_cast<const uint16_t*>(quad + 256);
    const vf dv = load_f16(dm), mv = load_f16(dm + 16);
    for (int i = 0; i < MT; i++) {
      const int8_t* x1 = px.d1.data() + (m + i) * xrow + q * 128;
      const int8_t* x2 = px.d2.data() + (m + i) * xrow + q * 128;
      const int64_t half = pair ? 32 : 64;
      const vb x1lo = pair ? load_b32(x1) : load_b(x1), x1hi = pair ? load_b32(x1 + half) : load_b(x1 + half);
      const vb x2lo = pair ? load_b32(x2) : load_b(x2), x2hi = pair ? load_b32(x2 + half) : load_b(x2 + half);
      vi iv[4];
      for (int j = 0; j < 4; j++)  // sum q * (256 x1 + x2), 8 products a lane
        iv[j] = add_i(shl8(dot_u4x2(lo[j], x1lo, hi[j], x1hi)), dot_u4x2(lo[j], x2lo, hi[j], x2hi));
      const int64_t at = (m + i) * srow + q * 16;
      acc[i] = fmadd(mul(cvt_f(block_sums(iv)), load(px.s2.data() + at)), dv, acc[i]);
      acc[i] = fmadd(mv, load(px.xs4.data() + at), acc[i]);
    }
  }
  for (int i = 0; i < MT; i++) store_4cols(acc[i], y + (m + i) * ldy + n, ncols);
}

// Where row m's digit-1 values of block b go in PreparedX::a12 (digit 2: 1,024 bytes on): one
// A tile (16 rows x a pair of blocks, 64 bytes a row) is 1,024 contiguous bytes.
inline int64_t amx_a_offset(int64_t m, int64_t b, int64_t nb) { return (m / 16 * nb + b / 2 * 2) * 1024 + m % 16 * 64 + b % 2 * 32; }

#if PDSERVE_AMX
// Tiles: 0 and 1 the two digits of 16 rows x one block (A, K = 32), 2 and 3 a block's codes of 16
// columns (B), 4-7 the integer sums (C) of digit 1 and 2. Even blocks use B 2 and C 4/5, odd ones
// B 3 and C 6/7, so that one block's products need not wait for the last block's sums to be
// stored. Loaded on each call (and released after): other code on the thread may use AMX too.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {32, 32, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 8, 8, 16, 16, 16, 16};
};

// Q4_1 codes are unsigned (0..15), Q8_0's signed: digits x codes with tdpbsud or tdpbssd
#define PDSERVE_AMX_BLOCK(B, C1, C2, b)                             \
  do {                                                               \
    const int8_t* at = a + (b) / 2 * 2048 + (b) % 2 * 32;            \
    _tile_loadd(0, at, 64);                                          \
    _tile_loadd(1, at + 1024, 64);                                   \
    _tile_loadd(B, codes + (b) * 512, 64);                           \
    _tile_zero(C1);                                                  \
    _tile_zero(C2);                                                  \
    if constexpr (kQ8) {                                             \
      _tile_dpbssd(C1, 0, B);                                        \
      _tile_dpbssd(C2, 1, B);                                        \
    } else {                                                         \
      _tile_dpbsud(C1, 0, B);                                        \
      _tile_dpbsud(C2, 1, B);                                        \
    }                                                                \
    _tile_stored(C1, sums[(b) % 2][0], 64);                          \
    _tile_stored(C2, sums[(b) % 2][1], 64);                          \
  } while (0)

// rows [m0, m1) x 16 columns [n, n + 16), n % 16 == 0: the order of the header, 16 columns a vector.
// Block b's integer sums come from the tile unit while block b - 1's are scaled and accumulated.
template <bool kQ8>
void amx_cols(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t n, int ncols, int64_t m0,
              int64_t m1) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t nb = w.nb, nreal = w.k / 32, srow = quads(nb) * 16;
  const int8_t* codes = w.amx_codes->data() + n / 16 * nb * 512;
  const float* dm = w.amx_dm->data() + n / 16 * nb * 32;
  alignas(64) int32_t sums[2][2][256];
  alignas(64) float acc[4][16][16];
  // acc[b % 4] = fma(float(I_b) * s2_b, d_b, acc[b % 4]), then (Q4_1) acc[b % 4] = fma(m_b, xs_b, acc[b % 4])
  auto scale = [&](int64_t r0, int64_t b) {
    const vf dv = load(dm + b * 32), mv = load(dm + b * 32 + 16);
    const float* s2 = px.s2.data() + r0 * srow + b * 4;
    const float* xs = kQ8 ? nullptr : px.xs4.data() + r0 * srow + b * 4;
    const int32_t* c1 = sums[b % 2][0];
    const int32_t* c2 = sums[b % 2][1];
    float* out = acc[b % 4][0];
    for (int r = 0; r < 16; r++) {
      const vi iv = add_i(shl8(load_i(c1 + r * 16)), load_i(c2 + r * 16));
      vf v = fmadd(mul(cvt_f(iv), set1(s2[r * srow])), dv, load(out + r * 16));
      if constexpr (!kQ8) v = fmadd(mv, set1(xs[r * srow]), v);
      store(out + r * 16, v);
    }
  };
  for (int64_t r0 = m0; r0 < m1; r0 += 16) {  // rows past M are zeros in a12 and s2 (padded to 16)
    const int8_t* a = px.a12.data() + r0 / 16 * nb * 1024;
    std::fill(acc[0][0], acc[0][0] + 4 * 256, 0.0f);
    for (int64_t b = 0; b < nreal; b++) {
      if (b % 2 == 0)
        PDSERVE_AMX_BLOCK(2, 4, 5, b);
      else
        PDSERVE_AMX_BLOCK(3, 6, 7, b);
      if (b > 0) scale(r0, b - 1);
    }
    scale(r0, nreal - 1);
    const int rows = static_cast<int>(std::min<int64_t>(16, m1 - r0));
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < ncols; j++)
        y[(r0 + r) * ldy + n + j] = (acc[0][r][j] + acc[1][r][j]) + (acc[2][r][j] + acc[3][r][j]);
  }
  _tile_release();  // the tile state back to its initial one: no 8 KB saved at each context switch
}
#undef PDSERVE_AMX_BLOCK
#endif

// ----------------------------------------------------------------------------------------- Q8_0

// MT rows x 4 columns [n, n + 4) as tile_q4_1: each column's two 64-byte halves of a quad (blocks
// 0-1 and 2-3, 8 lanes a block) are folded to one block per chunk pair, then summed across columns.
template <int MT>
void tile_q8_0(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t m, int64_t n, int ncols) {
  const int64_t nb = w.nb, nquad = nb / 4, nq = quads(nb);
  const uint8_t* group = group_of(w, n, kQuadBytesQ8);
  const int64_t xrow = nb * 32, srow = nq * 16;
  vf acc[MT];
  for (int i = 0; i < MT; i++) acc[i] = zero();
  for (int64_t q = 0; q < nq; q++) {
    const bool pair = q == nquad;  // a last group of 2 blocks: blocks 2-3 are zeros
    const uint8_t* quad = group + q * kQuadBytesQ8;
    vb ua[4], ub[4];
    for (int j = 0; j < 4; j++) {
      ua[j] = load_b(quad + j * 128);
      ub[j] = load_b(quad + j * 128 + 64);
    }
    const vf dv = load_f16(reinterpret_cast<const uint16_t*>(quad + 512));
    for (int i = 0; i < MT; i++) {
      const int8_t* x1 = px.d1.data() + (m + i) * xrow + q * 128;
      const int8_t* x2 = px.d2.data() + (m + i) * xrow + q * 128;
      const vb x1a = load_b(x1), x2a = load_b(x2);
      const vb x1b = pair ? vb{} : load_b(x1 + 64), x2b = pair ? vb{} : load_b(x2 + 64);
      vi fa[4], fb[4];
      for (int j = 0; j < 4; j++) {  // sum q * (256 x1 + x2) (biased codes: + 128 * that of the digits)
        const vi a = add_i(shl8(dot_q8(zero_i(), ua[j], x1a)), dot_q8(zero_i(), ua[j], x2a));
        const vi b = add_i(shl8(dot_q8(zero_i(), ub[j], x1b)), dot_q8(zero_i(), ub[j], x2b));
        fa[j] = add_i(a, swap_chunk_pairs(a));
        fb[j] = add_i(b, swap_chunk_pairs(b));
      }
      vi sums = even_chunks(block_sums(fa), block_sums(fb));
      const int64_t at = (m + i) * srow + q * 16;
      if constexpr (kQ8Biased) sums = sub_i(sums, load_i(px.corr.data() + at));
      acc[i] = fmadd(mul(cvt_f(sums), load(px.s2.data() + at)), dv, acc[i]);
    }
  }
  for (int i = 0; i < MT; i++) store_4cols(acc[i], y + (m + i) * ldy + n, ncols);
}

// F32 weights: rows in tiles of 4 (then 1), columns in tiles of 2 (then 1). Every (m, n) gets the same sequence
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

// Q4_1 and Q8_0: 16 columns at a time on AMX for calls of several rows, else tiles of 4 columns x
// kRowTileQ rows (then 1); the same numbers either way (the header).
constexpr int64_t kAmxMinRows = 16;
constexpr int kRowTileQ = PDSERVE_AVX512 ? 4 : 1;  // AVX2's 16 registers hold one row's 4 columns
template <bool kQ8>
void quant_cols(const QuantWeight& w, const PreparedX& px, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t m0,
                int64_t m1) {
  if (n0 % 4 != 0) throw std::invalid_argument("column ranges of a Q4_1 or Q8_0 weight start at a multiple of 4");
#if PDSERVE_AMX
  if (px.amx && w.amx_codes && n0 % 16 == 0 && m0 % 16 == 0 && m1 - m0 >= kAmxMinRows && amx_enabled()) {
    for (int64_t n = n0; n < n1; n += 16)
      amx_cols<kQ8>(w, px, y, ldy, n, static_cast<int>(std::min<int64_t>(16, n1 - n)), m0, m1);
    return;
  }
#endif
  constexpr auto tile1 = kQ8 ? tile_q8_0<1> : tile_q4_1<1>;
  constexpr auto tileR = kQ8 ? tile_q8_0<kRowTileQ> : tile_q4_1<kRowTileQ>;
  int64_t m = m0;
  for (; m + kRowTileQ <= m1; m += kRowTileQ)
    for (int64_t n = n0; n < n1; n += 4) tileR(w, px, y, ldy, m, n, static_cast<int>(std::min<int64_t>(4, n1 - n)));
  for (; m < m1; m++)
    for (int64_t n = n0; n < n1; n += 4) tile1(w, px, y, ldy, m, n, static_cast<int>(std::min<int64_t>(4, n1 - n)));
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

namespace {

// The OS must grant a process the AMX tile state (Linux: arch_prctl) before it may use it; a VM may
// advertise AMX in cpuid and still not enable it in XCR0.
bool amx_granted() {
#if PDSERVE_AMX
  const char* env = std::getenv("PDSERVE_AMX");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (eax & (3u << 17)) == (3u << 17);  // XTILECFG and XTILEDATA
#else
  return false;
#endif
}

std::atomic<bool> g_amx_on{amx_available()};

// The checkpoint rows of a Q4_1 or Q8_0 weight, laid out again for the kernels (the same values):
// the 4-column stream of the VNNI tiles, and where the OS grants AMX, the B tiles and scales.
void pack(QuantWeight& w) {
  const bool q4 = w.type == kQ4_1;
  const int64_t nb = w.nb, nq = quads(nb), qbytes = quad_bytes(w.type), code_bytes = q4 ? 16 : 32;
  auto groups = std::make_shared<avector<uint8_t>>((w.n + 3) / 4 * nq * qbytes, 0);
  for (int64_t c = 0; c < w.n; c++) {
    const uint8_t* row = w.data + c * w.row_bytes;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(row + nb * code_bytes);
    for (int64_t q = 0; q < nq; q++) {
      uint8_t* quad = groups->data() + (c / 4 * nq + q) * qbytes;
      const int64_t blocks = std::min<int64_t>(4, nb - q * 4);
      const uint8_t* from = row + q * 4 * code_bytes;
      std::copy(from, from + blocks * code_bytes, quad + c % 4 * 4 * code_bytes);
      uint16_t* dm = reinterpret_cast<uint16_t*>(quad + 16 * code_bytes);
      for (int64_t g = 0; g < blocks; g++) {
        dm[g * 4 + c % 4] = d[q * 4 + g];
        if (q4) dm[16 + g * 4 + c % 4] = d[nb + q * 4 + g];
      }
    }
  }
  w.groups = std::move(groups);
  if (!amx_available()) return;
  const int64_t tiles = (w.n + 15) / 16;
  auto codes = std::make_shared<avector<int8_t>>(tiles * nb * 512, 0);
  auto dm = std::make_shared<std::vector<float>>(tiles * nb * 32, 0.0f);
  for (int64_t c = 0; c < w.n; c++) {
    const uint8_t* row = w.data + c * w.row_bytes;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(row + nb * code_bytes);
    for (int64_t b = 0; b < nb; b++) {
      int8_t* tile = codes->data() + (c / 16 * nb + b) * 512;
      for (int k = 0; k < 32; k++) {  // B[k / 4][column * 4 + k % 4] = code k of the block
        int8_t code;
        if (q4) {
          const uint8_t byte = row[b * 16 + k % 16];
          code = static_cast<int8_t>(k < 16 ? byte & 15 : byte >> 4);
        } else {
          code = static_cast<int8_t>(static_cast<int>(row[b * 32 + k]) - 128);
        }
        tile[k / 4 * 64 + c % 16 * 4 + k % 4] = code;
      }
      float* f = dm->data() + (c / 16 * nb + b) * 32;
      f[c % 16] = _cvtsh_ss(d[b]);
      if (q4) f[16 + c % 16] = _cvtsh_ss(d[nb + b]);
    }
  }
  w.amx_codes = std::move(codes);
  w.amx_dm = std::move(dm);
}

}  // namespace

bool amx_available() {
  static const bool granted = amx_granted();
  return granted;
}
bool amx_enabled() { return g_amx_on.load(std::memory_order_relaxed); }
void set_amx(bool on) { g_amx_on.store(on && amx_available()); }

QuantWeight make_weight(const void* data, int type, int64_t n, int64_t k) {
  QuantWeight w;
  w.data = static_cast<const uint8_t*>(data);
  w.type = type;
  w.n = n;
  w.k = k;
  w.nb = padded_blocks(k);
  w.row_bytes = weight_bytes(type, 1, k);
  if (type == kQ4_1 || type == kQ8_0) pack(w);
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
  p.d1.resize(M * p.nb * 32);
  p.d2.resize(M * p.nb * 32);
  // rows padded to 16 and blocks to a multiple of 4, with zeros (a zero block adds +0)
  const int64_t Mp = padded_rows(M), srow = quads(p.nb) * 16;
  auto padded = [&](auto& v) {
    v.resize(Mp * srow);
    std::fill(v.begin() + M * srow, v.end(), 0);
  };
  padded(p.s2);
  if (type == kQ4_1) padded(p.xs4);
  if (type == kQ8_0 && kQ8Biased) padded(p.corr);
  p.amx = amx_enabled() && M >= kAmxMinRows;
  if (p.amx) {
    p.a12.resize(Mp * p.nb * 64);
    for (int64_t m = M; m < Mp; m++)
      for (int64_t b = 0; b < p.nb; b += 2) {
        int8_t* at = p.a12.data() + amx_a_offset(m, b, p.nb);
        std::fill(at, at + 64, 0);
        std::fill(at + 1024, at + 1024 + 64, 0);
      }
  }
}

void prepare_rows(PreparedX& p, int64_t m0, int64_t m1) {
  if (p.type == kF32) return;
  const int64_t nb = p.nb, nreal = p.k / 32, nquad = nb / 4, srow = quads(nb) * 16;
  constexpr int lanes = 4;  // per block in s2, xs4 and corr (one per column of a VNNI tile)
  for (int64_t m = m0; m < m1; m++) {
    const float* x = p.x + m * p.ldx;
    int8_t* d1 = p.d1.data() + m * nb * 32;
    int8_t* d2 = p.d2.data() + m * nb * 32;
    float* s2v = p.s2.data() + m * srow;
    std::fill(s2v + nb * lanes, s2v + srow, 0.0f);  // the blocks past nb, up to a multiple of 4
    if (p.type == kQ4_1) std::fill(p.xs4.data() + m * srow + nb * lanes, p.xs4.data() + (m + 1) * srow, 0.0f);
    if (p.type == kQ8_0 && kQ8Biased) std::fill(p.corr.data() + m * srow + nb * lanes, p.corr.data() + (m + 1) * srow, 0);
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
      if (p.amx) {
        int8_t* at = p.a12.data() + amx_a_offset(m, b, nb);
        std::copy(q1, q1 + 32, at);
        std::copy(q2, q2 + 32, at + 1024);
      }
      if (p.type == kQ4_1) {
        for (int l = 0; l < lanes; l++) p.xs4[m * srow + b * lanes + l] = xs;
        // group of g blocks starting at g0: [x[0:16] of each | x[16:32] of each]
        const int64_t g0 = b < nquad * 4 ? b / 4 * 4 : nquad * 4, g = b < nquad * 4 ? 4 : 2, at = b - g0;
        for (int h = 0; h < 2; h++) {
          std::copy(q1 + 16 * h, q1 + 16 * h + 16, d1 + g0 * 32 + h * g * 16 + at * 16);
          std::copy(q2 + 16 * h, q2 + 16 * h + 16, d2 + g0 * 32 + h * g * 16 + at * 16);
        }
      } else {
        std::copy(q1, q1 + 32, d1 + b * 32);
        std::copy(q2, q2 + 32, d2 + b * 32);
        if (kQ8Biased)  // biased codes: sum (q + 128) * (256 x1 + x2) - this = sum q * (256 x1 + x2)
          for (int l = 0; l < lanes; l++) p.corr[m * srow + b * lanes + l] = 128 * (256 * sum1 + sum2);
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
      return quant_cols<false>(w, px, y, ldy, n0, n1, m0, m1);
    case kQ8_0:
      return quant_cols<true>(w, px, y, ldy, n0, n1, m0, m1);
    case kF32:
      return tiles<tile_f32<kRowTile, 1>, tile_f32<kRowTile, 2>, tile_f32<1, 4>, tile_f32<1, 2>, tile_f32<1, 1>>(w, px, y, ldy, n0, n1, m0, m1);
  }
  throw std::invalid_argument("unsupported weight type " + std::to_string(w.type));
}

void dequantize_rows(const QuantWeight& w, const int64_t* ids, int64_t T, float* out) {
  const int64_t nq = quads(w.nb), qbytes = w.type == kF32 ? 0 : quad_bytes(w.type);
  for (int64_t t = 0; t < T; t++) {
    const int64_t c = ids[t];
    float* o = out + t * w.k;
    if (w.type == kF32) {
      const float* row = reinterpret_cast<const float*>(w.data + c * w.row_bytes);
      std::copy(row, row + w.k, o);
      continue;
    }
    // column c of its group: in quad q, block g's codes at (c % 4) * 4 + g code slots, d (and m) at lane g * 4 + c % 4
    const uint8_t* group = w.groups->data() + c / 4 * nq * qbytes;
    for (int64_t b = 0; b < w.k / 32; b++) {
      const uint8_t* quad = group + b / 4 * qbytes;
      const int64_t g = b % 4, lane = g * 4 + c % 4;
      if (w.type == kQ4_1) {
        const uint8_t* codes = quad + (c % 4 * 4 + g) * 16;
        const uint16_t* dm = reinterpret_cast<const uint16_t*>(quad + 16 * 16);
        const float d = _cvtsh_ss(dm[lane]), mn = _cvtsh_ss(dm[16 + lane]);
        for (int j = 0; j < 16; j++) {
          o[b * 32 + j] = std::fma(static_cast<float>(codes[j] & 15), d, mn);
          o[b * 32 + j + 16] = std::fma(static_cast<float>(codes[j] >> 4), d, mn);
        }
      } else {
        const uint8_t* codes = quad + (c % 4 * 4 + g) * 32;
        const float d = _cvtsh_ss(reinterpret_cast<const uint16_t*>(quad + 16 * 32)[lane]);
        for (int j = 0; j < 32; j++) o[b * 32 + j] = static_cast<float>(static_cast<int>(codes[j]) - 128) * d;
      }
    }
  }
}

}  // namespace pdserve
