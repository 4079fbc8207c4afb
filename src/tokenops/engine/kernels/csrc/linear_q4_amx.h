#pragma once

// Q4 on AMX's int8 tiles. Included by linear_blocks.cpp inside its anonymous namespace, after the
// Q4 tiles it reads (Tiles, QuantisedRows, quantise_rows, load_params2, add_q4_block); a header so
// that the block kernels stay one translation unit (the build compiles csrc/*.cpp and hashes
// csrc/*.h with them).
//
// Where the CPU has AMX-INT8, calls of at least `amx_min_rows` rows take the Q4 tiles through
// TDPBSUD: per pair of 8-row tiles and block of 32 inputs, one tile multiply gives the exact integer sums
// sum code * q of 16 activation rows x 16 weight rows, the same sums tile_pair_dot adds with vpdpbusd,
// and the same two FMAs per block and row follow (`add_q4_block`), so the outputs are the same bits.
// A (int8 activations, 16 rows x 32 bytes) is read in place from the quantised rows; B (the codes,
// unsigned, 8 rows x 64 bytes: row j holds inputs 4j..4j+3 of the 16 weight rows) is exactly a tile
// pair's chunk c unpacked: low nibbles are B's row c, high nibbles row 4 + c. Each pair's codes are
// unpacked once per call into a per-thread buffer and serve every group of 16 activation rows.

// calls of fewer rows keep the vpdpbusd tiles (a setting without effect where AMX-INT8 is not built)
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

// tiles t and t + 1 (t + 1 absent: zero codes) unpacked into B tiles, one per block
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

// block b's tile product into C tile b % 4 (tmm0..3), from A and B tiles b % 2 (tmm4 / 5, tmm6 / 7);
// GCC's tile intrinsics paste their register numbers into the assembly, so each is spelled out
#define TOKENOPS_AMX_BLOCK(C, A, B)                                 \
  _tile_zero(C);                                                    \
  _tile_loadd(A, q + b * kBlock, blocks * kBlock);                  \
  _tile_loadd(B, b_tiles + b * kAmxBBytes, 64);                     \
  _tile_dpbsud(C, A, B);                                            \
  break
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

// `next`: the following pair's codes (or null), requested a block's worth per block so that their
// unpacking finds them in cache
template <class P>
TILE_KERNEL void amx_pair_dot(const Tiles<P>& w, int64_t t, bool second, const uint8_t* b_tiles,
                              const QuantisedRows& a, int64_t r0, const uint8_t* next, float* out) {
  const int64_t blocks = w.blocks;
  const P* d0 = w.d + t * w.groups * kTile;
  const P* m0 = w.m + t * w.groups * kTile;
  const P* d1 = second ? d0 + w.groups * kTile : d0;  // an absent tile's lanes: zero sums, discarded
  const P* m1 = second ? m0 + w.groups * kTile : m0;
  alignas(64) int32_t sums[2][kAmxRows * 16];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* q = a.q.data() + r0 * blocks * kBlock;
  auto scale = [&](int64_t b) {
    if (next)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + b * 256 + 64 * l), _MM_HINT_T0);
    const int32_t* s = sums[b & 1];
    const int64_t g = b >> w.gshift;
    const __m512 dv = load_params2(d0 + g * kTile, d1 + g * kTile);
    const __m512 mv = load_params2(m0 + g * kTile, m1 + g * kTile);
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r) {
      const int64_t ab = (r0 + r) * blocks + b;
      acc[r] = add_q4_block(acc[r], _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * r)), dv, mv, a.d[ab], a.s[ab]);
    }
  };
  // products run three blocks ahead of the scaling; block b's sums are read back one block after
  // they are stored
  for (int64_t b = 0; b < std::min<int64_t>(blocks, 3); ++b) amx_issue(q, blocks, b_tiles, b);
  for (int64_t b = 0; b < blocks; ++b) {
    amx_store(b, sums[b & 1]);
    if (b + 3 < blocks) amx_issue(q, blocks, b_tiles, b + 3);
    if (b > 0) scale(b - 1);
  }
  scale(blocks - 1);
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
}

template <class P>
void run_tiles_amx(const at::Tensor& x, const Tiles<P>& w, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t k = x.size(-1), out_f = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  const int64_t padded = (n + kAmxRows - 1) / kAmxRows * kAmxRows;
  const QuantisedRows& a = quantise_rows(x.data_ptr<float>(), n, k, w.blocks, padded);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (out_f + kTile - 1) / kTile, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> held;  // this thread's B tiles, 64-byte aligned within
    held.resize(static_cast<size_t>(w.blocks * kAmxBBytes + 64));
    uint8_t* b_tiles = held.data() + (64 - reinterpret_cast<uintptr_t>(held.data()) % 64) % 64;
    alignas(64) float dots[kAmxRows * 16];
    amx_configure();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = 2 * u, o = t * kTile, width = std::min<int64_t>(2 * kTile, out_f - o);
      const bool second = t + 1 < tiles;
      const uint8_t* p0 = w.codes + t * w.blocks * kTileBlockBytes;
      unpack_pair(p0, second ? p0 + w.blocks * kTileBlockBytes : nullptr, w.blocks, b_tiles);
      const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1u);
      const __m512 bv = bp ? _mm512_maskz_loadu_ps(lanes, bp + o) : _mm512_setzero_ps();
      for (int64_t r0 = 0; r0 < n; r0 += kAmxRows) {
        const bool first = r0 == 0 && u + 1 < end;  // the next pair's codes: this thread reads them next
        amx_pair_dot(w, t, second, b_tiles, a, r0, first ? p0 + 2 * w.blocks * kTileBlockBytes : nullptr, dots);
        for (int64_t r = 0; r < std::min(kAmxRows, n - r0); ++r)
          _mm512_mask_storeu_ps(yp + (r0 + r) * out_f + o, lanes, _mm512_add_ps(_mm512_load_ps(dots + 16 * r), bv));
      }
    }
    _tile_release();
  });
}
#endif
