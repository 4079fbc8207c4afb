// The per-row passes around int8_dynamic's integer matmul (`torch._int_mm`), one pass each.
//
// quantize_rows_s8: per row r, amax = max|x| (at least 1e-30), scale[r] = amax / 127 and
// q = round-half-even(x * (127 / amax)) in [-127, 127] -- the same as the torch ops
// `(x * (127 / amax)).round().to(int8)` in DynamicInt8Linear (a dozen ms of separate passes at 512 rows).
// rescale_rows_: the int32 products in place into float32 (the same storage, reinterpreted):
// y = float(acc) * row_scale[r] * col_scale[c] (+ bias[c]), multiplied in that order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <torch/library.h>
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

template <typename T>
void quantize_row(const T* x, int8_t* q, float* scale, int64_t k) {
  int64_t i = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + i)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::abs(load(x, i)));
  amax = std::max(amax, 1e-30f);
  *scale = amax / 127.0f;
  const float inv = 127.0f / amax;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_mul_ps(load16(x + i), vinv);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // |x| * inv can round just past 127
    __m512i n = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(n));
  }
#endif
  for (; i < k; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(load(x, i) * inv), -127.f, 127.f));
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_s8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows_s8: x must be [rows, k]");
  at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor q = at::empty({m, k}, xc.options().dtype(at::kChar));
  at::Tensor s = at::empty({m}, xc.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, qp + r * k, sp + r, k);
    });
  };
  switch (xc.scalar_type()) {
    case at::kFloat: run(xc.data_ptr<float>()); break;
    case at::kBFloat16: run(xc.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(xc.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "quantize_rows_s8: x must be float32, bfloat16 or float16");
  }
  return {q, s};
}

at::Tensor rescale_rows_(at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "rescale_rows_: acc must be a contiguous int32 [rows, n]");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == m && row_scale.is_contiguous(),
              "rescale_rows_: row_scale must be contiguous float32 [rows]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.numel() == n && col_scale.is_contiguous(),
              "rescale_rows_: col_scale must be contiguous float32 [n]");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "rescale_rows_: bias must be contiguous float32 [n]");
    bp = bias->data_ptr<float>();
  }
  int32_t* ap = acc.data_ptr<int32_t>();
  const float* rp = row_scale.data_ptr<float>();
  const float* cp = col_scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int32_t* a = ap + r * n;
      float* y = reinterpret_cast<float*>(a);
      const float rs = rp[r];
      int64_t c = 0;
#if defined(__AVX512F__)
      const __m512 vrs = _mm512_set1_ps(rs);
      for (; c + 16 <= n; c += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + c)), vrs),
                                 _mm512_loadu_ps(cp + c));
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + c));
        _mm512_storeu_ps(y + c, v);
      }
#endif
      for (; c < n; ++c) {
        float v = static_cast<float>(a[c]) * rs * cp[c];
        if (bp) v += bp[c];
        y[c] = v;
      }
    }
  });
  return acc.view(at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("quantize_rows_s8(Tensor x) -> (Tensor, Tensor)");
  m.impl("quantize_rows_s8", c10::DispatchKey::CPU, TORCH_FN(quantize_rows_s8));
  m.def("rescale_rows_(Tensor(a!) acc, Tensor row_scale, Tensor col_scale, Tensor? bias) -> Tensor(a!)");
  m.impl("rescale_rows_", c10::DispatchKey::CPU, TORCH_FN(rescale_rows_));
}
