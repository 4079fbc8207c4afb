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

#include "gated_activation.h"

namespace {

using tokenops::GeluTanh;
using tokenops::Silu;
using tokenops::apply_all;
using tokenops::round_to;

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
