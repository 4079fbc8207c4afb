// Gated MLP activations over the fused gate|up projection, in one pass: act(gate) * up.
//
// x is [..., 2I] (gate then up, as MergedLinear lays them out), the result [..., I]. silu_mul is
// Llama's F.silu(gate) * up, gelu_tanh_mul Gemma's F.gelu(gate, approximate="tanh") * up; both
// compute in float32 and round like torch does in the storage dtype (the activation, then the
// product). exp is exp_poly.h's polynomial, 8 or 16 lanes at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <torch/library.h>

#include "exp_poly.h"

namespace {

using tokenops::exp_poly;

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

template <typename Act, typename T>
void gated_rows(const T* x, T* out, int64_t rows, int64_t width) {
  constexpr int64_t kChunk = 256;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    float act[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      // conversions in their own loops: the float-only middle loop is the one that vectorises
      for (int64_t c = 0; c < width; c += kChunk) {
        const int64_t n = std::min(kChunk, width - c);
        for (int64_t i = 0; i < n; ++i) act[i] = static_cast<float>(gate[c + i]);
        apply_all<Act>(act, n);
        for (int64_t i = 0; i < n; ++i) o[c + i] = static_cast<T>(round_to<T>(act[i]) * static_cast<float>(up[c + i]));
      }
    }
  });
}

template <typename Act>
at::Tensor gated(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0, name,
              ": x must be a contiguous CPU tensor [..., 2 * width] (gate | up)");
  const int64_t width = x.size(-1) / 2, rows = width ? x.numel() / (2 * width) : 0;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_activation", [&] {
    gated_rows<Act, scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x) { return gated<Silu>(x, "silu_mul"); }
at::Tensor gelu_tanh_mul(const at::Tensor& x) { return gated<GeluTanh>(x, "gelu_tanh_mul"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("gelu_tanh_mul", c10::DispatchKey::CPU, TORCH_FN(gelu_tanh_mul));
}
