// RMSNorm over the last dimension, in float32 whatever the storage dtype, one row per task.
//
// Matches tokenops.engine.models.layers.RMSNorm: Llama scales after casting back
// (w * (x / rms).to(dtype)), Gemma (unit_offset) scales by (1 + w) before casting.
// `residual`, when given, is added to x first and the sum written back into it: the
// "add then norm" between a layer's sublayers in one pass over the row. `rms_norm_to` is the same
// over a float32 stream whose sublayer output x (with a residual) and whose result may be bf16: a
// bf16 GEMM's output read as it is and its next GEMM's input written as it will read it, the same
// bits as casting around the float32 norm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <torch/library.h>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// T: the stream's (residual's, weight's) dtype, X: x's, O: the result's
template <typename T, typename X = T, typename O = T>
void rms_rows(const X* x, T* res, const T* w, O* out, int64_t n, int64_t d, double eps, bool unit_offset) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * d;
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
      O* o = out + r * d;
      if (unit_offset) {
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<O>(static_cast<T>(h[i] * inv * (1.0f + to_f(w[i]))));
      } else {
        for (int64_t i = 0; i < d; ++i)
          o[i] = static_cast<O>(static_cast<T>(to_f(w[i]) * to_f(static_cast<T>(h[i] * inv))));
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

// a float32 stream: x float32, or bf16 with a residual; the result float32 or bf16
at::Tensor rms_norm_to(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                       double eps, bool unit_offset, at::ScalarType out_dtype) {
  using at::kBFloat16;
  using at::kFloat;
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm_to: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.scalar_type() == kFloat && weight.numel() == x.size(-1),
              "rms_norm_to: weight must be float32 with x's last dimension");
  TORCH_CHECK(x.scalar_type() == kFloat || (x.scalar_type() == kBFloat16 && residual),
              "rms_norm_to: x must be float32, or bf16 with a residual");
  TORCH_CHECK(out_dtype == kFloat || out_dtype == kBFloat16, "rms_norm_to: the result is float32 or bf16");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == kFloat && residual->is_contiguous(),
                "rms_norm_to: residual must be a contiguous float32 tensor of x's shape");
  }
  const int64_t d = x.size(-1), n = x.numel() / d;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const float* w = weight.contiguous().data_ptr<float>();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  using bf16 = c10::BFloat16;
  const bool x_bf16 = x.scalar_type() == kBFloat16, o_bf16 = out_dtype == kBFloat16;
  if (x_bf16 && o_bf16) {
    rms_rows<float, bf16, bf16>(x.data_ptr<bf16>(), res, w, out.data_ptr<bf16>(), n, d, eps, unit_offset);
  } else if (x_bf16) {
    rms_rows<float, bf16, float>(x.data_ptr<bf16>(), res, w, out.data_ptr<float>(), n, d, eps, unit_offset);
  } else if (o_bf16) {
    rms_rows<float, float, bf16>(x.data_ptr<float>(), res, w, out.data_ptr<bf16>(), n, d, eps, unit_offset);
  } else {
    rms_rows<float>(x.data_ptr<float>(), res, w, out.data_ptr<float>(), n, d, eps, unit_offset);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def(
      "rms_norm_to(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, bool unit_offset, "
      "ScalarType out_dtype) -> Tensor");
  m.impl("rms_norm_to", c10::DispatchKey::CPU, TORCH_FN(rms_norm_to));
}
