// The per-row passes around int8_dynamic's fbgemm call (DynamicInt8Linear._fbgemm), one pass each.
//
// fbgemm's dynamic int8 linear quantises its whole input with one scale, so the layer first divides
// each row by its own max |x| and multiplies the output row back. In torch ops that is four to six
// passes (abs, amax, clamp, a division into a new tensor; then mul_ and add_ on fbgemm's output),
// a visible share of a decode step. Here:
// scale_rows: r = max(max_k |x[k]|, 1e-30) per row (NaN where the row holds a NaN, as torch's amax
// and clamp propagate it) and y = x / r as a true IEEE division (torch's `x2 / row_max` on float32
// divides; it never multiplies by a reciprocal), into a new float32 tensor: fbgemm sees the same
// bits as from the torch ops. x may be float32, bfloat16 or float16 (widened exactly, so a bf16
// input needs no float32 copy first).
// mul_rows_add_: out[r, c] = out[r, c] * r_scale[r] (+ bias[c]) in place, two roundings, no fused
// multiply-add: `out.mul_(row_max).add_(bias)`, bit for bit.
// linear_dynamic_rows: the whole layer call in one op from Python: x [..., k] (any float dtype) ->
// scale_rows -> quantized::linear_dynamic (fbgemm, called through the dispatcher with the prepacked
// weight passed on as it came) -> mul_rows_add_ -> [..., n] in x's dtype. It saves the layer the
// Python-to-C++ crossings of the separate ops and of its reshape / cast (a few microseconds each,
// 120 layer calls a step).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <algorithm>
#include <cmath>
#include <torch/library.h>

#include "widen.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// no fused multiply-adds: mul then add must round twice, as torch's mul_ and add_ do
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using tokenops::widen::load;
#if defined(__AVX512F__)
using tokenops::widen::load16;
#endif

// rows per task: about 16K elements, torch's own elementwise grain is 32K; the 32-row decode
// step's 32 x 576 stays on one thread, a 512-row prefill splits
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename T>
void scale_row(const T* x, float* y, float* r_out, int64_t k) {
  int64_t i = 0;
  float hi = 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 vhi = _mm512_setzero_ps();
  __mmask16 vnan = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 v = load16(x + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vhi = _mm512_max_ps(vhi, _mm512_abs_ps(v));
  }
  hi = _mm512_reduce_max_ps(vhi);
  nan = vnan != 0;
#endif
  for (; i < k; ++i) {
    const float v = load(x, i);
    nan |= std::isnan(v);
    hi = std::max(hi, std::fabs(v));
  }
  const float r = nan ? NAN : std::max(hi, 1e-30f);
  *r_out = r;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vr = _mm512_set1_ps(r);
  for (; i + 16 <= k; i += 16) _mm512_storeu_ps(y + i, _mm512_div_ps(load16(x + i), vr));
#endif
  for (; i < k; ++i) y[i] = load(x, i) / r;
}

std::tuple<at::Tensor, at::Tensor> scale_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "scale_rows: x must be [rows, k]");
  at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor y = at::empty({m, k}, xc.options().dtype(at::kFloat));
  at::Tensor r = at::empty({m, 1}, xc.options().dtype(at::kFloat));
  if (m == 0) return {y, r};
  TORCH_CHECK(k > 0, "scale_rows: rows must not be empty");
  float* yp = y.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, m, grain_rows(k), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) scale_row(xp + i * k, yp + i * k, rp + i, k);
    });
  };
  switch (xc.scalar_type()) {
    case at::kFloat: run(xc.data_ptr<float>()); break;
    case at::kBFloat16: run(xc.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(xc.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "scale_rows: x must be float32, bfloat16 or float16");
  }
  return {y, r};
}

at::Tensor mul_rows_add_(at::Tensor& out, const at::Tensor& r_scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "mul_rows_add_: out must be a contiguous float32 [rows, n]");
  const int64_t m = out.size(0), n = out.size(1);
  TORCH_CHECK(r_scale.scalar_type() == at::kFloat && r_scale.numel() == m && r_scale.is_contiguous(),
              "mul_rows_add_: r_scale must be contiguous float32 with one value per row");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "mul_rows_add_: bias must be contiguous float32 [n]");
    bp = bias->data_ptr<float>();
  }
  if (m == 0 || n == 0) return out;
  float* op = out.data_ptr<float>();
  const float* rp = r_scale.data_ptr<float>();
  at::parallel_for(0, m, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* y = op + i * n;
      const float s = rp[i];
      int64_t c = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(s);
      if (bp) {
        for (; c + 16 <= n; c += 16)
          _mm512_storeu_ps(y + c, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(y + c), vs), _mm512_loadu_ps(bp + c)));
      } else {
        for (; c + 16 <= n; c += 16) _mm512_storeu_ps(y + c, _mm512_mul_ps(_mm512_loadu_ps(y + c), vs));
      }
#endif
      for (; c < n; ++c) {
        float v = y[c] * s;
        if (bp) v = v + bp[c];
        y[c] = v;
      }
    }
  });
  return out;
}

// boxed, so the prepacked weight (a TorchScript custom class object, LinearPackedParamsBase) is
// passed to fbgemm's op as the IValue it came as, without this file naming its C++ type. The schema
// names the class: typed `Any`, the Python-side conversion of the argument (type inference) cost more
// than the two op calls saved
void linear_dynamic_rows(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  c10::IValue bias_iv = torch::jit::pop(*stack);
  c10::IValue packed = torch::jit::pop(*stack);
  const at::Tensor x = torch::jit::pop(*stack).toTensor();
  TORCH_CHECK(x.dim() >= 1, "linear_dynamic_rows: x must have a last dimension");
  const int64_t k = x.size(-1);
  at::Tensor x2 = x.reshape({-1, k});
  auto [scaled, row_max] = scale_rows(x2);
  static const c10::OperatorHandle fbgemm =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  torch::jit::Stack call{scaled, std::move(packed), false};
  fbgemm.callBoxed(&call);
  at::Tensor out = call[0].toTensor();
  c10::optional<at::Tensor> bias;
  if (!bias_iv.isNone()) bias = bias_iv.toTensor();
  mul_rows_add_(out, row_max, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(1);
  at::Tensor y = out.view(shape);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  torch::jit::push(*stack, std::move(y));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("scale_rows(Tensor x) -> (Tensor, Tensor)");
  m.impl("scale_rows", c10::DispatchKey::CPU, TORCH_FN(scale_rows));
  m.def("mul_rows_add_(Tensor(a!) out, Tensor r_scale, Tensor? bias) -> Tensor(a!)");
  m.impl("mul_rows_add_", c10::DispatchKey::CPU, TORCH_FN(mul_rows_add_));
  m.def("linear_dynamic_rows(Tensor x, __torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor? bias) -> Tensor");
  m.impl("linear_dynamic_rows", c10::DispatchKey::CPU,
         torch::CppFunction::makeFromBoxedFunction<&linear_dynamic_rows>());
}
