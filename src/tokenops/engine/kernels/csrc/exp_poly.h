// Cephes' expf as a polynomial, accurate to a couple of float32 ulp (what torch's own vectorised exp
// promises): one lane (exp_poly), 8 lanes (exp_poly8, AVX2 + FMA) and 16 (exp_poly16, AVX-512), each
// the same sequence of roundings, so a row gives the same bits whichever width takes each element
// (GCC does not vectorise the one-lane form: the clamp reads as control flow to it). Shared by the
// gated activations (activations.cpp) and the sampler (sample_rows.cpp). A header, not a .cpp: the
// build compiles csrc/*.cpp and hashes csrc/*.h with them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tokenops {

namespace exp_consts {
constexpr float kLo = -87.3f, kHi = 88.3f;  // 2^n stays a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to nearest
constexpr float kLn2Hi = -0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_consts

// e^x = 2^n * e^r with |r| <= ln2/2, a degree-6 polynomial for e^r; every step an explicit fma or
// one rounding, as the vector forms below
inline float exp_poly(float x) {
  using namespace exp_consts;
  x = std::min(std::max(x, kLo), kHi);  // NaN stays NaN, as in maxps(lo, x) / minps(hi, x) below
  const float n = std::fma(x, kLog2e, kShift) - kShift;
  float r = std::fma(n, kLn2Hi, x);
  r = std::fma(n, kLn2Lo, r);
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kP[i]);
  p = std::fma(p * r, r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_poly8(__m256 x) {
  using namespace exp_consts;
  // maxps returns its second operand when either is NaN: NaN stays NaN
  x = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), x));
  const __m256 shift = _mm256_set1_ps(kShift);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), shift), shift);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp_poly16(__m512 x) {
  using namespace exp_consts;
  x = _mm512_min_ps(_mm512_set1_ps(kHi), _mm512_max_ps(_mm512_set1_ps(kLo), x));
  const __m512 shift = _mm512_set1_ps(kShift);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), shift), shift);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace tokenops
