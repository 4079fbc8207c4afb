// The gated MLP activations act(gate) for act(gate) * up, one lane and 8 (AVX2) / 16 (AVX-512) at a
// time with the same roundings in every width: Llama's SiLU and Gemma's tanh GELU. Shared by the
// standalone gated ops (activations.cpp) and the int4 tiles' fused gate|up projection
// (linear_blocks.cpp), which must give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "exp_poly.h"

namespace tokenops {

template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// each activation in one lane and in 8 (AVX2) / 16 (AVX-512), the same roundings in every width
struct Silu {
  static float apply(float g) { return g / (1.0f + exp_poly(-g)); }
#if defined(__AVX2__) && defined(__FMA__)
  static __m256 apply(__m256 g) {
    const __m256 e = tokenops::exp_poly8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));  // e^-g
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
#endif
#if defined(__AVX512F__)
  static __m512 apply(__m512 g) {
    const __m512i neg = _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN));
    const __m512 e = tokenops::exp_poly16(_mm512_castsi512_ps(neg));  // e^-g
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  }
#endif
};

// 0.5 * (1 + tanh(y)) == sigmoid(2y), no cancellation; y = sqrt(2/pi) * (g + 0.044715 g^3)
struct GeluTanh {
  static constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
  static float apply(float g) {
    const float inner = kC * std::fma(kA * g * g, g, g);
    return g / (1.0f + exp_poly(-2.0f * inner));
  }
#if defined(__AVX2__) && defined(__FMA__)
  static __m256 apply(__m256 g) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kA), g), g);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kC), _mm256_fmadd_ps(cube, g, g));
    const __m256 e = tokenops::exp_poly8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), inner));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
#endif
#if defined(__AVX512F__)
  static __m512 apply(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(kA), g), g);
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kC), _mm512_fmadd_ps(cube, g, g));
    const __m512 e = tokenops::exp_poly16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), inner));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  }
#endif
};

// act[i] = Act::apply(act[i]), the widest lanes the build has, then one at a time
template <typename Act>
inline void apply_all(float* act, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(act + i, Act::apply(_mm512_loadu_ps(act + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(act + i, Act::apply(_mm256_loadu_ps(act + i)));
#endif
  for (; i < n; ++i) act[i] = Act::apply(act[i]);
}

}  // namespace tokenops
