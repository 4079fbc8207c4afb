// Paged attention over the KV cache, read in place through the block table (no gather), with an
// online softmax in float32 (flash attention / flash-decoding). Two ops share one core:
// - paged_decode_attention: one query per sequence (a decode step);
// - paged_prefill_attention: a chunk of queries per sequence, causal within the chunk and over the
//   cached prefix (a prefill chunk, a first one included once its keys are written).
//
// Matches the PyTorch paths of tokenops.engine.attention: grouped-query attention (the H / KV query
// heads of one KV head read each key once), caches in float32 / bfloat16 / float16 or int8 with a
// float16 scale per (slot, kv head), sliding windows, and an evicted gap (kept key j has absolute
// position j, or j + gap once j >= gap start; new tokens lie after the gap).
//
// Work items are (sequence, kv head, query tile, key chunk). A query tile is up to ~32 query rows
// (tokens x the kv head's query heads) that share every key and value read; each row sees the kept
// keys [first it may see by the window, its own index]. A tile's keys are split into chunks when
// there are too few tiles to keep every thread busy (batch 1 decode, a short chunk on a long prefix);
// each chunk keeps its own running max / sum / accumulator per row and a second pass merges them.
// Threads take units, longest first, from a shared counter: a unit is one tile's key chunk over every
// kv head, since a cache slot holds its heads' rows side by side and one thread reading them all
// reads each line once. Each thread allocates its scratch once. Tiles of at most kFewRows rows over
// a bf16 / f16 / int8 cache (a decode token's query heads; prefill chunks are tiled that small on
// these caches too), and prefill tiles over a float32 one on AVX2 builds, take attend_few_rows
// (AVX-512 or AVX2):
// a unit's heads key tile by key tile (each tile's slots read while in L1), each key and value
// loaded (and widened) in registers once for all the rows instead of once per row, the next tile
// prefetched into L2 and a head's values into L1 before its value pass.
// float32 queries are read in place through a row stride (the q slice of the fused q|k|v rows).
// Where the build has AVX512-BF16, prefill chunks of at least kDotMinTokens queries over a bf16
// cache take the bf16 dot-product path instead (attend_dot: vdpbf16ps on packed keys and values,
// queries and softmax weights rounded to bf16, float32 accumulation; on AMX's tiles where the build
// has AMX-BF16); other builds never compile it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENOPS_PA_BF16_DOT 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENOPS_PA_AVX2 1
#endif
#include <limits>
#include <numeric>
#include <optional>
#include <torch/library.h>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kTile = 32;           // keys scored before their values are accumulated
constexpr int64_t kRows = 32;           // query rows (tokens x heads of one kv head) per tile, at most, unless
                                        // one token alone has more (a kv head serving > 32 query heads)
constexpr int kFewRows = 8;             // tiles of at most this many rows take attend_few_rows (AVX-512, AVX2)
constexpr int64_t kMinChunk = 64;       // fewer keys than this per chunk are not worth a merge
// (query row, key) pairs below which the units run on the calling thread: between a step's ops the team
// is already spinning, so even a few dozen us of units finish sooner split over the threads
// (paged_decode_attention.py --step in docs/benchmarks.md)
constexpr int64_t kMinParallelUnits = 1024;
// (query row, key) pairs below which a tile's keys are not split into chunks for more threads: one
// decode stream of a few hundred keys already finishes sooner split (paged_decode_attention.py --step
// 1,K in docs/benchmarks.md); a split merges partial softmaxes, so it changes the sums' order
constexpr int64_t kMinSplit = 2048;
// (query row, key) pairs below which the dot path's packing runs on one thread
constexpr int64_t kMinParallelPack = 16384;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// attend_few_rows' conditions, shared by the tiling (which sizes tiles for it) and attend_unit (which
// hands it a unit): the head dims it is compiled for, and a unit of `items` kv heads' tiles of `rows`
// query rows each, at most kFewRows rows and all of the unit's in the scratch's `capacity` rows
constexpr bool few_rows_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }
constexpr bool few_rows_unit(int64_t rows, int64_t items, int64_t capacity) {
  return rows >= 1 && rows <= kFewRows && items * rows <= capacity;
}
// The caches attend_few_rows reads: half and int8 ones everywhere; float32 ones on AVX2 builds for
// prefill tiles, where sharing each key load among a tile's rows beats the general path's row-by-row
// re-reads (paged_prefill_attention.py); AVX-512 builds keep the general path for float32, unmeasured
// there.
#if defined(TOKENOPS_PA_AVX2)
constexpr bool kFewRowsFloat = true;
#else
constexpr bool kFewRowsFloat = false;
#endif
template <typename T>
constexpr bool few_rows_type() {
  return std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half> || std::is_same_v<T, int8_t> ||
         (kFewRowsFloat && std::is_same_v<T, float>);
}

// The inner loops: AVX-512 where the build has it and head_dim is a multiple of 16, AVX2 (8 lanes)
// where that is the build's widest and head_dim is a multiple of 8, plain loops otherwise. (GCC's `omp simd` reductions sum the 16 lanes one by one, and it left a loop of an
// inline polynomial exp scalar: both were most of the time before these were written out.)

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef __AVX512F__
  if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(TOKENOPS_PA_AVX2)
  if (d % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

#ifdef __AVX512F__
// The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]): 15 shuffle+add pairs
// instead of 16 separate reductions.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: [a, b, c, d] partial sums
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // u[i] lane L holds keys 4i..4i+3 summed over lane L's elements: add the 4 lanes together
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[0..15] = q . k[j] for 16 key rows
template <int64_t kD>
inline __m512 scores16(const float* q, const float* const* k, int64_t d) {
  const int64_t D = kD > 0 ? kD : d;
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k[j]));
    if (D % 32 == 0) {  // two independent chains: half the FMA latency per key
      __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(k[j] + 16));
      for (int64_t i = 32; i < D; i += 32) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k[j] + i), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k[j] + i + 16), b);
      }
      a = _mm512_add_ps(a, b);
    } else {
      for (int64_t i = 16; i < D; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k[j] + i), a);
    }
    acc[j] = a;
  }
  return hsum16(acc);
}

// exp for x <= 0 (scores minus their max), Cephes' polynomial; 2^n applied with scalef
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#endif

#ifdef TOKENOPS_PA_AVX2
// The 8 horizontal sums of v[0..7] as one vector (lane j = sum of v[j])
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // t0's low 128 bits: v[0..3]'s elements 0-3 summed, high: their elements 4-7 (t1 likewise, v[4..7])
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// s[0..7] = q . k[j] for 8 key rows
template <int64_t kD>
inline __m256 scores8(const float* q, const float* const* k, int64_t d) {
  const int64_t D = kD > 0 ? kD : d;
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k[j]));
    if (D % 16 == 0) {  // two independent chains: half the FMA latency per key
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k[j] + 8));
      for (int64_t i = 16; i < D; i += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k[j] + i), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k[j] + i + 8), b);
      }
      a = _mm256_add_ps(a, b);
    } else {
      for (int64_t i = 8; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k[j] + i), a);
    }
    acc[j] = a;
  }
  return hsum8x8(acc);
}

// exp for x <= 0, the AVX-512 path's polynomial; 2^n built in the exponent bits (n >= -126 here)
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// s[t] = exp(s[t] - mx) for t < n (callers pass only visible keys' scores); returns their sum
inline float exp_shifted(float* s, int64_t n, float mx) {
  float sum = 0.f;
#ifdef __AVX512F__
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  int64_t t = 0;
#ifdef TOKENOPS_PA_AVX2
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
#endif
  return sum;
}

// acc[0:d] += sum_t w[t] * rows[t][0:d]
inline void accumulate(float* acc, const float* w, const float* const* rows, int64_t n, int64_t d) {
#ifdef __AVX512F__
  if (d % 16 == 0 && d <= 256) {
    // the whole row's accumulators in registers: independent FMAs per key, not one dependent chain
    __m512 a[16];
    const int64_t nv = d / 16;
    for (int64_t c = 0; c < nv; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      for (int64_t c = 0; c < nv; ++c) a[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(rows[t] + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#elif defined(TOKENOPS_PA_AVX2)
  if (d % 8 == 0) {
    // up to 64 columns' accumulators in registers at a time (8 of the 16), every key per chunk
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      const int64_t nv = std::min<int64_t>(8, (d - c0) / 8);
      __m256 a[8];
      for (int64_t c = 0; c < nv; ++c) a[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 wt = _mm256_set1_ps(w[t]);
        for (int64_t c = 0; c < nv; ++c) a[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(rows[t] + c0 + 8 * c), a[c]);
      }
      for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float wt = w[t];
    const float* r = rows[t];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += wt * r[i];
  }
}

// A cache row as float: float32 rows are used in place, others converted into `buf`.
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#ifdef __AVX512F__
    if (d % 16 == 0) {
      for (int64_t i = 0; i < d; i += 16) {
        __m512 x;
        if constexpr (std::is_same_v<T, at::BFloat16>) {  // bfloat16: the high half of a float32
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
          x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else if constexpr (std::is_same_v<T, at::Half>) {
          x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        } else {
          static_assert(std::is_same_v<T, int8_t>, "caches are float32, bfloat16, float16 or int8");
          x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
        }
        _mm512_storeu_ps(buf + i, x);
      }
      return buf;
    }
#elif defined(TOKENOPS_PA_AVX2)
    if (d % 8 == 0) {
      for (int64_t i = 0; i < d; i += 8) {
        __m256 x;
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
          x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else if constexpr (std::is_same_v<T, at::Half>) {
          x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        } else {
          static_assert(std::is_same_v<T, int8_t>, "caches are float32, bfloat16, float16 or int8");
          x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i))));
        }
        _mm256_storeu_ps(buf + i, x);
      }
      return buf;
    }
#endif
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

struct Item {
  int64_t s, g;    // sequence, kv head
  int64_t t0, nt;  // the tile's first token (kept-key index of the sequence's queries: t0 .. t0+nt-1 within the chunk)
  int64_t lo, hi;  // keys [lo, hi) of this chunk
  int64_t part;    // first row's index into the partial buffers; -1: the only chunk, write the output
  bool dot = false;  // the bf16 dot-product path (attend_dot)
};

struct Problem {
  const float* q;  // [T, H, D], token t's heads from q + t * q_row (a slice of the fused q|k|v projection)
  float* out;      // [T, H, D]
  const int64_t* tables;
  const int64_t* q_start;  // [S] first query row of each sequence
  const int64_t* q_len;    // [S]
  const int64_t* len;      // [S] kept keys after this step
  const int64_t* gap;      // [S, 2] or null
  int64_t table_width, block_size, kv_heads, group, d, window;
  float scale;
  const at::Half* k_scale;  // int8 only: [slots, KV]
  const at::Half* v_scale;
  float* part_m;  // [part rows]
  float* part_l;
  float* part_acc;  // [part rows, D]
  // the bf16 dot-product path's packed keys and values: sequence s's kv head g has pack_blocks[s]
  // blocks of kDotKeys keys from kept key pack_base[s], from block pack_first[s] + g * pack_blocks[s]
  const uint32_t* kpack = nullptr;
  const uint32_t* vpack = nullptr;
  const int64_t* pack_first = nullptr;
  const int64_t* pack_base = nullptr;
  const int64_t* pack_blocks = nullptr;
  int64_t q_row = 0;  // floats from one token's queries to the next's
};

// The output row of an item's query row r: token it.t0 + r / G, head it.g * G + r % G
inline float* out_row(const Problem& p, const Item& it, int64_t r) {
  return p.out + ((p.q_start[it.s] + it.t0 + r / p.group) * p.kv_heads * p.group + it.g * p.group + r % p.group) * p.d;
}

// First kept key a query at kept index `j` may see: all of them, or those inside the window
// (absolute positions: kept key i sits at i, or i + gap once i >= gap start; the query at j + gap).
inline int64_t window_start(int64_t j, int64_t gap_start, int64_t gap, int64_t window) {
  if (window <= 0) return 0;
  const int64_t lowest = j + 1 + gap - window;  // lowest absolute position inside the window
  if (gap == 0 || lowest < gap_start) return std::max<int64_t>(0, lowest);
  return std::max(gap_start, j + 1 - window);  // kept keys past the gap: absolute = i + gap
}

// Per thread, allocated once: `rows` is a tile's most query rows, max(kRows, group size).
struct Scratch {
  std::vector<float> acc, m, l, sc, vw, kbuf, vbuf;
  std::vector<const float*> qrow;
  std::vector<int64_t> rlo, rhi;
  Scratch(int64_t D, int64_t rows, bool convert)
      : acc(rows * D), m(rows), l(rows), sc(rows * kTile), vw(kTile),
        kbuf(convert ? kTile * D : 0), vbuf(kbuf.size()), qrow(rows), rlo(rows), rhi(rows) {}
};

#if defined(__AVX512F__) || defined(TOKENOPS_PA_AVX2)
// Tiles of few query rows (a decode token's heads of one kv head: the group, 3 in SmolLM2) read each
// key and value once for all their rows, widened in registers: converting them into a buffer first
// (the general path) costs more than the rows' arithmetic when only a few rows share it. Each row's
// arithmetic is the general path's, in the same order (scores16's two chains, accumulate's FMAs
// key by key), so a query gets the same bits on either path and from a half cache as from a float32
// one holding the same values.

// The value pass's width: how many of a row's vectors of columns it takes per pass over a tile's keys.
// Each (row, vector) is an FMA chain one step per key, and an FMA waits ~4 cycles for its chain's
// last one: a pass of few rows over two vectors (3 rows, 6 chains in SmolLM2) waits on latency
// rather than on the FMA pipes. As many vectors as keep the R x V accumulators, the V vectors of a
// key's values and the R weights in `regs` registers (a spilled accumulator would chain through
// memory instead).
constexpr int value_vectors(int rows, int64_t vectors, int regs) {
  int v = 1;
  while (v < vectors && rows * (v + 1) + rows + (v + 1) <= regs) ++v;
  return v;
}

// A tile's value rows into L1 while its scores go through the softmax: the value pass then finds
// them there instead of waiting on each key's lines in turn.
template <typename T>
inline void prefetch_values(const T* const* vrow, int64_t nk, int64_t bytes) {
  for (int64_t t = 0; t < nk; ++t)
    for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(reinterpret_cast<const char*>(vrow[t]) + x, _MM_HINT_T0);
}

// acc [R, D] += sc[r, t] * v[t] over the tile's nk keys, key by key per column (accumulate's order):
// V vectors of L::kWidth columns from vector v0 per pass. L: the ISA's ValueLanes.
template <class L, typename T, int64_t D, int R, int V>
inline void value_columns(const T* const* vrow, int64_t nk, const float* sc, float* acc, int64_t v0) {
  typename L::V e[R][V];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) e[r][i] = L::load(acc + r * D + L::kWidth * (v0 + i));
  for (int64_t t = 0; t < nk; ++t) {
    typename L::V x[V];
    for (int i = 0; i < V; ++i) x[i] = L::row(vrow[t] + L::kWidth * (v0 + i));
    for (int r = 0; r < R; ++r) {
      const typename L::V wt = L::set1(sc[r * kTile + t]);
      for (int i = 0; i < V; ++i) e[r][i] = L::fma(wt, x[i], e[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) L::store(acc + r * D + L::kWidth * (v0 + i), e[r][i]);
}

// The value pass: passes of value_vectors(R, ...) vectors, the last one narrower where they do not divide
template <class L, typename T, int64_t D, int R>
inline void value_pass(const T* const* vrow, int64_t nk, const float* sc, float* acc) {
  constexpr int64_t n = D / L::kWidth;
  constexpr int V = value_vectors(R, n, L::kRegs), tail = static_cast<int>(n % V);
  int64_t v0 = 0;
  for (; v0 + V <= n; v0 += V) value_columns<L, T, D, R, V>(vrow, nk, sc, acc, v0);
  if constexpr (tail > 0) value_columns<L, T, D, R, tail>(vrow, nk, sc, acc, v0);
}

// The online softmax of a tile's R rows over the keys each sees, between the scores and the value
// pass: the weights of the keys a row does not see are zeroed, so the value pass runs every row over
// every key of the tile; an int8 cache's value scales are folded into the weights. `row_max(s, a,
// e, m)` is the ISA's max of s[a, e) and m.
template <int64_t D, int R, typename RowMax>
inline void few_rows_softmax(float* sc, int64_t k0, int64_t nk, const int64_t* rlo, const int64_t* rhi, float* acc,
                             float* m, float* l, const float* vscale, RowMax row_max) {
  for (int r = 0; r < R; ++r) {
    float* sr = sc + r * kTile;
    const int64_t a = std::max<int64_t>(rlo[r] - k0, 0), e = std::min<int64_t>(rhi[r] - k0 + 1, nk);
    if (a >= e) {
      std::fill(sr, sr + nk, 0.f);
      continue;
    }
    const float mt = row_max(sr, a, e, m[r]);
    const float sum = exp_shifted(sr + a, e - a, mt);
    std::fill(sr, sr + a, 0.f);
    std::fill(sr + e, sr + nk, 0.f);
    if (mt > m[r]) {  // the running max moved: rescale what was accumulated under the old one
      const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - mt);
      l[r] *= corr;
      float* ar = acc + r * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) ar[i] *= corr;
      m[r] = mt;
    }
    l[r] += sum;
    if (vscale)
      for (int64_t t = a; t < e; ++t) sr[t] *= vscale[t];
  }
}

#ifdef __AVX512F__
// 16 elements of a cache row as one float vector, widened exactly.
template <typename T>
inline __m512 load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  } else if constexpr (std::is_same_v<T, int8_t>) {  // int8: the value, its scale applied by the caller
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>, "few-row tiles read float32, float16, bfloat16 or int8");
    // bfloat16: the high half of a float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 32 elements as two float vectors (elements 0-15, 16-31)
template <typename T>
inline void load32(const T* src, __m512& a, __m512& b) {
  a = load_vec(src);
  b = load_vec(src + 16);
}

// the value pass's vector operations (value_columns) at 16 lanes, with 30 of the 32 registers
struct ValueLanes {
  using V = __m512;
  static constexpr int kWidth = 16, kRegs = 30;
  template <typename T>
  static V row(const T* src) { return load_vec(src); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

// One key tile (nk keys from k0, rows krow / vrow) for R rows of one kv head: scores, the online
// softmax and the value pass, on the rows' running state (acc [R, D], m, l; sc is [R, kTile]). An
// int8 cache gives each key's score scale (softmax scale x its key scale) and value scale; the
// general path applies them at the same steps, so the two agree bit for bit.
template <typename T, int64_t kD, int R>
inline void few_rows_tile(float scale, const T* const* krow, const T* const* vrow, int64_t nk, int64_t k0,
                          const float* const* qrow, const int64_t* rlo, const int64_t* rhi, float* acc, float* m,
                          float* l, float* sc, const float* kscale, const float* vscale) {
  constexpr int64_t D = kD, C = kD / 32;
  alignas(64) __m512 part[R][16];
  for (int64_t h = 0; h < nk; h += 16) {
    for (int j = 0; j < 16; ++j) {
      // per row two chains, summed at the end: scores16's order, so a row scores a key alike on both paths
      __m512 sa[R], sb[R];
      __m512 x, y;
      load32(krow[h + j], x, y);
      for (int r = 0; r < R; ++r) {
        sa[r] = _mm512_mul_ps(_mm512_loadu_ps(qrow[r]), x);
        sb[r] = _mm512_mul_ps(_mm512_loadu_ps(qrow[r] + 16), y);
      }
      for (int64_t c = 1; c < C; ++c) {
        load32(krow[h + j] + 32 * c, x, y);
        for (int r = 0; r < R; ++r) {
          sa[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qrow[r] + 32 * c), x, sa[r]);
          sb[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qrow[r] + 32 * c + 16), y, sb[r]);
        }
      }
      for (int r = 0; r < R; ++r) part[r][j] = _mm512_add_ps(sa[r], sb[r]);
    }
    const __m512 ks = kscale ? _mm512_loadu_ps(kscale + h) : _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sc + r * kTile + h, _mm512_mul_ps(hsum16(part[r]), ks));
  }
  prefetch_values(vrow, nk, D * int64_t(sizeof(T)));
  few_rows_softmax<D, R>(sc, k0, nk, rlo, rhi, acc, m, l, vscale, [](const float* s, int64_t a, int64_t e, float mx) {
    __m512 mv = _mm512_set1_ps(mx);
    for (int64_t t = a; t < e; t += 16) {
      const __mmask16 k = e - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (e - t)) - 1);
      mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + t));
    }
    return _mm512_reduce_max_ps(mv);
  });
  value_pass<ValueLanes, T, D, R>(vrow, nk, sc, acc);
}

#else
// 8 elements of a cache row as one float vector, widened exactly as row_as_float widens them for the
// general path.
template <typename T>
inline __m256 load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(src);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  } else if constexpr (std::is_same_v<T, int8_t>) {  // int8: the value, its scale applied by the caller
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>, "few-row tiles read float32, float16, bfloat16 or int8");
    // bfloat16: the high half of a float32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 16 elements as two float vectors (elements 0-7, 8-15)
template <typename T>
inline void load16(const T* src, __m256& a, __m256& b) {
  a = load_vec(src);
  b = load_vec(src + 8);
}

// the value pass's vector operations (value_columns) at 8 lanes, with 15 of the 16 registers
struct ValueLanes {
  using V = __m256;
  static constexpr int kWidth = 8, kRegs = 15;
  template <typename T>
  static V row(const T* src) { return load_vec(src); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

// few_rows_tile on AVX2: eight lanes, the general AVX2 path's steps (scores8's two chains, hsum8x8,
// accumulate's FMAs key by key), so the two agree bit for bit here too.
template <typename T, int64_t kD, int R>
inline void few_rows_tile(float scale, const T* const* krow, const T* const* vrow, int64_t nk, int64_t k0,
                          const float* const* qrow, const int64_t* rlo, const int64_t* rhi, float* acc, float* m,
                          float* l, float* sc, const float* kscale, const float* vscale) {
  constexpr int64_t D = kD, C = kD / 16;
  alignas(32) __m256 part[R][8];
  for (int64_t h = 0; h < nk; h += 8) {
    for (int j = 0; j < 8; ++j) {
      __m256 sa[R], sb[R];
      __m256 x, y;
      load16(krow[h + j], x, y);
      for (int r = 0; r < R; ++r) {
        sa[r] = _mm256_mul_ps(_mm256_loadu_ps(qrow[r]), x);
        sb[r] = _mm256_mul_ps(_mm256_loadu_ps(qrow[r] + 8), y);
      }
      for (int64_t c = 1; c < C; ++c) {
        load16(krow[h + j] + 16 * c, x, y);
        for (int r = 0; r < R; ++r) {
          sa[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qrow[r] + 16 * c), x, sa[r]);
          sb[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qrow[r] + 16 * c + 8), y, sb[r]);
        }
      }
      for (int r = 0; r < R; ++r) part[r][j] = _mm256_add_ps(sa[r], sb[r]);
    }
    const __m256 ks = kscale ? _mm256_loadu_ps(kscale + h) : _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(sc + r * kTile + h, _mm256_mul_ps(hsum8x8(part[r]), ks));
  }
  prefetch_values(vrow, nk, D * int64_t(sizeof(T)));
  few_rows_softmax<D, R>(sc, k0, nk, rlo, rhi, acc, m, l, vscale, [](const float* s, int64_t a, int64_t e, float mx) {
    for (int64_t t = a; t < e; ++t) mx = std::max(mx, s[t]);
    return mx;
  });
  value_pass<ValueLanes, T, D, R>(vrow, nk, sc, acc);
}
#endif

// The rows' results: the output (the item is its tile's only chunk) or the chunk's partial state.
template <int64_t D, int R>
inline void few_rows_finish(const Problem& p, const Item& it, const float* const* qrow, const float* acc,
                            const float* m, const float* l) {
  for (int r = 0; r < R; ++r) {
    const float* ar = acc + r * D;
    if (it.part < 0) {
      float* o = out_row(p, it, r);
      const float inv = 1.f / l[r];
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) o[e] = ar[e] * inv;
    } else {
      p.part_m[it.part + r] = m[r];
      p.part_l[it.part + r] = l[r];
      std::copy(ar, ar + D, p.part_acc + (it.part + r) * D);
    }
  }
}

// A unit's items (one tile chunk, kv heads items[0].g ..), R rows each, key tile by key tile: each
// tile's slots are read once for every head (a slot holds its heads' rows side by side), while
// they are in L1, and the next tile's slots are prefetched into L2, whole. qrow / rlo / rhi hold
// the items' rows one item after the other.
template <typename T, int64_t kD, int R>
void attend_few_rows(const Problem& p, const T* k_cache, const T* v_cache, const Item* items, int64_t n_items,
                     Scratch& w, const float* const* qrow, const int64_t* rlo, const int64_t* rhi) {
  static_assert(kD % 32 == 0 && R >= 1 && R <= kFewRows, "head_dim a multiple of 32, at most kFewRows rows");
  constexpr int64_t D = kD;
  const Item& it = items[0];
  const int64_t KV = p.kv_heads, bs = p.block_size;
  const int64_t* table = p.tables + it.s * p.table_width;
  float* acc = w.acc.data();  // [n_items * R, D]
  float* m = w.m.data();
  float* l = w.l.data();
  std::fill(acc, acc + n_items * R * D, 0.f);
  std::fill(m, m + n_items * R, kNegInf);
  std::fill(l, l + n_items * R, 0.f);
  int64_t slot[kTile];
  const T* krow[kTile];
  const T* vrow[kTile];
  alignas(64) float kscale[kTile], vscale[kTile];  // an int8 cache's, per key of the head's pass
  const bool scaled = p.k_scale != nullptr;
  constexpr int64_t tile = D >= 256 ? 16 : kTile;  // the general path's key tiles: the same softmax steps
  for (int64_t k0 = it.lo; k0 < it.hi; k0 += tile) {
    const int64_t nk = std::min(tile, it.hi - k0);
    int64_t b = k0 / bs, o = k0 % bs;
    for (int64_t t = 0; t < nk; ++t) {
      slot[t] = table[b] * bs + o;
      if (++o == bs) o = 0, ++b;
    }
    for (int64_t t = nk; t < tile; ++t) slot[t] = slot[0];  // padding: scored, never used
    // the next tile's slots, every head this unit reads, into L2 (decode reads each layer's cache
    // from memory), a share before each head's pass so that the requests spread over the tile's work
    const int64_t k1 = k0 + tile, n1 = std::max<int64_t>(0, std::min(tile, it.hi - k1));
    const int64_t bytes = n_items * D * int64_t(sizeof(T));
    int64_t next_slot[kTile];
    {
      int64_t b1 = k1 / bs, o1 = k1 % bs;
      for (int64_t t = 0; t < n1; ++t) {
        next_slot[t] = table[b1] * bs + o1;
        if (++o1 == bs) o1 = 0, ++b1;
      }
    }
    for (int64_t i = 0; i < n_items; ++i) {
      const int64_t g = items[i].g;
      for (int64_t t = n1 * i / n_items; t < n1 * (i + 1) / n_items; ++t) {
        const int64_t off = (next_slot[t] * KV + it.g) * D;
        for (int64_t x = 0; x < bytes; x += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + off) + x, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + off) + x, _MM_HINT_T1);
        }
      }
      for (int64_t t = 0; t < tile; ++t) {
        krow[t] = k_cache + (slot[t] * KV + g) * D;
        vrow[t] = v_cache + (slot[t] * KV + g) * D;
      }
      if (scaled)
        for (int64_t t = 0; t < tile; ++t) {
          kscale[t] = p.scale * static_cast<float>(p.k_scale[slot[t] * KV + g]);
          vscale[t] = static_cast<float>(p.v_scale[slot[t] * KV + g]);
        }
      few_rows_tile<T, kD, R>(p.scale, krow, vrow, nk, k0, qrow + i * R, rlo + i * R, rhi + i * R, acc + i * R * D,
                              m + i * R, l + i * R, w.sc.data(), scaled ? kscale : nullptr,
                              scaled ? vscale : nullptr);
    }
  }
  for (int64_t i = 0; i < n_items; ++i)
    few_rows_finish<D, R>(p, items[i], qrow + i * R, acc + i * R * D, m + i * R, l + i * R);
}

// attend_few_rows for R = rows (1 .. kFewRows); false when this unit is not one it takes
template <typename T, int64_t kD>
bool few_rows(int64_t rows, const Problem& p, const T* k_cache, const T* v_cache, const Item* items, int64_t n,
              Scratch& w, const float* const* qrow, const int64_t* rlo, const int64_t* rhi) {
  if constexpr (few_rows_head_dim(kD) && few_rows_type<T>()) {
    switch (rows) {
#define TOKENOPS_FEW_ROWS(R) \
  case R:                    \
    attend_few_rows<T, kD, R>(p, k_cache, v_cache, items, n, w, qrow, rlo, rhi); \
    return true;
      TOKENOPS_FEW_ROWS(1) TOKENOPS_FEW_ROWS(2) TOKENOPS_FEW_ROWS(3) TOKENOPS_FEW_ROWS(4)
      TOKENOPS_FEW_ROWS(5) TOKENOPS_FEW_ROWS(6) TOKENOPS_FEW_ROWS(7) TOKENOPS_FEW_ROWS(8)
#undef TOKENOPS_FEW_ROWS
      default:
        return false;
    }
  }
  return false;
}
#endif

// An item's query rows: row r = (token it.t0 + r / G, head r % G), which sees kept keys [rlo, rhi]
inline int64_t item_rows(const Problem& p, const Item& it, const float** qrow, int64_t* rlo, int64_t* rhi) {
  const int64_t G = p.group, D = p.d, KV = p.kv_heads;
  const int64_t s = it.s, n = p.q_len[s], L = p.len[s];
  const int64_t gs = p.gap ? p.gap[2 * s] : 0, gl = p.gap ? p.gap[2 * s + 1] : 0;
  const int64_t R = it.nt * G;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = it.t0 + r / G, j = L - n + t;  // the token's kept index
    qrow[r] = p.q + (p.q_start[s] + t) * p.q_row + (it.g * G + r % G) * D;
    rhi[r] = j;
    rlo[r] = window_start(j, gs, gl, p.window);
  }
  return R;
}

// An item's R rows done: normalised into the output where the item is its rows' only key chunk, else
// their running max, sum and accumulator into the partial buffers, merged once every chunk is done
inline void finish_rows(const Problem& p, const Item& it, const float* const* qrow, int64_t R, int64_t D,
                        const float* m, const float* l, const float* acc) {
  for (int64_t r = 0; r < R; ++r) {
    if (it.part < 0) {
      float* o = out_row(p, it, r);
      const float inv = 1.f / l[r];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] = acc[r * D + i] * inv;
    } else {
      p.part_m[it.part + r] = m[r];
      p.part_l[it.part + r] = l[r];
      std::copy(acc + r * D, acc + (r + 1) * D, p.part_acc + (it.part + r) * D);
    }
  }
}

// kD > 0: head_dim known at compile time (the common sizes), so the per-key loops unroll fully
template <typename T, int64_t kD>
void attend(const Problem& p, const T* k_cache, const T* v_cache, const Item& it, Scratch& w) {
  const int64_t G = p.group, D = kD > 0 ? kD : p.d, KV = p.kv_heads, bs = p.block_size;
  const int64_t* table = p.tables + it.s * p.table_width;
  const float** qrow = w.qrow.data();
  int64_t* rlo = w.rlo.data();
  int64_t* rhi = w.rhi.data();
  const int64_t R = item_rows(p, it, qrow, rlo, rhi);
  float* acc = w.acc.data();
  float* m = w.m.data();
  float* l = w.l.data();
  std::fill(acc, acc + R * D, 0.f);
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R, 0.f);
  const float* krow[kTile];
  const float* vrow[kTile];
  int64_t off[kTile];
  alignas(64) float colscale[kTile];
  // every row of the tile reads its keys and values again: 16 keys at head_dim 256 keep them in L1
  // (32 float32 keys there would be 64 KB)
  const int64_t tile = (kD > 0 ? kD : p.d) >= 256 ? 16 : kTile;
  for (int64_t k0 = it.lo; k0 < it.hi; k0 += tile) {
    const int64_t nk = std::min(tile, it.hi - k0);
    int64_t b = k0 / bs, o = k0 % bs;
    for (int64_t t = 0; t < nk; ++t) {
      off[t] = (table[b] * bs + o) * KV + it.g;  // (slot, kv head)
      krow[t] = row_as_float(k_cache + off[t] * D, w.kbuf.data() + t * D, D);
      vrow[t] = row_as_float(v_cache + off[t] * D, w.vbuf.data() + t * D, D);
      colscale[t] = p.k_scale ? p.scale * static_cast<float>(p.k_scale[off[t]]) : p.scale;
      if (++o == bs) o = 0, ++b;
    }
    for (int64_t t = nk; t < kTile; ++t) krow[t] = krow[0], colscale[t] = 0.f;  // padding, masked below
    for (int64_t r = 0; r < R; ++r) {
      if (rhi[r] < k0 || rlo[r] >= k0 + nk) continue;  // none of this tile's keys is visible to the row
      float* sr = w.sc.data() + r * kTile;
#ifdef __AVX512F__
      if (D % 16 == 0) {
        for (int64_t h = 0; h < nk; h += 16)
          _mm512_storeu_ps(sr + h, _mm512_mul_ps(scores16<kD>(qrow[r], krow + h, D), _mm512_loadu_ps(colscale + h)));
      } else
#elif defined(TOKENOPS_PA_AVX2)
      if (D % 8 == 0) {
        for (int64_t h = 0; h < nk; h += 8)
          _mm256_storeu_ps(sr + h, _mm256_mul_ps(scores8<kD>(qrow[r], krow + h, D), _mm256_loadu_ps(colscale + h)));
      } else
#endif
      {
        for (int64_t t = 0; t < nk; ++t) sr[t] = dot(qrow[r], krow[t], D) * colscale[t];
      }
      // only keys [rlo, rhi] count (the causal diagonal, a window's lower edge)
      const int64_t a = std::max<int64_t>(rlo[r] - k0, 0), e = std::min<int64_t>(rhi[r] - k0 + 1, nk);
      float mt = m[r];
      for (int64_t t = a; t < e; ++t) mt = std::max(mt, sr[t]);
      const float sum = exp_shifted(sr + a, e - a, mt);
      float* ar = acc + r * D;
      if (mt > m[r]) {  // the running max moved: rescale what was accumulated under the old one
        const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - mt);
        l[r] *= corr;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ar[i] *= corr;
        m[r] = mt;
      }
      l[r] += sum;
      const float* wt = sr;
      if (p.v_scale) {
        for (int64_t t = a; t < e; ++t) w.vw[t] = sr[t] * static_cast<float>(p.v_scale[off[t]]);
        wt = w.vw.data();
      }
      accumulate(ar, wt + a, vrow + a, e - a, D);
    }
  }
  finish_rows(p, it, qrow, R, D, m, l, acc);
}

#ifdef TOKENOPS_PA_BF16_DOT
// The bf16 dot-product path, for prefill chunks over a bf16 cache where the CPU has AVX512-BF16:
// vdpbf16ps multiplies two bf16 pairs per float32 lane, twice the FMA path's products per
// instruction, and reads keys and values as stored instead of widening them. Queries and softmax
// weights are rounded to bf16 (as oneDNN's and vLLM's bf16 attention do); scores, the online softmax
// and the accumulators stay float32. The keys a chunk sees are packed once per step into the layouts
// vdpbf16ps reads (dot_pack_block); a tile of up to kDotRows query rows then reads each packed block
// once for all its rows.
constexpr int64_t kDotKeys = 32;     // keys per packed block: two vectors of 16 scores per row
constexpr int64_t kDotRows = 48;     // query rows per tile (16 tokens of a 3-head group)
constexpr int64_t kDotMinTokens = 32;  // shorter chunks (decodes among them) keep the exact path
constexpr int kDotScoreRows = 8;     // rows scored together: 16 accumulators
constexpr int kDotValueRows = 6;     // rows whose values are accumulated together: 24 accumulators
constexpr int64_t kDotValueCols = 64;  // columns per value pass (4 vectors)
static_assert(kDotKeys == kTile, "the scratch's score rows are kTile wide");

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Keys [k0, k0 + kDotKeys) of sequence s's kv head g (those outside [lo, L) as zeros: no query sees
// them, and a block before the window's first may no longer be the sequence's) into kp
// [D/2][kDotKeys] words (key t's dims 2i, 2i+1 at [i][t]: one vector holds a dim pair of 16 keys) and
// vp [kDotKeys/2][D] words (keys 2u, 2u+1's dim d at [u][d]: one vector holds a key pair of 16 dims).
void dot_pack_block(const Problem& p, const at::BFloat16* k_cache, const at::BFloat16* v_cache, int64_t s,
                    int64_t g, int64_t k0, int64_t lo, int64_t L, uint32_t* kp, uint32_t* vp) {
  alignas(64) static const uint16_t zero[256] = {};
  const int64_t D = p.d, KV = p.kv_heads, bs = p.block_size;
  const int64_t* table = p.tables + s * p.table_width;
  const uint16_t* krow[kDotKeys];
  const uint16_t* vrow[kDotKeys];
  for (int64_t t = 0; t < kDotKeys; ++t) {
    const int64_t j = k0 + t;
    if (j >= lo && j < L) {
      const int64_t off = ((table[j / bs] * bs + j % bs) * KV + g) * D;
      krow[t] = reinterpret_cast<const uint16_t*>(k_cache + off);
      vrow[t] = reinterpret_cast<const uint16_t*>(v_cache + off);
    } else {
      krow[t] = vrow[t] = zero;
    }
  }
  for (int64_t t = 0; t < kDotKeys; ++t) {
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(krow[t]);
    for (int64_t i = 0; i < D / 2; ++i) kp[i * kDotKeys + t] = kw[i];
  }
  alignas(64) uint16_t low[32], high[32];  // lane j: dim j / 2 of the first (even j) or second row
  for (int j = 0; j < 32; ++j) low[j] = static_cast<uint16_t>((j & 1) * 32 + j / 2), high[j] = low[j] + 16;
  const __m512i ilo = _mm512_load_si512(low), ihi = _mm512_load_si512(high);
  for (int64_t u = 0; u < kDotKeys / 2; ++u)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(vrow[2 * u] + d), b = _mm512_loadu_si512(vrow[2 * u + 1] + d);
      _mm512_storeu_si512(vp + u * D + d, _mm512_permutex2var_epi16(a, ilo, b));
      _mm512_storeu_si512(vp + u * D + d + 16, _mm512_permutex2var_epi16(a, ihi, b));
    }
}

// sc[r][0..kDotKeys) = q_r . k_t for NR bf16 query rows (qb, row stride D) and one packed key block
template <int NR>
inline void dot_scores(const uint16_t* qb, int64_t D, const uint32_t* kp, float* sc) {
  __m512 a[NR], b[NR];
  for (int r = 0; r < NR; ++r) a[r] = b[r] = _mm512_setzero_ps();
  const int32_t* q = reinterpret_cast<const int32_t*>(qb);
  for (int64_t i = 0; i < D / 2; ++i) {
    const __m512bh k0 = as_bh(_mm512_loadu_si512(kp + i * kDotKeys));
    const __m512bh k1 = as_bh(_mm512_loadu_si512(kp + i * kDotKeys + 16));
    for (int r = 0; r < NR; ++r) {
      const __m512bh x = as_bh(_mm512_set1_epi32(q[r * D / 2 + i]));
      a[r] = _mm512_dpbf16_ps(a[r], x, k0);
      b[r] = _mm512_dpbf16_ps(b[r], x, k1);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(sc + r * kDotKeys, a[r]);
    _mm512_storeu_ps(sc + r * kDotKeys + 16, b[r]);
  }
}

// acc[r][c0 .. c0 + 64) += sum_t p[r][t] v_t over one packed value block, NR rows of bf16 weights
// (pb, row stride kDotKeys), acc row stride D
template <int NR>
inline void dot_values(const uint16_t* pb, const uint32_t* vp, int64_t D, int64_t c0, float* acc) {
  __m512 o[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c) o[r][c] = _mm512_loadu_ps(acc + r * D + c0 + 16 * c);
  const int32_t* pw = reinterpret_cast<const int32_t*>(pb);  // row r's key pair u at [r * kDotKeys / 2 + u]
  for (int64_t u = 0; u < kDotKeys / 2; ++u) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = as_bh(_mm512_loadu_si512(vp + u * D + c0 + 16 * c));
    for (int r = 0; r < NR; ++r) {
      const __m512bh x = as_bh(_mm512_set1_epi32(pw[r * kDotKeys / 2 + u]));
      for (int c = 0; c < 4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], x, v[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * D + c0 + 16 * c, o[r][c]);
}

// dot_scores / dot_values for the n (1 .. their NR) rows left
template <int NR>
inline void dot_scores_n(int64_t n, const uint16_t* qb, int64_t D, const uint32_t* kp, float* sc) {
  if constexpr (NR > 1)
    if (n < NR) return dot_scores_n<NR - 1>(n, qb, D, kp, sc);
  dot_scores<NR>(qb, D, kp, sc);
}
template <int NR>
inline void dot_values_n(int64_t n, const uint16_t* pb, const uint32_t* vp, int64_t D, int64_t c0, float* acc) {
  if constexpr (NR > 1)
    if (n < NR) return dot_values_n<NR - 1>(n, pb, vp, D, c0, acc);
  dot_values<NR>(pb, vp, D, c0, acc);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENOPS_PA_AMX 1
// Where the CPU has AMX-BF16, the dot path's products run on the tiles (attend_dot): per 16 query
// rows, TDPBF16PS scores 16 x 32 keys of a packed block in D / 32 products and adds weights x values
// into the accumulators in D / 16, several times vdpbf16ps's products per instruction. The packed
// blocks are already the tiles' B layout (a dim pair, or a key pair, per 32-bit word) and the bf16
// queries and weights their A layout. Up to kAmxBlocks blocks go through the online softmax at once,
// so a row's max, sum and rescaling, and each accumulator tile's trip through memory, serve 128 keys.
// The products are bf16 pairs summed in float32, as vdpbf16ps's, in another order.
constexpr int64_t kAmxRows = 16;    // query rows per A tile
constexpr int kAmxBlocks = 4;       // packed blocks per softmax step
constexpr int kMaxDotBlocks = kAmxBlocks;
constexpr int64_t kAmxKeys = kAmxBlocks * kDotKeys;
static_assert(kDotRows % kAmxRows == 0, "a tile's rows are whole A tiles (the scratch holds them)");
std::atomic<bool> dot_amx_on{true};  // set_prefill_bf16_amx: off keeps vdpbf16ps (an A/B for benchmarks)
#else
constexpr int kMaxDotBlocks = 1;  // blocks per softmax step on vdpbf16ps
constexpr int64_t kAmxKeys = kDotKeys;
#endif

// Per thread, allocated once, for tiles of up to kDotRows rows. Where the tiles are used it loads their
// configuration for this thread and releases them when the thread's work is done.
struct DotScratch {
  std::vector<uint16_t> qb, pb;  // the tile's queries [rows, D] and the step's weights [rows, kAmxKeys], bf16
  std::vector<float> acc, m, l, sc;  // sc: scores [rows, kAmxKeys]
  std::vector<const float*> qrow;
  std::vector<int64_t> rlo, rhi;
  bool amx = false;
  explicit DotScratch(int64_t D)
      : qb(kDotRows * D), pb(kDotRows * kAmxKeys), acc(kDotRows * D), m(kDotRows), l(kDotRows),
        sc(kDotRows * kAmxKeys), qrow(kDotRows), rlo(kDotRows), rhi(kDotRows) {
#ifdef TOKENOPS_PA_AMX
    amx = dot_amx_on.load(std::memory_order_relaxed) && tokenops::amx_ready();
    if (amx) {  // every tile 16 rows x 64 bytes (their roles: amx_scores, amx_values)
      tokenops::TileConfig c;
      for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
      tokenops::load_tile_config(c);
    }
#endif
  }
  ~DotScratch() {
#ifdef TOKENOPS_PA_AMX
    if (amx) _tile_release();
#endif
  }
  DotScratch(const DotScratch&) = delete;
  DotScratch& operator=(const DotScratch&) = delete;
};

// The query rows of an item as bf16 (rounded to nearest even) into qb, row stride D
inline void queries_bf16(const float* const* qrow, int64_t R, int64_t D, uint16_t* qb) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qrow[r] + d + 16), _mm512_loadu_ps(qrow[r] + d));
      _mm512_storeu_si512(qb + r * D + d, reinterpret_cast<const __m512i&>(h));
    }
}

#ifdef TOKENOPS_PA_AMX
// Tiles: tmm0 / 1 scores of keys 0-15 / 16-31 (then values' B), tmm2 queries (then weights' A with
// tmm3..5), tmm3 / 4 keys' B, tmm6 values' B, tmm7 accumulators.
// sc[r][0..kDotKeys) = q_r . k_t for the 16 bf16 query rows at qb (row stride D) and one packed key
// block, sc's row stride kAmxKeys
inline void amx_scores(const uint16_t* qb, int64_t D, const uint32_t* kp, float* sc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(2, qb + 32 * c, D * 2);
    _tile_loadd(3, kp + 16 * c * kDotKeys, kDotKeys * 4);
    _tile_loadd(4, kp + 16 * c * kDotKeys + 16, kDotKeys * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sc, kAmxKeys * 4);
  _tile_stored(1, sc + 16, kAmxKeys * 4);
}

// acc[r][0..D) += sum_t p[r][t] v_t for the 16 rows of bf16 weights at pb (row stride kAmxKeys) over
// NB consecutive packed value blocks from vp (`words` apart); acc's row stride D. The tile register
// numbers are part of the instructions, so each block's are spelled out.
template <int NB>
inline void amx_values(const uint16_t* pb, const uint32_t* vp, int64_t words, int64_t D, float* acc) {
  _tile_loadd(2, pb, kAmxKeys * 2);
  if constexpr (NB > 1) _tile_loadd(3, pb + kDotKeys, kAmxKeys * 2);
  if constexpr (NB > 2) _tile_loadd(4, pb + 2 * kDotKeys, kAmxKeys * 2);
  if constexpr (NB > 3) _tile_loadd(5, pb + 3 * kDotKeys, kAmxKeys * 2);
  for (int64_t c = 0; c < D / 16; ++c) {
    _tile_loadd(7, acc + 16 * c, D * 4);
    _tile_loadd(0, vp + 16 * c, D * 4);
    _tile_dpbf16ps(7, 2, 0);
    if constexpr (NB > 1) {
      _tile_loadd(1, vp + words + 16 * c, D * 4);
      _tile_dpbf16ps(7, 3, 1);
    }
    if constexpr (NB > 2) {
      _tile_loadd(6, vp + 2 * words + 16 * c, D * 4);
      _tile_dpbf16ps(7, 4, 6);
    }
    if constexpr (NB > 3) {
      _tile_loadd(0, vp + 3 * words + 16 * c, D * 4);
      _tile_dpbf16ps(7, 5, 0);
    }
    _tile_stored(7, acc + 16 * c, D * 4);
  }
}
static_assert(kAmxBlocks == 4, "amx_values spells out up to four blocks");

#endif

// One row's online-softmax step over the 16 * nvec scores at sc (keys k0 ..), of which [a, e) are visible
// (a < e): the running max m, sum l and accumulator acc (D floats) updated, the weights of all nvec
// vectors written to pr in bf16 (the invisible ones zero)
inline void dot_softmax_row(const float* sc, int nvec, int64_t a, int64_t e, __m512 scale, float& m, float& l,
                            float* acc, int64_t D, uint16_t* pr) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 x[2 * kMaxDotBlocks];
  __mmask16 vis[2 * kMaxDotBlocks];
  __m512 top = ninf;
  for (int v = 0; v < nvec; ++v) {
    const int64_t lo = std::clamp<int64_t>(a - 16 * v, 0, 16), hi = std::clamp<int64_t>(e - 16 * v, 0, 16);
    vis[v] = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    x[v] = _mm512_mul_ps(_mm512_loadu_ps(sc + 16 * v), scale);
    top = _mm512_max_ps(top, _mm512_mask_mov_ps(ninf, vis[v], x[v]));
  }
  const float mt = std::max(m, _mm512_reduce_max_ps(top));
  const __m512 mv = _mm512_set1_ps(mt);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < nvec; ++v) {
    x[v] = _mm512_maskz_mov_ps(vis[v], exp_nonpos(_mm512_sub_ps(x[v], mv)));
    sum = _mm512_add_ps(sum, x[v]);
  }
  if (mt > m) {  // the running max moved: rescale what was accumulated under the old one
    const float corr = m == kNegInf ? 0.f : std::exp(m - mt);
    l *= corr;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
    m = mt;
  }
  l += _mm512_reduce_add_ps(sum);
  for (int v = 0; v < nvec; v += 2) {
    const __m512bh pw = _mm512_cvtne2ps_pbh(x[v + 1], x[v]);
    _mm512_storeu_si512(pr + 16 * v, reinterpret_cast<const __m512i&>(pw));
  }
}

// One item (a tile's key chunk of one kv head) on the packed blocks: the exact path's steps (scores,
// online softmax, value pass, then the output or the chunk's partial state) in bf16 dot products,
// a block per step with vdpbf16ps; on AMX's tiles kAmxBlocks blocks per step, rows past R up to a
// whole A tile (the scratch holds them) computed and never read.
void attend_dot(const Problem& p, const Item& it, DotScratch& w) {
  const int64_t D = p.d;
  const float** qrow = w.qrow.data();
  int64_t* rlo = w.rlo.data();
  int64_t* rhi = w.rhi.data();
  const int64_t R = item_rows(p, it, qrow, rlo, rhi);
  uint16_t* qb = w.qb.data();
  uint16_t* pb = w.pb.data();
  float* acc = w.acc.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* sc = w.sc.data();
  queries_bf16(qrow, R, D, qb);
  std::fill(acc, acc + R * D, 0.f);
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R, 0.f);
  const int64_t s = it.s, base = p.pack_base[s], words = kDotKeys / 2 * D;  // a block's words
  const uint32_t* kpack = p.kpack + (p.pack_first[s] + it.g * p.pack_blocks[s]) * words;
  const uint32_t* vpack = p.vpack + (p.pack_first[s] + it.g * p.pack_blocks[s]) * words;
  const __m512 scale = _mm512_set1_ps(p.scale);
  // blocks per step, and the row stride of the scores and weights
  const int step = w.amx ? kMaxDotBlocks : 1;
  const int64_t stride = w.amx ? kAmxKeys : kDotKeys;
  const int64_t end_blk = (it.hi - base + kDotKeys - 1) / kDotKeys;  // past the item's last block
  for (int64_t blk = (it.lo - base) / kDotKeys; blk < end_blk; blk += step) {
    const int nb = static_cast<int>(std::min<int64_t>(step, end_blk - blk));
    const int64_t k0 = base + blk * kDotKeys, nk = nb * kDotKeys;
    const uint32_t* kp = kpack + blk * words;
    const uint32_t* vp = vpack + blk * words;
#ifdef TOKENOPS_PA_AMX
    if (w.amx) {
      for (int j = 0; j < nb; ++j)
        for (int64_t r0 = 0; r0 < R; r0 += kAmxRows)
          amx_scores(qb + r0 * D, D, kp + j * words, sc + r0 * stride + j * kDotKeys);
    } else
#endif
      for (int64_t r0 = 0; r0 < R; r0 += kDotScoreRows)
        dot_scores_n<kDotScoreRows>(std::min<int64_t>(kDotScoreRows, R - r0), qb + r0 * D, D, kp, sc + r0 * stride);
    for (int64_t r = 0; r < R; ++r) {
      // the keys of these blocks the row sees, within the item's chunk
      const int64_t a = std::max<int64_t>(std::max(rlo[r], it.lo) - k0, 0);
      const int64_t e = std::min<int64_t>(std::min(rhi[r] + 1, it.hi) - k0, nk);
      uint16_t* pr = pb + r * stride;
      if (a >= e) {
        for (int j = 0; j < nb; ++j) _mm512_storeu_si512(pr + j * kDotKeys, _mm512_setzero_si512());
        continue;
      }
      dot_softmax_row(sc + r * stride, 2 * nb, a, e, scale, m[r], l[r], acc + r * D, D, pr);
    }
#ifdef TOKENOPS_PA_AMX
    if (w.amx) {
      for (int64_t r0 = 0; r0 < R; r0 += kAmxRows) {
        switch (nb) {
          case 1: amx_values<1>(pb + r0 * kAmxKeys, vp, words, D, acc + r0 * D); break;
          case 2: amx_values<2>(pb + r0 * kAmxKeys, vp, words, D, acc + r0 * D); break;
          case 3: amx_values<3>(pb + r0 * kAmxKeys, vp, words, D, acc + r0 * D); break;
          default: amx_values<4>(pb + r0 * kAmxKeys, vp, words, D, acc + r0 * D); break;
        }
      }
      continue;
    }
#endif
    for (int64_t r0 = 0; r0 < R; r0 += kDotValueRows)
      for (int64_t c0 = 0; c0 < D; c0 += kDotValueCols)
        dot_values_n<kDotValueRows>(std::min<int64_t>(kDotValueRows, R - r0), pb + r0 * kDotKeys, vp, D, c0,
                                    acc + r0 * D);
  }
  finish_rows(p, it, qrow, R, D, m, l, acc);
}
#else
struct DotScratch {
  explicit DotScratch(int64_t) {}
};
#endif

// Whether a sequence's chunk of n queries takes the bf16 dot-product path: a bf16 cache, a build with
// AVX512-BF16, head_dim a multiple of the value pass's 64 columns (at most 256), a group that fits a tile
inline bool dot_chunk(at::ScalarType t, int64_t n, int64_t D, int64_t G) {
#ifdef TOKENOPS_PA_BF16_DOT
  return t == at::kBFloat16 && n >= kDotMinTokens && D % kDotValueCols == 0 && D <= 256 && G <= kDotRows;
#else
  (void)t, (void)n, (void)D, (void)G;
  return false;
#endif
}

// A unit of work (one tile chunk over its kv heads, items[0 .. n)): few-row tiles over a half or int8
// cache take attend_few_rows, all heads in one pass; dot items attend_dot; the others go item by item.
template <typename T, int64_t kD>
void attend_unit(const Problem& p, const T* k_cache, const T* v_cache, const Item* items, int64_t n, Scratch& w,
                 DotScratch* dw) {
#ifdef TOKENOPS_PA_BF16_DOT
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (items[0].dot) {
      for (int64_t i = 0; i < n; ++i) attend_dot(p, items[i], *dw);
      return;
    }
  }
#else
  (void)dw;
#endif
#if defined(__AVX512F__) || defined(TOKENOPS_PA_AVX2)
  const int64_t R = items[0].nt * p.group;
  // over a float32 cache only tiles of several tokens (prefill): a decode token's general path reads
  // its keys from memory faster (paged_decode_attention.py --step)
  const bool few_tile = !std::is_same_v<T, float> || items[0].nt > 1;
  if (few_tile && few_rows_unit(R, n, static_cast<int64_t>(w.qrow.size()))) {
    for (int64_t i = 0; i < n; ++i) item_rows(p, items[i], w.qrow.data() + i * R, w.rlo.data() + i * R, w.rhi.data() + i * R);
    if (few_rows<T, kD>(R, p, k_cache, v_cache, items, n, w, w.qrow.data(), w.rlo.data(), w.rhi.data())) return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) attend<T, kD>(p, k_cache, v_cache, items[i], w);
}

// Merge the chunks of one tile's kv head (items chunks[0], chunks[stride], ...):
// out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M), per row.
void merge_chunks(const Problem& p, const Item* chunks, int64_t n, int64_t stride) {
  const int64_t G = p.group, D = p.d, KV = p.kv_heads;
  const Item& it = chunks[0];
  for (int64_t r = 0; r < it.nt * G; ++r) {
    float* o = p.out + ((p.q_start[it.s] + it.t0 + r / G) * KV * G + it.g * G + r % G) * D;
    float mx = kNegInf;
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, p.part_m[chunks[c * stride].part + r]);
    float denom = 0.f;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float mc = p.part_m[chunks[c * stride].part + r];
      if (mc == kNegInf) continue;  // a chunk this row sees no key of
      const float w = std::exp(mc - mx);
      denom += w * p.part_l[chunks[c * stride].part + r];
      const float* a = p.part_acc + (chunks[c * stride].part + r) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] += w * a[i];
    }
    const float inv = 1.f / denom;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

// q [T, H, D]; sequence s owns rows q_start[s] .. q_start[s] + q_len[s], its last query rows of the
// lens[s] kept keys (already written). -> [T, H, D] in q's dtype (rows of no sequence are left unset).
// Whether tiles of at most kFewRows rows take attend_few_rows on this cache (half or int8, AVX-512 or
// AVX2; float32 on AVX2): then prefill chunks are tiled that small too
inline bool few_rows_cache(at::ScalarType t) {
#if defined(__AVX512F__) || defined(TOKENOPS_PA_AVX2)
  return t == at::kBFloat16 || t == at::kHalf || t == at::kChar || (kFewRowsFloat && t == at::kFloat);
#else
  (void)t;
  return false;
#endif
}

at::Tensor paged_attention_impl(const char* name, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale, const at::Tensor& block_tables,
                                const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& lens,
                                const std::optional<at::Tensor>& gaps, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), name,
              ": q must be [T, H, D] and the caches [blocks, block_size, KV, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              name, ": caches must be contiguous and of one dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KV > 0 && H % KV == 0, name, ": head_dim or head counts do not match");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf || kv_type == at::kChar,
              name, ": caches must be float32, bfloat16, float16 or int8, not ", kv_type);
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), name, ": int8 caches need scales");
  if (int8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->numel() == k_cache.numel() / D && v_scale->numel() == k_scale->numel(),
                name, ": scales must be contiguous float16, one per (slot, kv head)");
  }
  const int64_t S = block_tables.dim() == 2 ? block_tables.size(0) : -1;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && S >= 0 && lens.scalar_type() == at::kLong &&
                  lens.numel() == S && q_start.scalar_type() == at::kLong && q_start.numel() == S &&
                  q_len.scalar_type() == at::kLong && q_len.numel() == S,
              name, ": block_tables [S, W], lens, query starts and lengths [S] must be int64");
  at::Tensor tables = block_tables.contiguous(), lens_c = lens.contiguous();
  at::Tensor qs_c = q_start.contiguous(), ql_c = q_len.contiguous(), gaps_c;
  if (gaps) {
    TORCH_CHECK(gaps->scalar_type() == at::kLong && gaps->numel() == 2 * S, name, ": gaps must be int64 [S, 2]");
    gaps_c = gaps->contiguous();
    TORCH_CHECK(gaps_c.min().item<int64_t>() >= 0, name, ": gap starts and lengths must be >= 0");
  }
  const int64_t W = tables.size(1), num_blocks = k_cache.size(0), G = H / KV;
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens_c.data_ptr<int64_t>();
  const int64_t* qs = qs_c.data_ptr<int64_t>();
  const int64_t* ql = ql_c.data_ptr<int64_t>();
  const int64_t* gap = gaps ? gaps_c.data_ptr<int64_t>() : nullptr;

  // tiles of up to kRows query rows, whole tokens (as few as attend_few_rows takes where it takes a
  // unit of them: its cache, head_dim and every kv head's rows in a thread's scratch of max(kRows, G)
  // rows); the keys a tile sees: [first row's window start, last token + 1)
  const bool few = few_rows_cache(kv_type) && few_rows_head_dim(D) &&
                   few_rows_unit((kFewRows / G) * G, KV, std::max(kRows, G));
  const int64_t tile_tokens = few ? kFewRows / G : std::max<int64_t>(1, kRows / G);
#ifdef TOKENOPS_PA_BF16_DOT
  const int64_t dot_tile_tokens = std::max<int64_t>(1, kDotRows / G);
#else
  const int64_t dot_tile_tokens = 1;
#endif
  struct Tile { int64_t s, t0, nt, lo, hi; bool dot; };
  std::vector<Tile> tiles;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = ql[s], L = len[s];
    TORCH_CHECK(n >= 1 && n <= L && qs[s] >= 0 && qs[s] + n <= T, name, ": query rows out of range");
    // sequences own disjoint query rows (threads write them), in the order they are given
    TORCH_CHECK(s == 0 || qs[s] >= qs[s - 1] + ql[s - 1], name, ": query rows of sequences overlap or are out of order");
    TORCH_CHECK((L + bs - 1) / bs <= W, name, ": a length exceeds its block table");
    const int64_t first_block = window_start(L - n, gap ? gap[2 * s] : 0, gap ? gap[2 * s + 1] : 0, window) / bs;
    for (int64_t b = first_block; b < (L + bs - 1) / bs; ++b) {
      TORCH_CHECK(tab[s * W + b] >= 0 && tab[s * W + b] < num_blocks, name, ": block id out of range");
    }
    const bool dot = dot_chunk(kv_type, n, D, G);
    const int64_t tokens = dot ? dot_tile_tokens : tile_tokens;
    for (int64_t t0 = 0; t0 < n; t0 += tokens) {
      const int64_t nt = std::min(tokens, n - t0);
      const int64_t lo = window_start(L - n + t0, gap ? gap[2 * s] : 0, gap ? gap[2 * s + 1] : 0, window);
      const int64_t hi = L - n + t0 + nt;
      tiles.push_back({s, t0, nt, lo, hi, dot});
      work += (hi - lo) * nt * H;
    }
  }
  // split a tile's keys into as many chunks as keep the threads busy (two units each, a unit being a
  // tile's chunk over every kv head), at least kMinChunk keys each
  const int64_t threads = at::get_num_threads();
  const int64_t base = static_cast<int64_t>(tiles.size());
  const int64_t want = work < kMinSplit || threads <= 1 ? 1 : std::max<int64_t>(1, (2 * threads + base - 1) / std::max<int64_t>(base, 1));
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first item, chunks) per split tile
  int64_t part_rows = 0;
  for (const Tile& tl : tiles) {
    const int64_t chunks = std::clamp<int64_t>((tl.hi - tl.lo) / kMinChunk, 1, want);
    // chunk by chunk, each over every kv head (the threads' units, below); a head's chunks lie KV apart
    if (chunks > 1)
      for (int64_t g = 0; g < KV; ++g) merges.emplace_back(static_cast<int64_t>(items.size()) + g, chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t a = tl.lo + (tl.hi - tl.lo) * c / chunks, e = tl.lo + (tl.hi - tl.lo) * (c + 1) / chunks;
      for (int64_t g = 0; g < KV; ++g) {
        int64_t part = -1;
        if (chunks > 1) part = part_rows, part_rows += tl.nt * G;
        items.push_back({tl.s, g, tl.t0, tl.nt, a, e, part, tl.dot});
      }
    }
  }

  // float32 queries are read where they lie when each token's heads are contiguous (the q slice of
  // the fused projection's rows): no copy of them per layer
  const bool in_place = q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == D;
  at::Tensor qf = in_place ? q : q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, H, D}, q.options().dtype(at::kFloat));
  std::vector<float> part_m(part_rows), part_l(part_rows), part_acc(part_rows * D);
  Problem p{qf.data_ptr<float>(), out.data_ptr<float>(), tab, qs, ql, len, gap, W, bs, KV, G, D, window,
            static_cast<float>(scale), int8 ? k_scale->data_ptr<at::Half>() : nullptr,
            int8 ? v_scale->data_ptr<at::Half>() : nullptr, part_m.data(), part_l.data(), part_acc.data()};
  p.q_row = T > 1 ? qf.stride(0) : H * D;
#ifdef TOKENOPS_PA_BF16_DOT
  // the dot path's sequences: their kv heads' keys from the first tile's first visible key, packed
  std::vector<int64_t> pack_first(S, 0), pack_base(S, 0), pack_blocks(S, 0), pack_lo(S, 0);
  std::unique_ptr<uint32_t[]> kpack, vpack;
  bool any_dot = false;
  {
    int64_t blocks = 0;
    for (const Tile& tl : tiles) {
      if (!tl.dot || tl.t0 != 0) continue;
      any_dot = true;
      pack_lo[tl.s] = tl.lo;
      pack_base[tl.s] = tl.lo / kDotKeys * kDotKeys;
      pack_blocks[tl.s] = (len[tl.s] - pack_base[tl.s] + kDotKeys - 1) / kDotKeys;
      pack_first[tl.s] = blocks;
      blocks += KV * pack_blocks[tl.s];
    }
    if (any_dot) {
      const int64_t words = kDotKeys / 2 * D;
      kpack.reset(new uint32_t[blocks * words]);
      vpack.reset(new uint32_t[blocks * words]);
      p.kpack = kpack.get(), p.vpack = vpack.get();
      p.pack_first = pack_first.data(), p.pack_base = pack_base.data(), p.pack_blocks = pack_blocks.data();
      std::vector<int64_t> owner(blocks);  // the sequence each packed block belongs to
      for (int64_t s = 0; s < S; ++s)
        for (int64_t b = 0; b < KV * pack_blocks[s]; ++b) owner[pack_first[s] + b] = s;
      const auto* kc = k_cache.data_ptr<at::BFloat16>();
      const auto* vc = v_cache.data_ptr<at::BFloat16>();
      at::parallel_for(0, blocks, work < kMinParallelPack ? blocks : 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t s = owner[b], i = b - pack_first[s], g = i / pack_blocks[s];
          const int64_t k0 = pack_base[s] + (i % pack_blocks[s]) * kDotKeys;
          dot_pack_block(p, kc, vc, s, g, k0, pack_lo[s], len[s], kpack.get() + b * words, vpack.get() + b * words);
        }
      });
    }
  }
#else
  const bool any_dot = false;
#endif
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](auto* kc, auto* vc) {
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    auto fn = D == 64    ? attend_unit<T_, 64>
              : D == 128 ? attend_unit<T_, 128>
              : D == 256 ? attend_unit<T_, 256>
                         : attend_unit<T_, 0>;
    const bool convert = !std::is_same_v<T_, float>;
    const int64_t max_rows = std::max(kRows, G);
    // A unit is one tile's key chunk over every kv head (items g = 0 .. KV-1, pushed one after the
    // other): a slot holds its heads' rows side by side, so one thread reading them all reads whole
    // lines once (the first head's pass brings the others' rows into its L2), where threads taking
    // heads of one slot each would pull the same lines from memory. Longest units first, taken from
    // a shared counter: the threads finish together.
    std::vector<int64_t> units;  // first item of each unit
    for (int64_t i = 0; i < num_items;) {
      units.push_back(i);
      const Item& a = items[i];
      int64_t j = i + 1;
      while (j < num_items && items[j].s == a.s && items[j].t0 == a.t0 && items[j].lo == a.lo && items[j].hi == a.hi) ++j;
      i = j;
    }
    units.push_back(num_items);
    const int64_t num_units = static_cast<int64_t>(units.size()) - 1;
    const int64_t nthreads = std::min(threads, num_units);
    if (work < kMinParallelUnits || nthreads <= 1) {  // small: on the calling thread, no wake-up
      Scratch w(D, max_rows, convert);
      std::optional<DotScratch> dw;
      if (any_dot) dw.emplace(D);
      for (int64_t u = 0; u < num_units; ++u)
        fn(p, kc, vc, items.data() + units[u], units[u + 1] - units[u], w, dw ? &*dw : nullptr);
      return;
    }
    std::vector<int64_t> order(num_units);
    std::iota(order.begin(), order.end(), 0);
    auto size = [&](int64_t u) { return (items[units[u]].hi - items[units[u]].lo) * items[units[u]].nt; };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return size(a) > size(b); });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      Scratch w(D, max_rows, convert);
      std::optional<DotScratch> dw;
      if (any_dot) dw.emplace(D);
      for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
        const int64_t first = units[order[u]];
        fn(p, kc, vc, items.data() + first, units[order[u] + 1] - first, w, dw ? &*dw : nullptr);
      }
    });
  };
  if (int8) {
    run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_SWITCH(kv_type, "paged_attention",
                       AT_DISPATCH_CASE(at::kFloat, [&] { run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>()); })
                       AT_DISPATCH_CASE(at::kBFloat16, [&] { run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>()); })
                       AT_DISPATCH_CASE(at::kHalf, [&] { run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>()); }));
  }
  for (const auto& [first, n] : merges) merge_chunks(p, items.data() + first, n, KV);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& block_tables, const at::Tensor& lens,
                                  const std::optional<at::Tensor>& gaps, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [S, H, D]");
  const at::Tensor starts = at::arange(q.size(0), lens.options().dtype(at::kLong));
  return paged_attention_impl("paged_decode_attention", q, k_cache, v_cache, k_scale, v_scale, block_tables, starts,
                              at::ones_like(starts), lens, gaps, window, scale);
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                   const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
                                   const at::Tensor& lens, const std::optional<at::Tensor>& gaps, int64_t window,
                                   double scale) {
  return paged_attention_impl("paged_prefill_attention", q, k_cache, v_cache, k_scale, v_scale, block_tables, q_start,
                              q_len, lens, gaps, window, scale);
}

// Whether this build has the bf16 dot-product path for long prefill chunks over a bf16 cache
bool prefill_bf16_dot() {
#ifdef TOKENOPS_PA_BF16_DOT
  return true;
#else
  return false;
#endif
}

// Whether the bf16 dot path multiplies on AMX's tiles: built with AMX-BF16, granted the tile state by
// the kernel, and not switched off
bool prefill_bf16_amx() {
#ifdef TOKENOPS_PA_AMX
  return dot_amx_on.load() && tokenops::amx_ready();
#else
  return false;
#endif
}

// Switches the dot path's tiles on or off where they are built (an A/B for benchmarks and tests);
// returns the previous setting
bool set_prefill_bf16_amx(bool on) {
#ifdef TOKENOPS_PA_AMX
  return dot_amx_on.exchange(on);
#else
  (void)on;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("prefill_bf16_dot() -> bool");
  m.impl("prefill_bf16_dot", c10::DispatchKey::CatchAll, TORCH_FN(prefill_bf16_dot));
  m.def("prefill_bf16_amx() -> bool");
  m.impl("prefill_bf16_amx", c10::DispatchKey::CatchAll, TORCH_FN(prefill_bf16_amx));
  m.def("set_prefill_bf16_amx(bool on) -> bool");
  m.impl("set_prefill_bf16_amx", c10::DispatchKey::CatchAll, TORCH_FN(set_prefill_bf16_amx));
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor lens, Tensor? gaps, int window, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor q_start, Tensor q_len, Tensor lens, Tensor? gaps, int window, float scale) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
}
