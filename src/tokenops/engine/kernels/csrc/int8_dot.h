// Which integer dot product the block-quantised kernels (linear_blocks.cpp) compile, from the target's
// macros; isa.cpp's compiled_int8_dot() reports the same choice. A header, not a .cpp: the build
// compiles csrc/*.cpp and hashes csrc/*.h with them.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENOPS_BLOCKS_AVX2 1
// vpdpbusd: 4 u8 x s8 products added into each int32 lane in one instruction, where AVX2 needs
// vpmaddubsw, int16 adds and a widening vpmaddwd. AVX-VNNI (VEX) and AVX512-VNNI with VL (EVEX) both
// have the 256-bit form; the integer sums are the same either way, so the outputs are too.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define TOKENOPS_BLOCKS_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
#endif
#endif
