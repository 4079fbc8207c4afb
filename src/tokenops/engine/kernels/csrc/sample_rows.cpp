// One token per row of a batch's logits, the sampler's work in one pass over memory.
//
// sample_rows(logits [N, V] float32, temperatures [N], uniforms [N], top_k [N] int64, top_p [N])
// -> int64 [N]: a row with temperature 0 takes its first largest logit (torch.argmax); any other row
// draws from softmax(logits / T), cut to its top_k most likely tokens (0: no cut) and then to its
// nucleus (the most likely tokens until the mass before the next reaches top_p of what top-k kept;
// 1: no cut), by inversion: the first kept token, in vocabulary order, whose cumulative weight passes
// u times the kept total, u its uniform in [0, 1). A -inf logit (a grammar mask) has weight exactly
// 0 and is never drawn. In torch ops that is a division, a softmax, a top-k or sort, a cumsum, a
// scatter and a search over fresh [N, V] tensors (several milliseconds at a decode batch's width,
// a hundred with a wide nucleus); here each row is read twice (its max, then its weights into a
// scratch row that stays in L2) and the search runs over chunk sums, then inside one chunk. A cut
// sorts only its candidates (draw_cut): the top_k heaviest from a min-heap, or for top-p alone the
// one bucket of a weight histogram where the nucleus ends. Tokens equal the torch path's except
// where u * total falls within rounding of a boundary between two tokens' cumulative weights (the
// sums are taken in another order) or where two candidates tie at the cut.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#include <torch/library.h>

#include "exp_poly.h"
#include "widen.h"
#if defined(__AVX512F__) || defined(__AVX2__)
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
#elif defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(kNegInf);
  __m256i vat = _mm256_setzero_si256(), vi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  if (v < (int64_t{1} << 31)) {
    for (; i + 8 <= v; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      const __m256 gt = _mm256_cmp_ps(xv, vm, _CMP_GT_OQ);  // strict: each lane keeps its first
      vm = _mm256_blendv_ps(vm, xv, gt);
      vat = _mm256_blendv_epi8(vat, vi, _mm256_castps_si256(gt));
      vi = _mm256_add_epi32(vi, step);
    }
    alignas(32) float lane_max[8];
    alignas(32) int32_t lane_at[8];
    _mm256_store_ps(lane_max, vm);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), vat);
    m = lane_max[0];
    for (int l = 1; l < 8; ++l) m = std::max(m, lane_max[l]);
    at = 0;
    bool found = false;  // the first index among the lanes that hold the maximum
    for (int l = 0; l < 8; ++l)
      if (lane_max[l] == m && (!found || lane_at[l] < at)) at = lane_at[l], found = true;
  }
#endif
  for (; i < v; ++i)
    if (x[i] > m) m = x[i], at = i;
  return {m, at};
}

// scratch of one thread: a row's weights, its chunk sums and the candidates of a cut
struct Scratch {
  std::vector<float> w, sums, mass;
  std::vector<int32_t> cand;
};

// A weight's bucket: the top bits of a positive float (exponent and 4 mantissa bits) order like
// the float, so the buckets of a row's weights are a histogram in weight order, each bucket a
// factor of 2^(1/16) wide.
constexpr int kBucketShift = 19;
constexpr int kBuckets = 1 << (31 - kBucketShift);
inline int bucket(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<int>(bits >> kBucketShift);
}

// draw_row's cut. The kept tokens are the heaviest in (weight descending, index ascending) order up
// to the last kept one (wc, ic): token i is kept iff w[i] > wc, or w[i] == wc and i <= ic. Top-k
// finds its k with a min-heap (one comparison for most tokens); top-p alone walks a histogram of
// the weights from the heaviest bucket down to the one where the nucleus ends and sorts only that
// bucket. Then inversion over the kept tokens in vocabulary order.
int64_t draw_cut(const float* w, int64_t v, float total, int64_t top_k, float top_p, float u, Scratch& s) {
  std::vector<int32_t>& cand = s.cand;
  cand.clear();
  const auto heavier = [w](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  float kept = total;  // what the nucleus is a share of: the whole row, or what top-k kept
  float before = 0.f;  // mass of the kept tokens ahead of cand in the order
  if (top_k > 0 && top_k < v) {
    // min-heap of the k heaviest so far (its front the lightest of them)
    for (int64_t i = 0; i < v; ++i) {
      if (!(w[i] > 0.f)) continue;
      const int32_t id = static_cast<int32_t>(i);
      if (static_cast<int64_t>(cand.size()) < top_k) {
        cand.push_back(id);
        std::push_heap(cand.begin(), cand.end(), heavier);
      } else if (heavier(id, cand.front())) {
        std::pop_heap(cand.begin(), cand.end(), heavier);
        cand.back() = id;
        std::push_heap(cand.begin(), cand.end(), heavier);
      }
    }
    std::sort(cand.begin(), cand.end(), heavier);
    kept = 0.f;
    for (int32_t i : cand) kept += w[i];
  } else {
    // top-p alone: the bucket where the nucleus ends; every heavier bucket is inside it
    s.mass.assign(kBuckets, 0.f);
    int lightest = kBuckets - 1;
    for (int64_t i = 0; i < v; ++i) {
      if (w[i] > 0.f) {
        const int k = bucket(w[i]);
        s.mass[k] += w[i];
        lightest = std::min(lightest, k);
      }
    }
    // the lightest bucket ends it where rounding leaves the buckets' sum short of top_p * total
    const float reach = top_p * total;
    int b = kBuckets - 1;
    for (; b > lightest && !(s.mass[b] > 0.f && before + s.mass[b] >= reach); --b) before += s.mass[b];
    for (int64_t i = 0; i < v; ++i)
      if (w[i] > 0.f && bucket(w[i]) == b) cand.push_back(static_cast<int32_t>(i));
    std::sort(cand.begin(), cand.end(), heavier);
  }
  if (cand.empty()) return 0;  // every token masked
  size_t n = cand.size();
  if (top_p < 1.f) {
    const float reach = top_p * kept;
    n = 0;
    while (n < cand.size() && ((before == 0.f && n == 0) || before < reach)) before += w[cand[n++]];
  }
  const float wc = w[cand[n - 1]];
  const int32_t ic = cand[n - 1];
  float mass = 0.f;
  for (int64_t i = 0; i < v; ++i)
    if (w[i] > wc || (w[i] == wc && i <= ic)) mass += w[i];
  const float target = u * mass;
  float run = 0.f;
  int64_t last = ic;
  for (int64_t i = 0; i < v; ++i) {
    if (w[i] > wc || (w[i] == wc && i <= ic)) {
      last = i;
      run += w[i];
      if (run > target) return i;
    }
  }
  return last;
}

// w[i] = exp((x[i] - m) * inv_t) over [lo, hi), 0 for a -inf logit; returns their sum (lanes, then
// the lanes' fixed-order sum, then the tail)
float chunk_weights(const float* x, int64_t lo, int64_t hi, float m, float inv_t, float* w) {
  int64_t i = lo;
  float s = 0.f;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t), ninf = _mm512_set1_ps(kNegInf);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= hi; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    const __mmask16 live = _mm512_cmp_ps_mask(xv, ninf, _CMP_NEQ_UQ);
    const __m512 e = _mm512_maskz_mov_ps(live, tokenops::exp_poly16(_mm512_mul_ps(_mm512_sub_ps(xv, vm), vt)));
    _mm512_storeu_ps(w + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(kNegInf);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= hi; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 dead = _mm256_cmp_ps(xv, ninf, _CMP_EQ_OQ);
    const __m256 e = _mm256_andnot_ps(dead, tokenops::exp_poly8(_mm256_mul_ps(_mm256_sub_ps(xv, vm), vt)));
    _mm256_storeu_ps(w + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = tokenops::widen::hsum8(acc);
#endif
  for (; i < hi; ++i) {
    const float e = x[i] == kNegInf ? 0.f : exp_poly((x[i] - m) * inv_t);
    w[i] = e;
    s += e;
  }
  return s;
}

int64_t draw_row(const float* x, int64_t v, float temperature, float u, int64_t top_k, float top_p,
                 Scratch& scratch) {
  float* w = scratch.w.data();
  float* sums = scratch.sums.data();
  const float m = row_max(x, v).first;
  if (!(m > kNegInf)) return 0;  // every token masked, or NaN: nothing to draw from
  const float inv_t = 1.0f / temperature;
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(v, lo + kChunk);
    const float s = chunk_weights(x, lo, hi, m, inv_t, w);
    sums[c] = s;
    total += s;
  }
  if ((top_k > 0 && top_k < v) || top_p < 1.f) return draw_cut(w, v, total, top_k, top_p, u, scratch);
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

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                       const at::Tensor& top_k, const at::Tensor& top_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "sample_rows: logits must be a contiguous float32 CPU tensor [N, V]");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0 && v < (int64_t{1} << 31), "sample_rows: the vocabulary must hold 1 to 2^31 - 1 tokens");
  for (const at::Tensor* t : {&temperatures, &uniforms, &top_p})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "sample_rows: temperatures, uniforms and top_p must be contiguous float32 CPU tensors [N]");
  TORCH_CHECK(top_k.device().is_cpu() && top_k.dim() == 1 && top_k.size(0) == n &&
                  top_k.scalar_type() == at::kLong && top_k.is_contiguous(),
              "sample_rows: top_k must be a contiguous int64 CPU tensor [N]");
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* temp = temperatures.data_ptr<float>();
  const float* uni = uniforms.data_ptr<float>();
  const int64_t* ks = top_k.data_ptr<int64_t>();
  const float* ps = top_p.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;  // reused: a fresh row of V floats would fault its pages in
    scratch.w.resize(v);
    scratch.sums.resize((v + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * v;
      tok[r] = temp[r] > 0.f ? draw_row(row, v, temp[r], uni[r], ks[r], ps[r], scratch) : row_max(row, v).second;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor top_k, Tensor top_p) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
