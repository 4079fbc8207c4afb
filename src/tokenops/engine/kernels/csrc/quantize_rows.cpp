// The per-row passes around int8_dynamic's integer matmul (`torch._int_mm`), one pass each.
//
// quantize_rows_s8: each row affine to int8 around its midpoint: lo / hi = min / max of the row,
// offset = (hi + lo) / 2, half = max((hi - lo) / 2, 1e-30), scale = half / 127 and
// q = round-half-even((x - offset) * (127 / half)) in [-127, 127], so x ~ q * scale + offset with
// 255 levels over the row's own range (a symmetric scale wastes half of them on a row whose values
// lean one way).
// rescale_rows_: the int32 products in place into float32 (the same storage, reinterpreted):
// y = float(acc) * row_scale[r] * col_scale[c] + row_offset[r] * col_offset[c] (+ bias[c]), in that
// order and without fused multiply-adds -- the torch ops in DynamicInt8Linear, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <torch/library.h>

#include "widen.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// no fused multiply-adds: the scalar tails must round like the vector body and like torch's ops
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

template <typename T>
void quantize_row(const T* x, int8_t* q, float* scale, float* offset, int64_t k) {
  int64_t i = 0;
  float lo = INFINITY, hi = -INFINITY;
#if defined(__AVX512F__)
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = load16(x + i);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  lo = _mm512_reduce_min_ps(vlo);
  hi = _mm512_reduce_max_ps(vhi);
#endif
  for (; i < k; ++i) {
    lo = std::min(lo, load(x, i));
    hi = std::max(hi, load(x, i));
  }
  const float mid = (hi + lo) * 0.5f;
  const float half = std::max((hi - lo) * 0.5f, 1e-30f);
  *scale = half / 127.0f;
  *offset = mid;
  const float inv = 127.0f / half;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), vmid = _mm512_set1_ps(mid), vmin = _mm512_set1_ps(-127.f),
               vmax = _mm512_set1_ps(127.f);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(load16(x + i), vmid), vinv);
    v = _mm512_min_ps(_mm512_max_ps(v, vmin), vmax);  // (x - mid) * inv can round just past 127
    __m512i n = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(n));
  }
#endif
  for (; i < k; ++i) {
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint((load(x, i) - mid) * inv), -127.f, 127.f));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_s8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows_s8: x must be [rows, k]");
  at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  TORCH_CHECK(k > 0, "quantize_rows_s8: rows must not be empty");
  at::Tensor q = at::empty({m, k}, xc.options().dtype(at::kChar));
  at::Tensor s = at::empty({m}, xc.options().dtype(at::kFloat));
  at::Tensor o = at::empty({m}, xc.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  float* op = o.data_ptr<float>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, qp + r * k, sp + r, op + r, k);
    });
  };
  switch (xc.scalar_type()) {
    case at::kFloat: run(xc.data_ptr<float>()); break;
    case at::kBFloat16: run(xc.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(xc.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "quantize_rows_s8: x must be float32, bfloat16 or float16");
  }
  return {q, s, o};
}

at::Tensor rescale_rows_(at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& row_offset,
                         const at::Tensor& col_scale, const at::Tensor& col_offset, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "rescale_rows_: acc must be a contiguous int32 [rows, n]");
  const int64_t m = acc.size(0), n = acc.size(1);
  for (const at::Tensor* t : {&row_scale, &row_offset}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == m && t->is_contiguous(),
                "rescale_rows_: row_scale and row_offset must be contiguous float32 [rows]");
  }
  for (const at::Tensor* t : {&col_scale, &col_offset}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(),
                "rescale_rows_: col_scale and col_offset must be contiguous float32 [n]");
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "rescale_rows_: bias must be contiguous float32 [n]");
    bp = bias->data_ptr<float>();
  }
  int32_t* ap = acc.data_ptr<int32_t>();
  const float* rp = row_scale.data_ptr<float>();
  const float* rop = row_offset.data_ptr<float>();
  const float* cp = col_scale.data_ptr<float>();
  const float* cop = col_offset.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t* a = ap + r * n;
      float* y = reinterpret_cast<float*>(a);
      const float rs = rp[r], ro = rop[r];
      int64_t c = 0;
#if defined(__AVX512F__)
      const __m512 vrs = _mm512_set1_ps(rs), vro = _mm512_set1_ps(ro);
      for (; c + 16 <= n; c += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + c)), vrs),
                                 _mm512_loadu_ps(cp + c));
        v = _mm512_add_ps(v, _mm512_mul_ps(vro, _mm512_loadu_ps(cop + c)));
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + c));
        _mm512_storeu_ps(y + c, v);
      }
#endif
      for (; c < n; ++c) {
        float v = static_cast<float>(a[c]) * rs * cp[c];
        const float off = ro * cop[c];
        v = v + off;
        if (bp) v = v + bp[c];
        y[c] = v;
      }
    }
  });
  return acc.view(at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("quantize_rows_s8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.impl("quantize_rows_s8", c10::DispatchKey::CPU, TORCH_FN(quantize_rows_s8));
  m.def("rescale_rows_(Tensor(a!) acc, Tensor row_scale, Tensor row_offset, Tensor col_scale, Tensor col_offset, "
        "Tensor? bias) -> Tensor(a!)");
  m.impl("rescale_rows_", c10::DispatchKey::CPU, TORCH_FN(rescale_rows_));
}
