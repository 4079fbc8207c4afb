// Widening loads shared by the per-row kernels (quantize_rows.cpp, scale_rows.cpp): float32, bfloat16
// and float16 elements read as float32, exactly, one at a time (scalar tails) or 16 at a time
// (AVX-512). A header, not a .cpp: the build compiles csrc/*.cpp and hashes csrc/*.h with them.
#pragma once

#include <ATen/ATen.h>
#if defined(__AVX512F__)
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

}  // namespace tokenops::widen
