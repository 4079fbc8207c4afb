#pragma once

// Q4 and Q8 on AMX's int8 tiles. Included by linear_blocks.cpp inside its anonymous namespace, after
// the tiles it reads (Tiles, Tiles8, QuantisedRows, quantise_rows, load_params2, add_q4_block); a header
// so that the block kernels stay one translation unit (the build compiles csrc/*.cpp and hashes
// csrc/*.h with them).
//
// Where the CPU has AMX-INT8, calls of at least `amx_min_rows` rows take the tiles through one tile
// multiply per pair of 8-row tiles and block of 32 inputs: the exact integer sums of 16 activation
// rows x 16 weight rows, the same sums tile_pair_dot adds with vpdpbusd, and the same FMAs per block
// and row follow (`add_q4_block`; Q8's one), so the outputs are the same bits. A (int8 activations,
// 16 rows x 32 bytes) is read in place from the quantised rows; B (8 rows x 64 bytes: row j holds
// inputs 4j..4j+3 of the 16 weight rows) is a tile pair's codes rearranged: for Q4 (TDPBSUD,
// unsigned codes) chunk c's low nibbles are B's row c, its high nibbles row 4 + c; for Q8 (TDPBSSD,
// signed codes) row c is chunk c of the first tile then of the second. Each pair's B tiles are made
// once per call in a per-thread buffer and serve every group of 16 activation rows.

// calls of fewer rows keep the vpdpbusd tiles (a setting without effect where AMX-INT8 is not built;
// set_blocks_amx_min_rows)
std::atomic<int64_t> amx_min_rows{16};

#if defined(TOKENOPS_BLOCKS_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TOKENOPS_BLOCKS_AMX 1

using tokenops::amx_ready;
using tokenops::TileConfig;

constexpr int64_t kAmxRows = 16;     // activation rows per A tile
constexpr int64_t kAmxBBytes = 512;  // one block's B tile: 8 rows x 64 bytes

// tmm0..3: C, 16 x 16 int32; tmm4 and 6: A, 16 x 32 int8; tmm5 and 7: B, 8 x 64 uint8
inline void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  for (int i : {4, 6}) c.colsb[i] = 32, c.rows[i] = 16, c.colsb[i + 1] = 64, c.rows[i + 1] = 8;
  tokenops::load_tile_config(c);
}

// Q4 tiles t and t + 1 (t + 1 absent: zero codes) unpacked into B tiles, one per block
inline void unpack_pair(const uint8_t* p0, const uint8_t* p1, int64_t blocks, uint8_t* b_tiles) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, p0 += kTileBlockBytes, p1 += p1 ? kTileBlockBytes : 0) {
    uint8_t* out = b_tiles + b * kAmxBBytes;
    for (int c = 0; c < 4; ++c) {
      const __m256i second = p1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c))
                                : _mm256_setzero_si256();
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c))), second, 1);
      _mm512_store_si512(out + 64 * c, _mm512_and_si512(v, low));
      _mm512_store_si512(out + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

// Q8 tiles t and t + 1 (t + 1 absent: zero codes) interleaved into B tiles, one per block
inline void interleave_pair(const int8_t* p0, const int8_t* p1, int64_t blocks, uint8_t* b_tiles) {
  for (int64_t b = 0; b < blocks; ++b, p0 += kTile8BlockBytes, p1 += p1 ? kTile8BlockBytes : 0) {
    uint8_t* out = b_tiles + b * kAmxBBytes;
    for (int c = 0; c < 8; ++c) {
      const __m256i second = p1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c))
                                : _mm256_setzero_si256();
      _mm512_store_si512(out + 64 * c, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                                                               reinterpret_cast<const __m256i*>(p0 + 32 * c))),
                                                           second, 1));
    }
  }
}

// a pair's B tiles, per format
template <class P>
inline void pair_b_tiles(const Tiles<P>& w, int64_t t, bool second, uint8_t* b_tiles) {
  const uint8_t* p0 = w.codes + t * w.blocks * kTileBlockBytes;
  unpack_pair(p0, second ? p0 + w.blocks * kTileBlockBytes : nullptr, w.blocks, b_tiles);
}
inline void pair_b_tiles(const Tiles8& w, int64_t t, bool second, uint8_t* b_tiles) {
  const int8_t* p0 = w.codes + t * w.blocks * kTile8BlockBytes;
  interleave_pair(p0, second ? p0 + w.blocks * kTile8BlockBytes : nullptr, w.blocks, b_tiles);
}

// block b's tile product into C tile b % 4 (tmm0..3), from A and B tiles b % 2 (tmm4 / 5, tmm6 / 7);
// GCC's tile intrinsics paste their register numbers into the assembly, so each is spelled out
// (Q4's codes are unsigned: TDPBSUD; Q8's signed: TDPBSSD)
#define TOKENOPS_AMX_BLOCK(C, A, B)                                 \
  _tile_zero(C);                                                    \
  _tile_loadd(A, q + b * kBlock, blocks * kBlock);                  \
  _tile_loadd(B, b_tiles + b * kAmxBBytes, 64);                     \
  if constexpr (Signed) _tile_dpbssd(C, A, B);                      \
  else _tile_dpbsud(C, A, B);                                       \
  break
template <bool Signed>
inline void amx_issue(const int8_t* q, int64_t blocks, const uint8_t* b_tiles, int64_t b) {
  switch (b & 3) {
    case 0: TOKENOPS_AMX_BLOCK(0, 4, 5);
    case 1: TOKENOPS_AMX_BLOCK(1, 6, 7);
    case 2: TOKENOPS_AMX_BLOCK(2, 4, 5);
    default: TOKENOPS_AMX_BLOCK(3, 6, 7);
  }
}
#undef TOKENOPS_AMX_BLOCK
inline void amx_store(int64_t b, int32_t* sums) {
  switch (b & 3) {
    case 0: _tile_stored(0, sums, 64); break;
    case 1: _tile_stored(1, sums, 64); break;
    case 2: _tile_stored(2, sums, 64); break;
    default: _tile_stored(3, sums, 64); break;
  }
}

// A block's scaling per format, on the 16 rows' sums s (the pair's 16 outputs per row): Q4's two
// FMAs (add_q4_block), Q8's one, as tile_pair_dot does them
template <class P>
struct AmxScale {
  const P *d0, *m0, *d1, *m1;
  int gshift;
  AmxScale(const Tiles<P>& w, int64_t t, bool second)
      : d0(w.d + t * w.groups * kTile), m0(w.m + t * w.groups * kTile),
        d1(second ? d0 + w.groups * kTile : d0),  // an absent tile's lanes: zero sums, discarded
        m1(second ? m0 + w.groups * kTile : m0), gshift(w.gshift) {}
  void operator()(__m512* acc, const int32_t* s, const QuantisedRows& a, int64_t r0, int64_t blocks, int64_t b) const {
    const int64_t g = b >> gshift;
    const __m512 dv = load_params2(d0 + g * kTile, d1 + g * kTile);
    const __m512 mv = load_params2(m0 + g * kTile, m1 + g * kTile);
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
      acc[r] = add_q4_block(acc[r], _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * r)), dv, mv, a.d[ab], a.s[ab]);
    }
  }
};
struct AmxScale8 {
  const float *d0, *d1;
  AmxScale8(const Tiles8& w, int64_t t, bool second)
      : d0(w.d + t * w.blocks * kTile), d1(second ? d0 + w.blocks * kTile : d0) {}
  void operator()(__m512* acc, const int32_t* s, const QuantisedRows& a, int64_t r0, int64_t blocks, int64_t b) const {
    const __m512 dv = load_params2(d0 + b * kTile, d1 + b * kTile);
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r) {
      const __m512 dx = _mm512_set1_ps(a.d[(r0 + r) * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * r)), _mm512_mul_ps(dv, dx), acc[r]);
    }
  }
};
template <class P>
inline AmxScale<P> amx_scale(const Tiles<P>& w, int64_t t, bool second) { return {w, t, second}; }
inline AmxScale8 amx_scale(const Tiles8& w, int64_t t, bool second) { return {w, t, second}; }
template <class W>
constexpr bool kSignedCodes = std::is_same_v<W, Tiles8>;

// `next`: the following pair's codes (or null), requested a block's worth per block so that their
// unpacking finds them in cache
template <class W>
TILE_KERNEL void amx_pair_dot(const W& w, int64_t t, bool second, const uint8_t* b_tiles,
                              const QuantisedRows& a, int64_t r0, const uint8_t* next, float* out) {
  const int64_t blocks = w.blocks;
  const auto scaling = amx_scale(w, t, second);
  alignas(64) int32_t sums[2][kAmxRows * 16];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* q = a.q.data() + r0 * blocks * kBlock;
  auto scale = [&](int64_t b) {
    if (next)  // the next pair's two tiles lie one after the other: two tiles' block bytes per block
      for (int64_t l = 0; l < 2 * W::kBlockBytes / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + b * 2 * W::kBlockBytes + 64 * l), _MM_HINT_T0);
    scaling(acc, sums[b & 1], a, r0, blocks, b);
  };
  // products run three blocks ahead of the scaling; block b's sums are read back one block after
  // they are stored
  for (int64_t b = 0; b < std::min<int64_t>(blocks, 3); ++b) amx_issue<kSignedCodes<W>>(q, blocks, b_tiles, b);
  for (int64_t b = 0; b < blocks; ++b) {
    amx_store(b, sums[b & 1]);
    if (b + 3 < blocks) amx_issue<kSignedCodes<W>>(q, blocks, b_tiles, b + 3);
    if (b > 0) scale(b - 1);
  }
  scale(blocks - 1);
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
}

// Calls of more than kAmxChunkMinRows rows make the B tiles of kAmxChunkPairs pairs before running
// them over every group of 16 rows, so a group's stores go to the chunk's columns of 16 output rows
// at a time rather than one column of every row. Where an output row is a multiple of 4 KB (a
// 49,152-token vocabulary) a column's lines in every row fall in one cache set, and 64 rows' stores
// per pair evicted the tiles' own working set; at 16-48 rows one pair at a time is the faster (its B
// tiles stay in L1), and with rows of other lengths the two are level (docs/benchmarks.md,
// linear_small_rows.py's Xeon AMX section)
constexpr int64_t kAmxChunkPairs = 8;
constexpr int64_t kAmxChunkMinRows = 3 * kAmxRows;

template <class W>
void run_tiles_amx(const at::Tensor& x, const W& w, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t k = x.size(-1), out_f = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  const int64_t padded = (n + kAmxRows - 1) / kAmxRows * kAmxRows;
  const QuantisedRows& a = quantise_rows(x.data_ptr<float>(), n, k, w.blocks, padded);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (out_f + kTile - 1) / kTile, pairs = (tiles + 1) / 2;
  const int64_t pair_bytes = w.blocks * kAmxBBytes;
  const int64_t chunk = n > kAmxChunkMinRows ? kAmxChunkPairs : 1;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> held;  // this thread's B tiles, 64-byte aligned within
    held.resize(static_cast<size_t>(chunk * pair_bytes + 64));
    uint8_t* b_tiles = held.data() + (64 - reinterpret_cast<uintptr_t>(held.data()) % 64) % 64;
    alignas(64) float dots[kAmxRows * 16];
    amx_configure();
    for (int64_t u0 = begin; u0 < end; u0 += chunk) {
      const int64_t u1 = std::min(end, u0 + chunk);
      for (int64_t u = u0; u < u1; ++u) pair_b_tiles(w, 2 * u, 2 * u + 1 < tiles, b_tiles + (u - u0) * pair_bytes);
      for (int64_t r0 = 0; r0 < n; r0 += kAmxRows) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t t = 2 * u, o = t * kTile, width = std::min<int64_t>(2 * kTile, out_f - o);
          // the first group's pass requests the codes of the pair a chunk on, which this thread makes next
          const bool ahead = r0 == 0 && u + chunk < end;
          const uint8_t* next =
              ahead ? reinterpret_cast<const uint8_t*>(w.codes) + (t + 2 * chunk) * w.blocks * W::kBlockBytes : nullptr;
          amx_pair_dot(w, t, t + 1 < tiles, b_tiles + (u - u0) * pair_bytes, a, r0, next, dots);
          const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1u);
          const __m512 bv = bp ? _mm512_maskz_loadu_ps(lanes, bp + o) : _mm512_setzero_ps();
          for (int64_t r = 0; r < std::min(kAmxRows, n - r0); ++r)
            _mm512_mask_storeu_ps(yp + (r0 + r) * out_f + o, lanes, _mm512_add_ps(_mm512_load_ps(dots + 16 * r), bv));
        }
      }
    }
    _tile_release();
  });
}

// act(gate) * up over a gated MLP's gate|up tiles in one pass on the tiles (the gate half whole pairs):
// pair u of each half makes its B tiles, both run over each group of 16 rows, and the group's outputs
// are act(g + 0) * (u + 0) in 16 lanes, what silu_mul computes on linear_q4's outputs (the bias-free
// `+ 0` of their store): the same bits, without the [rows, 2I] projection stored and read back
template <class Act, class P>
void run_tiles_amx_gated(const at::Tensor& x, const Tiles<P>& w, at::Tensor& y) {
  const int64_t k = x.size(-1), width = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  if (n == 0 || width == 0) return;
  const int64_t padded = (n + kAmxRows - 1) / kAmxRows * kAmxRows;
  const QuantisedRows& a = quantise_rows(x.data_ptr<float>(), n, k, w.blocks, padded);
  float* yp = y.data_ptr<float>();
  const int64_t half = width / kTile, pairs = half / 2;
  const int64_t pair_bytes = w.blocks * kAmxBBytes, code_bytes = w.blocks * kTileBlockBytes;
  const int64_t chunk = n > kAmxChunkMinRows ? kAmxChunkPairs : 1;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> held;  // this thread's B tiles: the chunk's gate pairs, then up pairs
    held.resize(static_cast<size_t>(2 * chunk * pair_bytes + 64));
    uint8_t* gate_tiles = held.data() + (64 - reinterpret_cast<uintptr_t>(held.data()) % 64) % 64;
    uint8_t* up_tiles = gate_tiles + chunk * pair_bytes;
    alignas(64) float g[kAmxRows * 16], u[kAmxRows * 16];
    const __m512 zero = _mm512_setzero_ps();
    amx_configure();
    for (int64_t u0 = begin; u0 < end; u0 += chunk) {
      const int64_t u1 = std::min(end, u0 + chunk);
      for (int64_t v = u0; v < u1; ++v) {
        pair_b_tiles(w, 2 * v, true, gate_tiles + (v - u0) * pair_bytes);
        pair_b_tiles(w, half + 2 * v, true, up_tiles + (v - u0) * pair_bytes);
      }
      for (int64_t r0 = 0; r0 < n; r0 += kAmxRows) {
        for (int64_t v = u0; v < u1; ++v) {
          const int64_t t = 2 * v;
          const bool ahead = r0 == 0 && v + chunk < end;  // the codes this thread unpacks next, as run_tiles_amx
          amx_pair_dot(w, t, true, gate_tiles + (v - u0) * pair_bytes, a, r0,
                       ahead ? w.codes + (t + 2 * chunk) * code_bytes : nullptr, g);
          amx_pair_dot(w, half + t, true, up_tiles + (v - u0) * pair_bytes, a, r0,
                       ahead ? w.codes + (half + t + 2 * chunk) * code_bytes : nullptr, u);
          for (int64_t r = 0; r < std::min(kAmxRows, n - r0); ++r) {
            const __m512 act = Act::apply(_mm512_add_ps(_mm512_load_ps(g + 16 * r), zero));
            _mm512_storeu_ps(yp + (r0 + r) * width + t * kTile,
                             _mm512_mul_ps(act, _mm512_add_ps(_mm512_load_ps(u + 16 * r), zero)));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif
