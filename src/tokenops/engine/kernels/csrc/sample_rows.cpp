// One token per row of a batch's logits, the sampler's common case in one pass over memory.
//
// sample_rows(logits [N, V] float32, temperatures [N], uniforms [N]) -> int64 [N]: a row with
// temperature 0 takes its first largest logit (torch.argmax); any other row draws from
// softmax(logits / T) by inversion: the first token whose cumulative weight passes u times the
// row's total, u its uniform in [0, 1). A -inf logit (a grammar mask) has weight exactly 0 and is
// never drawn. In torch ops that is a division, a softmax, a cumsum and a search over fresh [N, V]
// tensors (several milliseconds at a decode batch's width); here each row is read twice (its max,
// then its weights into a scratch row that stays in L2) and the search runs over chunk sums, then
// inside one chunk. Tokens equal the torch path's except where u * total falls within rounding
// of a boundary between two tokens' cumulative weights (the sums are taken in another order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>
#include <torch/library.h>

#include "exp_poly.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using tokenops::exp_poly;

constexpr int64_t kChunk = 512;  // weights per partial sum: the search reads V / kChunk sums, then one chunk
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// the row's largest logit and its first index (NaNs ignored; a row of NaNs gives index 0)
std::pair<float, int64_t> row_max(const float* x, int64_t v) {
  float m = kNegInf;
  int64_t at = 0, i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(kNegInf);
  __m512i vat = _mm512_setzero_si512(), vi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  if (v < (int64_t{1} << 31)) {
    for (; i + 16 <= v; i += 16) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(xv, vm, _CMP_GT_OQ);  // strict: each lane keeps its first
      vm = _mm512_mask_blend_ps(gt, vm, xv);
      vat = _mm512_mask_blend_epi32(gt, vat, vi);
      vi = _mm512_add_epi32(vi, step);
    }
    m = _mm512_reduce_max_ps(vm);
    const __mmask16 top = _mm512_cmp_ps_mask(vm, _mm512_set1_ps(m), _CMP_EQ_OQ);
    at = top ? _mm512_mask_reduce_min_epi32(top, vat) : 0;
  }
#endif
  for (; i < v; ++i)
    if (x[i] > m) m = x[i], at = i;
  return {m, at};
}

int64_t draw_row(const float* x, int64_t v, float temperature, float u, float* w, float* sums) {
  const float m = row_max(x, v).first;
  if (!(m > kNegInf)) return 0;  // every token masked, or NaN: nothing to draw from
  const float inv_t = 1.0f / temperature;
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(v, lo + kChunk);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) {
      const float e = x[i] == kNegInf ? 0.f : exp_poly((x[i] - m) * inv_t);
      w[i] = e;
      s += e;
    }
    sums[c] = s;
    total += s;
  }
  const float target = u * total;
  float run = 0.f;
  int64_t c = 0;
  for (; c + 1 < chunks && run + sums[c] <= target; ++c) run += sums[c];
  int64_t last = -1;  // the last token with weight seen, for a target that rounding puts past the end
  for (int64_t i = c * kChunk, hi = std::min(v, i + kChunk); i < hi; ++i) {
    if (w[i] > 0.f) {
      last = i;
      run += w[i];
      if (run > target) return i;
    }
  }
  for (int64_t i = c * kChunk - 1; last < 0 && i >= 0; --i)
    if (w[i] > 0.f) last = i;
  return std::max<int64_t>(last, 0);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "sample_rows: logits must be a contiguous float32 CPU tensor [N, V]");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "sample_rows: empty vocabulary");
  for (const at::Tensor* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "sample_rows: temperatures and uniforms must be contiguous float32 CPU tensors [N]");
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* temp = temperatures.data_ptr<float>();
  const float* uni = uniforms.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> w, sums;  // reused: a fresh row of V floats would fault its pages in
    w.resize(v);
    sums.resize((v + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * v;
      tok[r] = temp[r] > 0.f ? draw_row(row, v, temp[r], uni[r], w.data(), sums.data()) : row_max(row, v).second;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
