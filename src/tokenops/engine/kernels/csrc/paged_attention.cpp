// Paged decode attention: one query per sequence over its cached keys, read in place through the
// block table (no gather), with an online softmax in float32 (flash-decoding).
//
// Matches the PyTorch decode path of tokenops.engine.attention: grouped-query attention (the
// H / KV query heads of one KV head read each key once), caches in float32 / bfloat16 / float16
// or int8 with a float16 scale per (slot, kv head), sliding windows, and an evicted gap (kept key
// j has absolute position j, or j + gap once j >= gap start; the query sits at len - 1 + gap).
//
// Work items are (sequence, kv head, key chunk). Long sequences are split into chunks when there
// are too few (sequence, kv head) pairs to keep every thread busy (batch 1); each chunk keeps its
// own running max / sum / accumulator and a second pass merges them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <limits>
#include <torch/library.h>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;       // keys scored before their values are accumulated
constexpr int64_t kMinChunk = 64;   // fewer keys than this per thread are not worth a merge
constexpr int64_t kMinParallel = 4096;  // (key, kv head) reads below which waking threads costs more
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The three inner loops: AVX-512 where the build has it and head_dim is a multiple of 16, plain
// loops otherwise. (GCC's `omp simd` reductions sum the 16 lanes one by one, and it left a loop of
// an inline polynomial exp scalar: both were most of the time before these were written out.)

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef __AVX512F__
  if (d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

#ifdef __AVX512F__
// exp for x <= 0 (scores minus their max), Cephes' polynomial; 2^n applied with scalef
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#endif

// s[t] = exp(s[t] - mx) for t < n; returns their sum
inline float exp_shifted(float* s, int64_t n, float mx) {
  float sum = 0.f;
#ifdef __AVX512F__
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
#endif
  return sum;
}

// acc[0:d] += sum_t w[t] * rows[t][0:d]
inline void accumulate(float* acc, const float* w, const float* const* rows, int64_t n, int64_t d) {
#ifdef __AVX512F__
  if (d % 16 == 0 && d <= 256) {
    // the whole row's accumulators in registers: independent FMAs per key, not one dependent chain
    __m512 a[16];
    const int64_t nv = d / 16;
    for (int64_t c = 0; c < nv; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      for (int64_t c = 0; c < nv; ++c) a[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(rows[t] + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float wt = w[t];
    const float* r = rows[t];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += wt * r[i];
  }
}

// A cache row as float: float32 rows are used in place, others converted into `buf`.
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

struct Item {
  int64_t s, g, lo, hi;
  int64_t part;  // index into the partial buffers; -1: the only chunk, write the output directly
};

struct Problem {
  const float* q;  // [S, H, D]
  float* out;      // [S, H, D]
  const int64_t* tables;
  int64_t table_width, block_size, kv_heads, group, d;
  float scale;
  const at::Half* k_scale;  // int8 only: [slots, KV]
  const at::Half* v_scale;
  float* part_m;  // [parts, group]
  float* part_l;
  float* part_acc;  // [parts, group, D]
};

// kD > 0: head_dim known at compile time (the common sizes), so the per-key loops unroll fully
template <typename T, int64_t kD>
void attend_chunk(const Problem& p, const T* k_cache, const T* v_cache, const Item& it) {
  const int64_t G = p.group, D = kD > 0 ? kD : p.d, KV = p.kv_heads, bs = p.block_size;
  const float* q = p.q + (it.s * KV + it.g) * G * D;  // this kv head's G query heads, consecutive
  const int64_t* table = p.tables + it.s * p.table_width;
  std::vector<float> acc(G * D, 0.f), m(G, kNegInf), l(G, 0.f), sc(G * kTile), vw(kTile);
  std::vector<float> kbuf(std::is_same_v<T, float> ? 0 : kTile * D), vbuf(kbuf.size());
  const float* krow[kTile];
  const float* vrow[kTile];
  int64_t off[kTile];
  for (int64_t t0 = it.lo; t0 < it.hi; t0 += kTile) {
    const int64_t nt = std::min(kTile, it.hi - t0);
    int64_t b = t0 / bs, o = t0 % bs;
    for (int64_t t = 0; t < nt; ++t) {
      off[t] = (table[b] * bs + o) * KV + it.g;  // (slot, kv head)
      krow[t] = row_as_float(k_cache + off[t] * D, kbuf.data() + t * D, D);
      vrow[t] = row_as_float(v_cache + off[t] * D, vbuf.data() + t * D, D);
      if (++o == bs) o = 0, ++b;
    }
    for (int64_t t = 0; t < nt; ++t) {
      const float ks = p.k_scale ? p.scale * static_cast<float>(p.k_scale[off[t]]) : p.scale;
      for (int64_t h = 0; h < G; ++h) sc[h * kTile + t] = dot(q + h * D, krow[t], D) * ks;
    }
    for (int64_t h = 0; h < G; ++h) {
      float* s = sc.data() + h * kTile;
      float mt = m[h];
      for (int64_t t = 0; t < nt; ++t) mt = std::max(mt, s[t]);
      const float sum = exp_shifted(s, nt, mt);
      float* a = acc.data() + h * D;
      if (mt > m[h]) {  // the running max moved: rescale what was accumulated under the old one
        const float corr = m[h] == kNegInf ? 0.f : std::exp(m[h] - mt);
        l[h] *= corr;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] *= corr;
        m[h] = mt;
      }
      l[h] += sum;
      if (p.v_scale) {
        for (int64_t t = 0; t < nt; ++t) vw[t] = s[t] * static_cast<float>(p.v_scale[off[t]]);
        s = vw.data();
      }
      accumulate(a, s, vrow, nt, D);
    }
  }
  if (it.part < 0) {
    float* out = p.out + (it.s * KV + it.g) * G * D;
    for (int64_t h = 0; h < G; ++h) {
      const float inv = 1.f / l[h];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) out[h * D + i] = acc[h * D + i] * inv;
    }
  } else {
    std::copy(m.begin(), m.end(), p.part_m + it.part * G);
    std::copy(l.begin(), l.end(), p.part_l + it.part * G);
    std::copy(acc.begin(), acc.end(), p.part_acc + it.part * G * D);
  }
}

// Merge the chunks of one (sequence, kv head): out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M).
void merge_chunks(const Problem& p, int64_t s, int64_t g, int64_t first, int64_t n) {
  const int64_t G = p.group, D = p.d;
  float* o = p.out + (s * p.kv_heads + g) * G * D;
  for (int64_t h = 0; h < G; ++h) {
    float mx = kNegInf;
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, p.part_m[(first + c) * G + h]);
    float denom = 0.f;
    std::fill(o + h * D, o + (h + 1) * D, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float w = std::exp(p.part_m[(first + c) * G + h] - mx);
      denom += w * p.part_l[(first + c) * G + h];
      const float* a = p.part_acc + ((first + c) * G + h) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[h * D + i] += w * a[i];
    }
    const float inv = 1.f / denom;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[h * D + i] *= inv;
  }
}

// First kept key a query may see: all of them, or those inside the window (absolute positions).
int64_t window_start(int64_t len, int64_t gap_start, int64_t gap, int64_t window) {
  if (window <= 0) return 0;
  const int64_t lowest = len + gap - window;  // lowest absolute position inside the window
  if (gap == 0 || lowest < gap_start) return std::max<int64_t>(0, lowest);
  return std::max(gap_start, len - window);  // kept keys past the gap: absolute = j + gap
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& block_tables, const at::Tensor& lens,
                                  const std::optional<at::Tensor>& gaps, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: q must be [S, H, D] and the caches [blocks, block_size, KV, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: caches must be contiguous and of one dtype");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KV == 0, "paged_decode_attention: head_dim or head counts do not match");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "paged_decode_attention: int8 caches need scales");
  if (int8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->numel() == k_cache.numel() / D && v_scale->numel() == k_scale->numel(),
                "paged_decode_attention: scales must be contiguous float16, one per (slot, kv head)");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == S &&
                  lens.scalar_type() == at::kLong && lens.numel() == S,
              "paged_decode_attention: block_tables [S, W] and lens [S] must be int64");
  at::Tensor tables = block_tables.contiguous(), lens_c = lens.contiguous();
  at::Tensor gaps_c;
  if (gaps) {
    TORCH_CHECK(gaps->scalar_type() == at::kLong && gaps->numel() == 2 * S, "paged_decode_attention: gaps must be int64 [S, 2]");
    gaps_c = gaps->contiguous();
  }
  const int64_t W = tables.size(1), num_blocks = k_cache.size(0);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens_c.data_ptr<int64_t>();
  const int64_t* gap = gaps ? gaps_c.data_ptr<int64_t>() : nullptr;

  // split each sequence's keys into as many chunks as keep the threads busy, at least kMinChunk keys each
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, (2 * threads + S * KV - 1) / (S * KV));
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first item, chunks) per split (s, g)
  int64_t parts = 0, work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = len[s];
    TORCH_CHECK(n >= 1 && (n + bs - 1) / bs <= W, "paged_decode_attention: a length exceeds its block table");
    for (int64_t b = 0; b < (n + bs - 1) / bs; ++b) {
      TORCH_CHECK(tab[s * W + b] >= 0 && tab[s * W + b] < num_blocks, "paged_decode_attention: block id out of range");
    }
    const int64_t lo = window_start(n, gap ? gap[2 * s] : 0, gap ? gap[2 * s + 1] : 0, window);
    const int64_t chunks = std::clamp<int64_t>((n - lo) / kMinChunk, 1, want);
    work += (n - lo) * KV;
    for (int64_t g = 0; g < KV; ++g) {
      if (chunks > 1) merges.emplace_back(static_cast<int64_t>(items.size()), chunks);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t a = lo + (n - lo) * c / chunks, e = lo + (n - lo) * (c + 1) / chunks;
        items.push_back({s, g, a, e, chunks > 1 ? parts++ : -1});
      }
    }
  }

  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({S, H, D}, q.options().dtype(at::kFloat));
  const int64_t G = H / KV;
  std::vector<float> part_m(parts * G), part_l(parts * G), part_acc(parts * G * D);
  Problem p{qf.data_ptr<float>(), out.data_ptr<float>(), tab, W, bs, KV, G, D, static_cast<float>(scale),
            int8 ? k_scale->data_ptr<at::Half>() : nullptr, int8 ? v_scale->data_ptr<at::Half>() : nullptr,
            part_m.data(), part_l.data(), part_acc.data()};
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](auto* kc, auto* vc) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    auto chunk = D == 64 ? attend_chunk<T, 64> : D == 128 ? attend_chunk<T, 128>
               : D == 256 ? attend_chunk<T, 256> : attend_chunk<T, 0>;
    const int64_t grain = work < kMinParallel ? num_items + 1 : 1;  // above the count: run inline
    at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) chunk(p, kc, vc, items[i]);
    });
  };
  if (int8) {
    run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    });
  }
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& first = items[merges[i].first];
      merge_chunks(p, first.s, first.g, first.part, merges[i].second);
    }
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor lens, Tensor? gaps, int window, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
