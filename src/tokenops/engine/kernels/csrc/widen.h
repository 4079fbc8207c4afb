// Widening loads shared by the per-row kernels (quantize_rows.cpp, scale_rows.cpp): float32, bfloat16
// and float16 elements read as float32, exactly, one at a time (scalar tails) or 16 at a time
// (AVX-512); and the AVX2 horizontal sum the matmul kernels end their accumulators with (gemv.cpp,
// linear_blocks.cpp). A header, not a .cpp: the build compiles csrc/*.cpp and hashes csrc/*.h with them.
#pragma once

#include <ATen/ATen.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tokenops::widen {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX2__)
// the sum of 8 float32 lanes, in a fixed order
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace tokenops::widen
