// RMSNorm over the last dimension, in float32 whatever the storage dtype, one row per task.
//
// Matches tokenops.engine.models.layers.RMSNorm: Llama scales after casting back
// (w * (x / rms).to(dtype)), Gemma (unit_offset) scales by (1 + w) before casting.
// `residual`, when given, is added to x first and the sum written back into it: the
// "add then norm" between a layer's sublayers in one pass over the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <torch/library.h>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
void rms_rows(const T* x, T* res, const T* w, T* out, int64_t n, int64_t d, double eps, bool unit_offset) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* rr = res ? res + r * d : nullptr;
      float acc = 0.f;
      if (rr) {
        for (int64_t i = 0; i < d; ++i) {
          T s = static_cast<T>(to_f(xr[i]) + to_f(rr[i]));  // the sum is stored in T, as torch's add
          rr[i] = s;
          h[i] = to_f(s);
        }
      } else {
        for (int64_t i = 0; i < d; ++i) h[i] = to_f(xr[i]);
      }
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += h[i] * h[i];
      const float inv = 1.0f / std::sqrt(acc / static_cast<float>(d) + static_cast<float>(eps));
      T* o = out + r * d;
      if (unit_offset) {
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(h[i] * inv * (1.0f + to_f(w[i])));
      } else {
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(to_f(w[i]) * to_f(static_cast<T>(h[i] * inv)));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "rms_norm: weight must have x's dtype and last dimension");
  const int64_t d = x.size(-1), n = x.numel() / d;
  at::Tensor out = at::empty_like(x);
  at::Tensor w = weight.contiguous();
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(), "rms_norm: residual must be contiguous and match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                       w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, d, eps, unit_offset);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
