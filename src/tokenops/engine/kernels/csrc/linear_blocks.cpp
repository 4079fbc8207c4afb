// Block-quantised weights against 8-bit activations, llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot
// products: y[n, o] = sum_k x[n, k] * w[o, k] + bias[o], with
//   linear_q4: w = code * d + m per group of G inputs, 4-bit codes 0..15 (W4A8);
//   linear_q8: w = code * d per block of 32 inputs, int8 codes -127..127 (W8A8).
// linear_q4_silu_mul is linear_q4 over an MLP's gate|up weights with SiLU(gate) * up applied as it goes.
//
// Each activation row is quantised per block of 32 inputs (symmetric int8, scale dx = max|x| / 127,
// q = round-half-even(x / dx)), and the weights' codes meet the int8 activations in integer
// multiply-adds (vpmaddubsw: u8 codes x s8 activations into int16 pair sums; with VNNI, vpdpbusd
// straight into int32), one int-to-float conversion per block and output, and one FMA with d * dx:
//   sum_i w_i x_i ~ d * dx * sum_i code_i q_i + m * dx * sum_i q_i.
// The second term (Q4 only) needs only the activations' block sums, computed once per row.
//
// Both formats keep 8 weight rows interleaved ("tiles"; llama.cpp's repacked 8x8 idea), so one 32-byte
// load gives 4 inputs of each of 8 rows, and vpmaddubsw against those 4 activations broadcast gives
// the 8 rows' partial sums in the 8 lanes: per block and activation row, one conversion and one FMA
// cover 8 outputs, where one weight row at a time needs a horizontal sum per output and a broadcast
// scale per block and row. tiles = ceil(out / 8), blocks = in' / 32 (in' = in padded to 32); rows past
// `out` are zero.
// Q4 layout: codes uint8 [tiles, blocks * 128]. Per tile and block, 4 chunks c of 32 bytes; byte
// 4r + u of chunk c holds row r's input 4c + u of the block in its low nibble and input 16 + 4c + u in
// its high one. A block of 8 rows x 32 inputs is 4 loads, 12 unpacking ops and, per activation row,
// 8 multiply-adds, 7 int16 adds (8 x 2 x 15 x 127 < 32767), one widening add (VNNI: 8 vpdpbusd and
// one int32 add), one conversion and two FMAs (d * dx and m * dx * sum q, the 8 rows' d and m one
// vector load each), about 0.2 instructions per weight. d and m: float32 or float16 [tiles, groups * 8],
// element 8g + r the parameter of the tile's row r in group g (G a power-of-two multiple of 32).
// float16 is a GGUF file's Q4_0 / Q4_1 parameters as they are: 20 bytes per 32 weights instead of 24,
// what a one-row step streams.
// Q8 layout: codes int8 [tiles, blocks * 256]. Per tile and block, 8 chunks c of 32 bytes; byte 4r + u
// of chunk c holds row r's input 4c + u. vpmaddubsw takes unsigned codes: |code| against q carrying
// the code's sign (llama.cpp's sign trick), exact as one int16 pair (2 x 128 x 127 < 32767) but not
// two, so each chunk widens to int32 (vpmaddwd) before the 8 chunks add. vpdpbusd sums into int32
// without saturating, so VNNI takes code + 128 (one xor per chunk) against q as it is and subtracts
// 128 * sum(q) per block: no per-row sign op, and the same integer sums. d: float32 [tiles, blocks * 8],
// element 8b + r the scale of the tile's row r in block b. Each output thus adds its blocks' exact
// integer sums in one float32 FMA each, in block order: sequential math a reference can repeat.
//
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <torch/library.h>
#include <type_traits>
#include <vector>

#include "balanced_for.h"
#include "gated_activation.h"
#include "int8_dot.h"

#include "amx_tiles.h"

namespace {

constexpr int64_t kBlock = 32;     // inputs per block
constexpr int64_t kTile = 8;       // weight rows interleaved
constexpr int64_t kTileBlockBytes = kTile * kBlock / 2;  // Q4: a tile's block of 4-bit codes
constexpr int64_t kTile8BlockBytes = kTile * kBlock;     // Q8: a tile's block of int8 codes
constexpr int64_t kPrefetch8 = 8 * kTile8BlockBytes;  // Q8: how far ahead of the block being read
constexpr int kTileRows = 4;       // activation rows per pass over a tile's block
constexpr int64_t kRowChunk = 64;  // activation rows whose int8 copy stays in L2 while a slice of weights passes
// calls of at least this many rows take tile pairs where they are compiled (below it one tile at a time
// streams the weights faster: linear_small_rows.py on the EPYC AVX-512 kind)
constexpr int64_t kPairMinRows = 8;

// The SIMD tile kernels: GCC's default x86 schedule hoists all R rows' multiply-adds of a block ahead of
// their sums and spills them and the accumulators to the stack (AVX2 has 16 vector registers);
// register-pressure-aware scheduling keeps them in registers, and noinline keeps the caller's live
// values out of the loop (docs/benchmarks.md, linear_small_rows.py).
#if defined(__GNUC__) && !defined(__clang__)
#define TILE_KERNEL __attribute__((noinline, optimize("schedule-insns", "sched-pressure")))
#else
#define TILE_KERNEL __attribute__((noinline))
#endif

// The activations of one call, quantised per block of 32 (zero past `k`); per thread, reused.
struct QuantisedRows {
  std::vector<int8_t> q;  // [n, blocks * 32]
  std::vector<float> d;   // [n, blocks] scale
  std::vector<float> s;   // [n, blocks] d * sum(q)
  std::vector<int32_t> sum;  // [n, blocks] sum(q): Q8's VNNI tiles take their codes offset by 128
};

// one block of `len` <= 32 inputs; q must hold 32
inline void quantise_block(const float* xb, int64_t len, int8_t* qb, float& d_out, float& s_out, int32_t& sum_out) {
#ifdef TOKENOPS_BLOCKS_AVX2
  if (len == kBlock) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.0f / d : 0.f);
    __m256i i32[4];
    // cvtps rounds half to even (the default MXCSR mode), as std::nearbyint
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    // packs work per 128-bit lane: the permute puts the 32 bytes back in input order
    const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), bytes);
    d_out = d;
    sum_out = _mm_cvtsi128_si32(s4);
    s_out = d * static_cast<float>(sum_out);
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float d = amax / 127.0f;
  const float inv = d > 0.f ? 1.0f / d : 0.f;
  int sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int v = i < len ? static_cast<int>(std::nearbyint(xb[i] * inv)) : 0;
    qb[i] = static_cast<int8_t>(v);
    sum += v;
  }
  d_out = d;
  sum_out = sum;
  s_out = d * static_cast<float>(sum);
}

// rows past n up to `padded` (AMX's whole tiles of 16 rows) are zero: q, d, s and sum alike
const QuantisedRows& quantise_rows(const float* x, int64_t n, int64_t k, int64_t blocks, int64_t padded = 0) {
  thread_local QuantisedRows out;
  const int64_t held = std::max(n, padded);
  out.q.resize(static_cast<size_t>(held * blocks * kBlock));
  out.d.resize(static_cast<size_t>(held * blocks));
  out.s.resize(static_cast<size_t>(held * blocks));
  out.sum.resize(static_cast<size_t>(held * blocks));
  if (held > n) {
    std::fill(out.q.begin() + n * blocks * kBlock, out.q.end(), 0);
    std::fill(out.d.begin() + n * blocks, out.d.end(), 0.f);
    std::fill(out.s.begin() + n * blocks, out.s.end(), 0.f);
    std::fill(out.sum.begin() + n * blocks, out.sum.end(), 0);
  }
  // rows split across the threads once a task has ~256 blocks: a prefill chunk's quantisation is
  // otherwise a serial part of every linear (a dispatch costs more than a few rows' blocks)
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(blocks, 1));
  // workers naming `out` would get their own thread_local copy: they write through these pointers into
  // the caller's buffers
  int8_t* q = out.q.data();
  float* d = out.d.data();
  float* s = out.s.data();
  int32_t* sum = out.sum.data();
  at::parallel_for(0, n, grain, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        quantise_block(x + r * k + b * kBlock, std::min<int64_t>(kBlock, k - b * kBlock),
                       q + (r * blocks + b) * kBlock, d[r * blocks + b], s[r * blocks + b], sum[r * blocks + b]);
  });
  return out;
}

// ---- Q4: tiles of 8 interleaved weight rows ----

inline float param(const float* p) { return *p; }
inline float param(const at::Half* p) { return static_cast<float>(*p); }
#ifdef TOKENOPS_BLOCKS_AVX2
inline __m256 load_params(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_params(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

template <class P>  // the parameters' type: float or at::Half
struct Tiles {
  const uint8_t* codes;
  const P* d;
  const P* m;
  int64_t blocks;  // per row
  int64_t groups;  // per row
  int gshift;      // log2(G / 32): block b is in group b >> gshift
  static constexpr int64_t kBlockBytes = kTileBlockBytes;
};

// out[r * 8 + i] = tile t's row i against activation rows r0..r0+R
#ifdef TOKENOPS_BLOCKS_AVX2
template <int R, class P>
TILE_KERNEL void tile_dot(const Tiles<P>& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                          const char* ahead) {
  const int64_t blocks = w.blocks;
  const uint8_t* p = w.codes + t * blocks * kTileBlockBytes;
  const P* dt = w.d + t * w.groups * kTile;
  const P* mt = w.m + t * w.groups * kTile;
  const __m256i low = _mm256_set1_epi8(0x0F);
#ifndef TOKENOPS_BLOCKS_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p += kTileBlockBytes) {
    if (ahead) {  // the next tile's block, a block per block, into L1 (tile_ahead)
      _mm_prefetch(ahead + b * kTileBlockBytes, _MM_HINT_T0);
      _mm_prefetch(ahead + b * kTileBlockBytes + 64, _MM_HINT_T0);
    }
    // one chunk's codes at a time against every row: 2R accumulators (3R with VNNI's two int32
    // sums) and 3 code registers stay in the 16 ymm registers
    const int8_t* q[R];
    __m256i s[R];
#ifdef TOKENOPS_BLOCKS_VNNI
    // low and high nibbles in separate int32 sums: two chains per row hide vpdpbusd's latency
    __m256i sh[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = sh[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) q[r] = a.q.data() + ((r0 + r) * blocks + b) * kBlock;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t ql, qh;  // activations 4c..4c+3 and 16+4c..16+4c+3, broadcast to the 8 rows' lanes
        std::memcpy(&ql, q[r] + 4 * c, 4);
        std::memcpy(&qh, q[r] + 16 + 4 * c, 4);
#ifdef TOKENOPS_BLOCKS_VNNI
        s[r] = dpbusd(s[r], lo, _mm256_set1_epi32(ql));
        sh[r] = dpbusd(sh[r], hi, _mm256_set1_epi32(qh));
#else
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(ql)),
                                              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(qh)));
        s[r] = c == 0 ? pair : _mm256_add_epi16(s[r], pair);
#endif
      }
    }
    const int64_t g = b >> w.gshift;
    const __m256 dv = load_params(dt + g * kTile);
    const __m256 mv = load_params(mt + g * kTile);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
#ifdef TOKENOPS_BLOCKS_VNNI
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_add_epi32(s[r], sh[r]));
#else
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones));
#endif
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dv, _mm256_set1_ps(a.d[ab])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[ab]), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}
#endif

// Two tiles at once in 512-bit registers (lanes 0..7 tile t, 8..15 tile t + 1), where AVX-512 has VNNI:
// the same integer sums and FMAs per lane as tile_dot, so the same bits, with each activation
// broadcast, unpacking op and per-block FMA serving 16 outputs instead of 8. Zen 4 runs a 512-bit op
// as two 256-bit halves, so the gain there is the instructions saved (linear_small_rows.py).
#if defined(TOKENOPS_BLOCKS_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TOKENOPS_BLOCKS_PAIRS 1
inline __m512 load_params2(const float* p0, const float* p1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1);
}
inline __m512 load_params2(const at::Half* p0, const at::Half* p1) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
  return _mm512_cvtph_ps(h);
}

// one block's exact integer sums into a row's 16 outputs: d * dx * dots, then m * dx * sum q (s), in
// this order; the tile pairs and the AMX tiles both call it, so their outputs are the same bits
inline __m512 add_q4_block(__m512 acc, __m512 dots, __m512 dv, __m512 mv, float dx, float s) {
  acc = _mm512_fmadd_ps(dots, _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(mv, _mm512_set1_ps(s), acc);
}

template <int R, class P>
TILE_KERNEL void tile_pair_dot(const Tiles<P>& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                               const char* ahead0, const char* ahead1) {
  const int64_t blocks = w.blocks;
  const uint8_t* p0 = w.codes + t * blocks * kTileBlockBytes;
  const uint8_t* p1 = p0 + blocks * kTileBlockBytes;
  const P* d0 = w.d + t * w.groups * kTile;
  const P* m0 = w.m + t * w.groups * kTile;
  const P* d1 = d0 + w.groups * kTile;
  const P* m1 = m0 + w.groups * kTile;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p0 += kTileBlockBytes, p1 += kTileBlockBytes) {
    for (const char* ahead : {ahead0, ahead1}) {  // the next pair's tiles, as tile_dot's
      if (ahead) {
        _mm_prefetch(ahead + b * kTileBlockBytes, _MM_HINT_T0);
        _mm_prefetch(ahead + b * kTileBlockBytes + 64, _MM_HINT_T0);
      }
    }
    const int8_t* q[R];
    __m512i s[R], sh[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = sh[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) q[r] = a.q.data() + ((r0 + r) * blocks + b) * kBlock;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c)), 1);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t ql, qh;
        std::memcpy(&ql, q[r] + 4 * c, 4);
        std::memcpy(&qh, q[r] + 16 + 4 * c, 4);
        s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(ql));
        sh[r] = _mm512_dpbusd_epi32(sh[r], hi, _mm512_set1_epi32(qh));
      }
    }
    const int64_t g = b >> w.gshift;
    const __m512 dv = load_params2(d0 + g * kTile, d1 + g * kTile);
    const __m512 mv = load_params2(m0 + g * kTile, m1 + g * kTile);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(s[r], sh[r]));
      acc[r] = add_q4_block(acc[r], dots, dv, mv, a.d[ab], a.s[ab]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 2 * kTile, acc[r]);
}
#endif
#ifndef TOKENOPS_BLOCKS_AVX2
// portable: the same sums and order, one lane at a time
template <int R, class P>
inline void tile_dot(const Tiles<P>& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                     const char* /*ahead*/) {
  const uint8_t* tile = w.codes + t * w.blocks * kTileBlockBytes;
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < kTile; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* p = tile + b * kTileBlockBytes;
        const int8_t* q = a.q.data() + ((r0 + r) * w.blocks + b) * kBlock;
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int u = 0; u < 4; ++u) {
            const uint8_t byte = p[32 * c + 4 * i + u];
            dot += (byte & 15) * q[4 * c + u] + (byte >> 4) * q[16 + 4 * c + u];
          }
        const int64_t g = b >> w.gshift, ab = (r0 + r) * w.blocks + b;
        acc = std::fma(static_cast<float>(dot), param(w.d + (t * w.groups + g) * kTile + i) * a.d[ab], acc);
        acc = std::fma(param(w.m + (t * w.groups + g) * kTile + i), a.s[ab], acc);
      }
      out[r * kTile + i] = acc;
    }
  }
}
#endif

// ---- Q8: tiles of 8 interleaved weight rows ----

struct Tiles8 {
  const int8_t* codes;
  const float* d;
  int64_t blocks;  // per row
  static constexpr int64_t kBlockBytes = kTile8BlockBytes;
};

// out[r * 8 + i] = tile t's row i against activation rows r0..r0+R
#ifdef TOKENOPS_BLOCKS_AVX2
template <int R>
TILE_KERNEL void tile_dot(const Tiles8& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                          const char* /*ahead: Q8 prefetches its own stream*/) {
  const int64_t blocks = w.blocks;
  const int8_t* p = w.codes + t * blocks * kTile8BlockBytes;
  const float* dt = w.d + t * blocks * kTile;
#ifdef TOKENOPS_BLOCKS_VNNI
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p += kTile8BlockBytes) {
    const int8_t* q[R];
    __m256i s[R];
#ifdef TOKENOPS_BLOCKS_VNNI
    // even and odd chunks in separate int32 sums: two chains per row hide vpdpbusd's latency
    __m256i so[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = so[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) q[r] = a.q.data() + ((r0 + r) * blocks + b) * kBlock;
    // the tiles are one stream: few rows read it faster with the lines 8 blocks ahead requested
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch8 + 64 * l), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c));
#ifdef TOKENOPS_BLOCKS_VNNI
      const __m256i biased = _mm256_xor_si256(v, flip);  // code + 128, unsigned
#else
      const __m256i mag = _mm256_sign_epi8(v, v);  // |code| against q carrying code's sign
#endif
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t qc;  // activations 4c..4c+3, broadcast to the 8 rows' lanes
        std::memcpy(&qc, q[r] + 4 * c, 4);
#ifdef TOKENOPS_BLOCKS_VNNI
        if (c % 2 == 0) s[r] = dpbusd(s[r], biased, _mm256_set1_epi32(qc));
        else so[r] = dpbusd(so[r], biased, _mm256_set1_epi32(qc));
#else
        // int16 pair sums stay exact (2 x 128 x 127 < 32767) but not a second pair: widened per chunk
        const __m256i quad =
            _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(qc), v)), ones);
        s[r] = c == 0 ? quad : _mm256_add_epi32(s[r], quad);
#endif
      }
    }
    const __m256 dv = _mm256_loadu_ps(dt + b * kTile);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
      const __m256 dx = _mm256_set1_ps(a.d[ab]);
#ifdef TOKENOPS_BLOCKS_VNNI
      s[r] = _mm256_sub_epi32(_mm256_add_epi32(s[r], so[r]), _mm256_set1_epi32(a.sum[ab] * 128));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dv, dx), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}
#else
// portable: the same sums and order, one lane at a time
template <int R>
inline void tile_dot(const Tiles8& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                     const char* /*ahead*/) {
  const int8_t* tile = w.codes + t * w.blocks * kTile8BlockBytes;
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < kTile; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int8_t* p = tile + b * kTile8BlockBytes;
        const int8_t* q = a.q.data() + ((r0 + r) * w.blocks + b) * kBlock;
        int32_t dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int u = 0; u < 4; ++u) dot += p[32 * c + 4 * i + u] * q[4 * c + u];
        const int64_t ab = (r0 + r) * w.blocks + b;
        acc = std::fma(static_cast<float>(dot), w.d[(t * w.blocks + b) * kTile + i] * a.d[ab], acc);
      }
      out[r * kTile + i] = acc;
    }
  }
}
#endif

#ifdef TOKENOPS_BLOCKS_PAIRS
// tiles t and t + 1 in 512-bit registers, as the Q4 pairs, with the codes offset by 128 as tile_dot's
// VNNI path
template <int R>
TILE_KERNEL void tile_pair_dot(const Tiles8& w, int64_t t, const QuantisedRows& a, int64_t r0, float* out,
                               const char* /*ahead0*/, const char* /*ahead1*/) {
  const int64_t blocks = w.blocks;
  const int8_t* p0 = w.codes + t * blocks * kTile8BlockBytes;
  const int8_t* p1 = p0 + blocks * kTile8BlockBytes;
  const float* d0 = w.d + t * blocks * kTile;
  const float* d1 = d0 + blocks * kTile;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p0 += kTile8BlockBytes, p1 += kTile8BlockBytes) {
    const int8_t* q[R];
    __m512i s[R], so[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r] = so[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) q[r] = a.q.data() + ((r0 + r) * blocks + b) * kBlock;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c)), 1);
      const __m512i biased = _mm512_xor_si512(v, flip);  // code + 128, unsigned
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t qc;
        std::memcpy(&qc, q[r] + 4 * c, 4);
        if (c % 2 == 0) s[r] = _mm512_dpbusd_epi32(s[r], biased, _mm512_set1_epi32(qc));
        else so[r] = _mm512_dpbusd_epi32(so[r], biased, _mm512_set1_epi32(qc));
      }
    }
    const __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(d0 + b * kTile)),
                                         _mm256_loadu_ps(d1 + b * kTile), 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
      const __m512 dx = _mm512_set1_ps(a.d[ab]);
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s[r], so[r]), _mm512_set1_epi32(a.sum[ab] * 128));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, dx), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 2 * kTile, acc[r]);
}
#endif

#include "linear_amx.h"  // Q4 and Q8 on AMX's int8 tiles: run_tiles_amx, calls of many rows

// ---- both: tiles of 8 rows against the activation rows in chunks ----

// The codes of tile u (of `tiles`), the next unit's, for the first pass over the current unit of a row
// chunk (`first`) to request into L1, a block per block, while it runs; else null. At decode sizes a
// tile's first pass reads it from memory, and requesting the next unit's meanwhile runs faster than
// leaving it to the hardware prefetchers (linear_small_rows.py --against in docs/benchmarks.md).
template <class W>
inline const char* tile_ahead(const W& w, int64_t u, int64_t tiles, bool first) {
  return first && u < tiles ? reinterpret_cast<const char*>(w.codes + u * w.blocks * W::kBlockBytes) : nullptr;
}

template <int R, class W>
inline void store_tile(const W& w, int64_t t, const QuantisedRows& a, int64_t r0, const float* bias,
                       int64_t out_f, float* y, const char* ahead) {
  float dots[R * kTile];
  tile_dot<R>(w, t, a, r0, dots, ahead);
  const int64_t o = t * kTile, width = std::min(kTile, out_f - o);
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < width; ++i) y[(r0 + r) * out_f + o + i] = dots[r * kTile + i] + (bias ? bias[o + i] : 0.f);
}

#ifdef TOKENOPS_BLOCKS_PAIRS
template <int R, class W>
inline void store_tile_pair(const W& w, int64_t t, const QuantisedRows& a, int64_t r0, const float* bias,
                            int64_t out_f, float* y, const char* ahead0, const char* ahead1) {
  float dots[R * 2 * kTile];
  tile_pair_dot<R>(w, t, a, r0, dots, ahead0, ahead1);
  const int64_t o = t * kTile, width = std::min(2 * kTile, out_f - o);
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < width; ++i)
      y[(r0 + r) * out_f + o + i] = dots[r * 2 * kTile + i] + (bias ? bias[o + i] : 0.f);
}
#endif

// whether run_tiles takes the weights two tiles at a time (tile_pair_dot, where AVX-512 has VNNI)
template <class W>
struct TilePairs : std::false_type {};
#ifdef TOKENOPS_BLOCKS_PAIRS
template <class P>
struct TilePairs<Tiles<P>> : std::true_type {};
template <>
struct TilePairs<Tiles8> : std::true_type {};
#endif

// activation rows r0..r1 against one unit of tiles, kTileRows at a time: store(R, r) stores R rows from r
template <class Store>
inline void each_row_group(int64_t r0, int64_t r1, Store&& store) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) store(std::integral_constant<int, kTileRows>{}, r);
  switch (r1 - r) {
    case 3: store(std::integral_constant<int, 3>{}, r); break;
    case 2: store(std::integral_constant<int, 2>{}, r); break;
    case 1: store(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// The tiles' work split, shared by run_tiles and run_tiles_gated: units of one tile, or of two (a pair)
// where compiled and the call has kPairMinRows rows, each against the activation rows in chunks of
// kRowChunk: f(t, pair, r0, r1), pair whether the unit is tiles t and t + 1. The units are shared out
// over the threads as a static split would (~16 KB of codes per thread at least; `reads` tiles read per
// unit tile: 2 for gate|up), each share row chunk by row chunk, and a thread done with its share takes
// the rest of another's (balanced_for.h): a unit's outputs are the same bits whichever thread runs it.
template <class W, class F>
void for_tile_units(const W& w, int64_t n, int64_t tiles, int64_t reads, F&& f) {
  const int64_t span = TilePairs<W>::value && n >= kPairMinRows ? 2 : 1;
  const int64_t units = (tiles + span - 1) / span;
  const int64_t unit_bytes = reads * w.blocks * W::kBlockBytes * span;
  const int64_t grain = std::max<int64_t>(1, 16384 / unit_bytes);
  const int64_t shares = units > grain ? std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain) : 1;
  const int64_t per_share = (units + shares - 1) / shares;
  const int64_t take = std::max<int64_t>(1, 4096 / unit_bytes);  // units per item: a few KB of codes
  const int64_t chunks = (n + kRowChunk - 1) / kRowChunk;
  auto share = [&](int64_t s) {  // share s's units [u0, u1) and its items per row chunk
    const int64_t u0 = std::min(units, s * per_share), u1 = std::min(units, u0 + per_share);
    return std::array<int64_t, 3>{u0, u1, (u1 - u0 + take - 1) / take};
  };
  tokenops::balanced_for(
      shares, [&](int64_t s) { return chunks * share(s)[2]; },
      [&](int64_t s, int64_t j) {
        const auto [u0, u1, per_chunk] = share(s);
        const int64_t c = j / per_chunk, b = u0 + (j % per_chunk) * take;
        const int64_t r0 = c * kRowChunk, r1 = std::min(n, r0 + kRowChunk);
        for (int64_t u = b; u < std::min(u1, b + take); ++u) f(u * span, span == 2 && u * span + 1 < tiles, r0, r1);
      });
}

template <class W>
void run_tiles(const at::Tensor& x, const W& w, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t k = x.size(-1), out_f = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  if (n == 0 || out_f == 0) return;
  const QuantisedRows& a = quantise_rows(x.data_ptr<float>(), n, k, w.blocks);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (out_f + kTile - 1) / kTile;
  for_tile_units(w, n, tiles, 1, [&](int64_t t, bool pair, int64_t r0, int64_t r1) {
#ifdef TOKENOPS_BLOCKS_PAIRS
    if constexpr (TilePairs<W>::value) {
      if (pair) {
        each_row_group(r0, r1, [&](auto rows, int64_t r) {
          store_tile_pair<rows()>(w, t, a, r, b, out_f, yp, tile_ahead(w, t + 2, tiles, r == r0),
                                  tile_ahead(w, t + 3, tiles, r == r0));
        });
        return;
      }
    }
#endif
    each_row_group(r0, r1, [&](auto rows, int64_t r) {
      store_tile<rows()>(w, t, a, r, b, out_f, yp, tile_ahead(w, t + 1, tiles, r == r0));
    });
  });
}

// ---- the gate|up projection and its gated activation in one pass ----
// Tile u of the gate half and tile u of the up half hold the same 8 outputs' weights, so one unit of
// work takes both and writes act(gate) * up: the [rows, 2I] projection is never stored and read back
// (at prefill sizes a pass from memory, silu_mul's). The same dots (bias-free, `+ 0.f` as store_tile
// adds), the same activation (gated_activation.h) and product: the same bits as silu_mul(linear_q4(x)).
template <int R, class Act, class W>
inline void store_gated(const W& w, int64_t t, int64_t half, bool pair, const QuantisedRows& a, int64_t r0,
                        int64_t width, float* y, bool first) {
  float g[R * 2 * kTile], u[R * 2 * kTile];
  int64_t cols = kTile;
#ifdef TOKENOPS_BLOCKS_PAIRS
  if constexpr (TilePairs<W>::value) {
    if (pair) {
      tile_pair_dot<R>(w, t, a, r0, g, tile_ahead(w, t + 2, half, first), tile_ahead(w, t + 3, half, first));
      tile_pair_dot<R>(w, t + half, a, r0, u, tile_ahead(w, t + half + 2, 2 * half, first),
                       tile_ahead(w, t + half + 3, 2 * half, first));
      cols = 2 * kTile;
    }
  }
#endif
  if (cols == kTile) {
    tile_dot<R>(w, t, a, r0, g, tile_ahead(w, t + 1, half, first));
    tile_dot<R>(w, t + half, a, r0, u, tile_ahead(w, t + half + 1, 2 * half, first));
  }
  for (int r = 0; r < R; ++r) {
    float act[2 * kTile];
    for (int64_t i = 0; i < cols; ++i) act[i] = g[r * cols + i] + 0.f;
    tokenops::apply_all<Act>(act, cols);
    float* o = y + (r0 + r) * width + t * kTile;
    for (int64_t i = 0; i < cols; ++i) o[i] = act[i] * (u[r * cols + i] + 0.f);
  }
}

// x [n, in] against gate|up tiles (out_f = 2 * width, width a multiple of 8) -> y [n, width], split as
// run_tiles splits its work
template <class Act, class W>
void run_tiles_gated(const at::Tensor& x, const W& w, at::Tensor& y) {
  const int64_t k = x.size(-1), width = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  if (n == 0 || width == 0) return;
  const QuantisedRows& a = quantise_rows(x.data_ptr<float>(), n, k, w.blocks);
  float* yp = y.data_ptr<float>();
  const int64_t half = width / kTile;  // the gate half's tiles; the up half's follow
  for_tile_units(w, n, half, 2, [&](int64_t t, bool pair, int64_t r0, int64_t r1) {
    each_row_group(r0, r1, [&](auto rows, int64_t r) {
      store_gated<rows(), Act>(w, t, half, pair, a, r, width, yp, r == r0);
    });
  });
}

// ---- the ops ----

// the checks shared by both ops: x against the weight's padded width, the bias; y allocated
at::Tensor check_x(const at::Tensor& x, int64_t out_f, int64_t padded, int64_t group_size,
                   const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), op, ": x must be contiguous float32");
  const int64_t k = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK(x.dim() >= 1 && k <= padded && k > padded - group_size, op, ": x's last dimension ", k,
              " does not match the weight's ", padded, " (padded) inputs");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_f, op,
                ": bias must be a contiguous float32 [out] vector");
  auto sizes = x.sizes().vec();
  sizes.back() = out_f;
  return at::empty(sizes, x.options());
}

void check_params(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == cols,
              what);
}

// x float32 [..., in] @ (codes * d + m).T (+ bias) -> float32 [..., out_features]; codes uint8
// [ceil(out / 8), in' / 32 * 128] in the tile layout, d and m float32 or float16 [ceil(out / 8), in' / G * 8]
// The checks linear_q4 and dequantize_q4_bf16 share (codes in the tile layout, d and m in one dtype);
// then f(tiles) with the parameters as float or at::Half
template <class F>
void with_q4_tiles(const char* op, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                   int64_t out_features, int64_t group_size, F&& f) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 2 &&
                  codes.is_contiguous(),
              op, ": codes must be a contiguous uint8 [ceil(out / 8), in' / 32 * 128] matrix");
  TORCH_CHECK(out_features >= 0 && codes.size(0) == (out_features + kTile - 1) / kTile, op, ": codes hold ",
              codes.size(0), " tiles of 8 rows, not the ", out_features, " outputs'");
  TORCH_CHECK(group_size >= kBlock && group_size % kBlock == 0 && (group_size & (group_size - 1)) == 0, op,
              ": group_size must be a power of two multiple of 32, got ", group_size);
  TORCH_CHECK(codes.size(1) % kTileBlockBytes == 0, op, ": codes rows must hold whole blocks of 32 inputs");
  const int64_t tiles = codes.size(0), blocks = codes.size(1) / kTileBlockBytes;
  const int64_t groups = blocks * kBlock / group_size;
  TORCH_CHECK(groups * group_size == blocks * kBlock, op, ": the padded width is not whole groups");
  const std::string params = std::string(op) +
                             ": d and m must be contiguous float32 or float16 [ceil(out / 8), in' / group_size * 8] "
                             "of one dtype";
  TORCH_CHECK(d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf, params);
  check_params(d, d.scalar_type(), tiles, groups * kTile, params.c_str());
  check_params(m, d.scalar_type(), tiles, groups * kTile, params.c_str());
  int gshift = 0;
  while ((kBlock << gshift) < group_size) ++gshift;
  if (d.scalar_type() == at::kHalf)
    f(Tiles<at::Half>{codes.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), blocks, groups,
                      gshift});
  else
    f(Tiles<float>{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), blocks, groups, gshift});
}

// whether a Q4 or Q8 call of x's rows runs on AMX's int8 tiles (run_tiles_amx) rather than the vector
// tiles
inline bool takes_amx(const at::Tensor& x) {
#ifdef TOKENOPS_BLOCKS_AMX
  return x.numel() / std::max<int64_t>(x.size(-1), 1) >= amx_min_rows && amx_ready();
#else
  (void)x;
  return false;
#endif
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     int64_t out_features, int64_t group_size, const std::optional<at::Tensor>& bias) {
  at::Tensor y;
  with_q4_tiles("linear_q4", codes, d, m, out_features, group_size, [&](const auto& w) {
    y = check_x(x, out_features, w.blocks * kBlock, group_size, bias, "linear_q4");
#ifdef TOKENOPS_BLOCKS_AMX
    if (takes_amx(x)) {
      run_tiles_amx(x, w, bias, y);
      return;
    }
#endif
    run_tiles(x, w, bias, y);
  });
  return y;
}

// silu_mul(linear_q4(x, gate|up)) in one pass where the tiles take the call (no bias; the gate half a
// whole number of tiles, of tile pairs on AMX's rows); elsewhere the two ops one after the other
at::Tensor linear_q4_silu_mul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                              int64_t out_features, int64_t group_size) {
  TORCH_CHECK(out_features % 2 == 0, "linear_q4_silu_mul: out_features must be even (gate | up), got ", out_features);
  at::Tensor y;
  with_q4_tiles("linear_q4_silu_mul", codes, d, m, out_features, group_size, [&](const auto& w) {
    const int64_t width = out_features / 2;
    if (width % kTile == 0 && !takes_amx(x)) {
      y = check_x(x, width, w.blocks * kBlock, group_size, std::nullopt, "linear_q4_silu_mul");
      run_tiles_gated<tokenops::Silu>(x, w, y);
      return;
    }
#ifdef TOKENOPS_BLOCKS_AMX
    if (width % (2 * kTile) == 0 && takes_amx(x)) {
      y = check_x(x, width, w.blocks * kBlock, group_size, std::nullopt, "linear_q4_silu_mul");
      run_tiles_amx_gated<tokenops::Silu>(x, w, y);
      return;
    }
#endif
    static const auto silu_mul = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("tokenops::silu_mul", "")
                                     .typed<at::Tensor(const at::Tensor&)>();
    y = silu_mul.call(linear_q4(x, codes, d, m, out_features, group_size, std::nullopt));
  });
  return y;
}

// The Q4 tiles' weights w = code * d + m (float32 math) rounded to bf16, row-major [out_features, in'],
// for a GEMM that beats the tiles on many rows (oneDNN's bf16 on AMX). Per tile, block and row, the
// row's 16 bytes (4 of each chunk) hold its 32 inputs in order: low nibbles inputs 0..15, high 16..31.
inline uint16_t to_bf16_bits(float v) {  // round to nearest even, as c10::BFloat16 (finite values)
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <class P>
void dequantise_tiles(const Tiles<P>& w, int64_t out_f, uint16_t* out) {
  const int64_t width = w.blocks * kBlock, tiles = (out_f + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w.codes + t * w.blocks * kTileBlockBytes;
      for (int64_t r = 0; r < kTile && t * kTile + r < out_f; ++r) {
        uint16_t* row = out + (t * kTile + r) * width;
        for (int64_t b = 0; b < w.blocks; ++b) {
          const uint8_t* p = tile + b * kTileBlockBytes + 4 * r;
          const int64_t gi = (t * w.groups + (b >> w.gshift)) * kTile + r;
          const float d = param(w.d + gi), m = param(w.m + gi);
#if defined(__AVX512F__)
          int32_t c4[4];
          for (int c = 0; c < 4; ++c) std::memcpy(&c4[c], p + 32 * c, 4);
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c4));
          const __m128i low = _mm_set1_epi8(0x0F);
          const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
          const __m128i halves[2] = {_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)};
          for (int h = 0; h < 2; ++h) {
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h])), dv, mv);
            const __m512i bits = _mm512_castps_si512(v);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            const __m512i rounded = _mm512_srli_epi32(
                _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * kBlock + 16 * h),
                                _mm512_cvtepi32_epi16(rounded));
          }
#else
          for (int c = 0; c < 4; ++c)
            for (int u = 0; u < 4; ++u) {
              const uint8_t byte = p[32 * c + u];
              row[b * kBlock + 4 * c + u] = to_bf16_bits(std::fma(static_cast<float>(byte & 15), d, m));
              row[b * kBlock + 16 + 4 * c + u] = to_bf16_bits(std::fma(static_cast<float>(byte >> 4), d, m));
            }
#endif
        }
      }
    }
  });
}

// codes, d, m as linear_q4 takes them -> bf16 [out_features, in'] (in' = the padded width)
at::Tensor dequantize_q4_bf16(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                              int64_t out_features, int64_t group_size) {
  at::Tensor out;
  with_q4_tiles("dequantize_q4_bf16", codes, d, m, out_features, group_size, [&](const auto& w) {
    out = at::empty({out_features, w.blocks * kBlock}, codes.options().dtype(at::kBFloat16));
    dequantise_tiles(w, out_features, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  });
  return out;
}

// x float32 [..., in] @ (codes * d).T (+ bias) -> float32 [..., out_features]; codes int8 -127..127
// [ceil(out / 8), in' / 32 * 256] in the tile layout, d float32 [ceil(out / 8), in' / 32 * 8]
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, int64_t out_features,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2 &&
                  codes.is_contiguous(),
              "linear_q8: codes must be a contiguous int8 [ceil(out / 8), in' / 32 * 256] matrix");
  TORCH_CHECK(out_features >= 0 && codes.size(0) == (out_features + kTile - 1) / kTile,
              "linear_q8: codes hold ", codes.size(0), " tiles of 8 rows, not the ", out_features, " outputs'");
  TORCH_CHECK(codes.size(1) % kTile8BlockBytes == 0, "linear_q8: codes rows must hold whole blocks of 32 inputs");
  const int64_t tiles = codes.size(0), blocks = codes.size(1) / kTile8BlockBytes;
  check_params(d, at::kFloat, tiles, blocks * kTile, "linear_q8: d must be a contiguous float32 [ceil(out / 8), in' / 32 * 8]");
  at::Tensor y = check_x(x, out_features, blocks * kBlock, kBlock, bias, "linear_q8");
  const Tiles8 w{codes.data_ptr<int8_t>(), d.data_ptr<float>(), blocks};
#ifdef TOKENOPS_BLOCKS_AMX
  if (takes_amx(x)) {
    run_tiles_amx(x, w, bias, y);
    return y;
  }
#endif
  run_tiles(x, w, bias, y);
  return y;
}

// whether linear_q4 and linear_q8 can take AMX's tiles here (the build targets AMX-INT8 and the OS
// grants the tiles)
bool blocks_amx() {
#ifdef TOKENOPS_BLOCKS_AMX
  return amx_ready();
#else
  return false;
#endif
}

// the fewest rows a linear_q4 or linear_q8 call takes AMX's tiles from; returns the previous value
// (tests and benchmarks compare the paths on the same rows)
int64_t set_blocks_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "set_blocks_amx_min_rows: rows must be at least 1");
  return amx_min_rows.exchange(rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("blocks_amx() -> bool");
  m.impl("blocks_amx", c10::DispatchKey::CatchAll, TORCH_FN(blocks_amx));
  m.def("set_blocks_amx_min_rows(int rows) -> int");
  m.impl("set_blocks_amx_min_rows", c10::DispatchKey::CatchAll, TORCH_FN(set_blocks_amx_min_rows));
  m.def(
      "linear_q4(Tensor x, Tensor codes, Tensor d, Tensor m, int out_features, int group_size, Tensor? bias) -> "
      "Tensor");
  m.impl("linear_q4", c10::DispatchKey::CPU, TORCH_FN(linear_q4));
  m.def("linear_q4_silu_mul(Tensor x, Tensor codes, Tensor d, Tensor m, int out_features, int group_size) -> Tensor");
  m.impl("linear_q4_silu_mul", c10::DispatchKey::CPU, TORCH_FN(linear_q4_silu_mul));
  m.def("dequantize_q4_bf16(Tensor codes, Tensor d, Tensor m, int out_features, int group_size) -> Tensor");
  m.impl("dequantize_q4_bf16", c10::DispatchKey::CPU, TORCH_FN(dequantize_q4_bf16));
  m.def("linear_q8(Tensor x, Tensor codes, Tensor d, int out_features, Tensor? bias) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(linear_q8));
}
