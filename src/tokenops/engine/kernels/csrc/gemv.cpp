// Small-row matmuls on compressed weights with float32 activations and float32 accumulation:
// y[n, o] = sum_k x[n, k] * w[o, k] (* scale[o]) + bias[o], for the few rows of a decode step.
//
// At 1-8 rows a linear layer is bound by the bytes of its weight, not by arithmetic: reading
// bf16 (2 bytes) or int8 (1 byte) instead of float32 (4) is the whole gain, so the weight is
// widened to float32 in registers (bf16: a 16-bit shift; int8: sign extension, the per-channel
// scale applied once per output at the end) and the sums stay float32 (near-float32 numerics,
// unlike oneDNN's bf16 path or `_weight_int8pack_mm`, which also round the activations to bf16).
//
// Layout: weight [out, in] row-major as nn.Linear holds it. Threads take contiguous slices of
// output rows, and each walks its slice one weight row at a time, in address order: the weight
// reaches the core as one sequential stream, which is what a core streams fastest (several weight
// rows side by side make short streams a few KB apart, which the prefetchers follow worse: see
// docs/benchmarks.md, gemv_bandwidth.py). Each step takes one 64-byte line
// of weight (32 bf16 or 64 int8), widens it to 2 or 4 float32 vectors and multiplies them into all
// (up to kRowBlock = 8) activation rows, one accumulator per row in column order (the block loop's
// order, so results do not depend on the row count); a software prefetch into L2 runs
// kPrefetchBytes ahead of the stream.
// More than 8 rows (int8's native path runs up to 32), or activations past 16 KB, are bound by
// arithmetic or by re-reading the activations, not by the weight's bytes: they keep blocks of 4
// weight rows x 4 activation rows, which reuse each activation vector 4 times.
// AVX2 builds (8 lanes, 16 registers) run blocks of 4 weight rows x up to 3 activation rows at every
// row count: at one row a single accumulator chain would wait on FMA latency rather than on memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <torch/library.h>

#include "widen.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENOPS_GEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENOPS_GEMV_AVX2 1
#endif

namespace {

constexpr int kRowBlock = 8;  // up to this many activation rows: one pass over each weight row ...
// ... while the activation rows fit L1 beside the stream (one row always): each weight vector meets
// every activation row's vector, so they are read once per weight row; past L1 the block loop, which
// reads them once per 4 weight rows, is faster
constexpr int64_t kRowLoopActivationBytes = 16384;
constexpr int kOutBlock = 4;  // above it: blocks of 4 weight rows x 4 activation rows
#ifdef TOKENOPS_GEMV_AVX2
// AVX2 has 16 vector registers: 4 weight rows x 3 activation rows of accumulators, 3 activation
// vectors and a weight vector fill them
constexpr int kBlockRows = 3;
// and one accumulator chain per output is FMA-latency-bound at one row: every row count runs the
// block loop, whose 4 weight rows side by side (adjacent in memory) are 4 independent chains
constexpr bool kRowLoop = false;
#else
constexpr int kBlockRows = 4;
constexpr bool kRowLoop = true;
#endif

#ifdef TOKENOPS_GEMV_AVX512

// how far ahead of the stream to prefetch (into L2: an L1 prefetch this far ahead evicts the
// activations); a shorter distance, or none, lets the stream stall on memory
constexpr int64_t kPrefetchBytes = 8192;

// 16 weights (the first `m` lanes of a mask) widened to float32: the tail of a row
inline __m512 load16(const c10::BFloat16* w, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* w, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w)));
}

// one 64-byte step of weight widened to kVecs float32 vectors of 16, in order
template <typename W>
struct Line;
template <>
struct Line<c10::BFloat16> {
  static constexpr int kElems = 32, kVecs = 2;
  static inline void load(const c10::BFloat16* w, __m512* v) {
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q)
      v[q] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * q))), 16));
  }
};
template <>
struct Line<int8_t> {
  static constexpr int kElems = 64, kVecs = 4;
  static inline void load(const int8_t* w, __m512* v) {
    // four 16-byte sign extensions (cheaper than splitting one 64-byte load with shifts)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q)
      v[q] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * q))));
  }
};

// out[r] = dot(weight row w, x row r) for R activation rows
template <int R, typename W>
inline void dot_row(const W* w, const float* x, int64_t ldx, int64_t k, float* out) {
  constexpr int E = Line<W>::kElems, V = Line<W>::kVecs;
  // One accumulator per activation row, fed 16 columns at a time in column order: dot_block's
  // summation order, so a row's result never depends on how many rows share the call (a request's
  // tokens must not change with the batch it decodes in). Several chains per row were faster at
  // one row but made the bits depend on the row count.
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + E <= k; i += E) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T1);
    __m512 wv[V];
    Line<W>::load(w + i, wv);
#pragma GCC unroll 4
    for (int q = 0; q < V; ++q) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(wv[q], _mm512_loadu_ps(x + r * ldx + i + 16 * q), acc[r]);
    }
  }
  for (; i < k; i += 16) {  // the row's last k % E weights, 16 at a time, masked
    const __mmask16 m = k - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 wv = load16(w + i, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + r * ldx + i), acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// More than kRowBlock rows (int8 runs natively up to 32): arithmetic, not the stream, bounds them, and
// the activations outgrow L1, so a block of 4 weight rows x 4 activation rows reuses each activation
// vector for 4 weight rows.
// out[j * R + r] = dot(weight row j, x row r) for OB weight rows and R activation rows
template <int OB, int R, typename W>
inline void dot_block(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* out) {
  // one flat array, fully unrolled: GCC keeps it in registers (a 2-D one was spilled every step)
  __m512 acc[OB * R];
#pragma GCC unroll 16
  for (int a = 0; a < OB * R; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - i)) - 1);
    __m512 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + i);
#pragma GCC unroll 4
    for (int j = 0; j < OB; ++j) {
      // the same columns of the next block's rows: a short [out, in] row alone is too brief a
      // stream for the hardware prefetcher, and a step's weights never sit in cache
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + OB) * ldw + i), _MM_HINT_T0);
      const __m512 wv = load16(w + j * ldw + i, m);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[j * R + r] = _mm512_fmadd_ps(wv, xv[r], acc[j * R + r]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < OB * R; ++a) out[a] = _mm512_reduce_add_ps(acc[a]);
}

#elif defined(TOKENOPS_GEMV_AVX2)

// 8 weights widened to float32
inline __m256 load8(const c10::BFloat16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

using tokenops::widen::hsum8;

inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(int8_t v) { return static_cast<float>(v); }

// out[j * R + r] = dot(weight row j, x row r) for OB weight rows and R activation rows. One
// accumulator per output, 8 columns at a time in column order, the last k % 8 added after the
// horizontal sum: the same order for every (OB, R), so a row's result never depends on the batch.
template <int OB, int R, typename W>
inline void dot_block(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* out) {
  __m256 acc[OB * R];
#pragma GCC unroll 16
  for (int a = 0; a < OB * R; ++a) acc[a] = _mm256_setzero_ps();
  const int64_t kv = k & ~int64_t(7);
  for (int64_t i = 0; i < kv; i += 8) {
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 4
    for (int j = 0; j < OB; ++j) {
      // one line ahead of the next block's rows, once per 64 bytes of weight
      if ((i * static_cast<int64_t>(sizeof(W))) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + OB) * ldw + i), _MM_HINT_T0);
      const __m256 wv = load8(w + j * ldw + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[j * R + r] = _mm256_fmadd_ps(wv, xv[r], acc[j * R + r]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < OB * R; ++a) out[a] = hsum8(acc[a]);
  // std::fma, not `+= a * b`: the compiler contracts or vectorises that differently per (OB, R)
  for (int64_t i = kv; i < k; ++i)
    for (int j = 0; j < OB; ++j)
      for (int r = 0; r < R; ++r) out[j * R + r] = std::fma(widen(w[j * ldw + i]), x[r * ldx + i], out[j * R + r]);
}

// the row loop's shape on the block loop's order (small_matmul does not take the row loop here)
template <int R, typename W>
inline void dot_row(const W* w, const float* x, int64_t ldx, int64_t k, float* out) {
  dot_block<1, R>(w, k, x, ldx, k, out);
}

#else

inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(int8_t v) { return static_cast<float>(v); }

// portable: one simd reduction per activation row, which compilers vectorise
template <int R, typename W>
inline void dot_row(const W* w, const float* x, int64_t ldx, int64_t k, float* out) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; ++i) acc += widen(w[i]) * xr[i];
    out[r] = acc;
  }
}

// portable: one simd reduction per (weight row, activation row), which compilers vectorise
template <int OB, int R, typename W>
inline void dot_block(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t k, float* out) {
  for (int j = 0; j < OB; ++j) {
    const W* wr = w + j * ldw;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += widen(wr[i]) * xr[i];
      out[j * R + r] = acc;
    }
  }
}

#endif

template <int R, typename W>
inline void store_rows(const W* w, int64_t k, const float* x, int64_t o, int64_t out_f, float s, float b, float* y) {
  float d[R];
  dot_row<R>(w, x, k, k, d);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r * out_f + o] = d[r] * s + b;
}

// weight row `o` against the n <= kRowBlock activation rows
template <typename W>
inline void out_row(const W* w, int64_t k, const float* x, int64_t n, int64_t o, int64_t out_f, const float* scale,
                    const float* bias, float* y) {
  const W* wo = w + o * k;
  const float s = scale ? scale[o] : 1.f, b = bias ? bias[o] : 0.f;
  switch (n) {
    case 8: store_rows<8>(wo, k, x, o, out_f, s, b, y); break;
    case 7: store_rows<7>(wo, k, x, o, out_f, s, b, y); break;
    case 6: store_rows<6>(wo, k, x, o, out_f, s, b, y); break;
    case 5: store_rows<5>(wo, k, x, o, out_f, s, b, y); break;
    case 4: store_rows<4>(wo, k, x, o, out_f, s, b, y); break;
    case 3: store_rows<3>(wo, k, x, o, out_f, s, b, y); break;
    case 2: store_rows<2>(wo, k, x, o, out_f, s, b, y); break;
    case 1: store_rows<1>(wo, k, x, o, out_f, s, b, y); break;
    default: break;
  }
}

template <int OB, int R, typename W>
inline void store_block(const W* w, int64_t k, const float* x, int64_t o, int64_t n0, int64_t out_f,
                        const float* scale, const float* bias, float* y) {
  float d[OB * R];
  dot_block<OB, R>(w + o * k, k, x + n0 * k, k, k, d);
  for (int j = 0; j < OB; ++j) {
    const float s = scale ? scale[o + j] : 1.f, b = bias ? bias[o + j] : 0.f;
    for (int r = 0; r < R; ++r) y[(n0 + r) * out_f + o + j] = d[j * R + r] * s + b;
  }
}

// OB weight rows from `o` against every activation row: the rows' few KB of weight stay in L1
// while the activation rows pass over them in chunks of kBlockRows, so memory sees them once
template <int OB, typename W>
inline void out_block(const W* w, int64_t k, const float* x, int64_t n, int64_t o, int64_t out_f,
                      const float* scale, const float* bias, float* y) {
  int64_t n0 = 0;
  for (; n0 + kBlockRows <= n; n0 += kBlockRows) store_block<OB, kBlockRows>(w, k, x, o, n0, out_f, scale, bias, y);
  switch (n - n0) {
    case 3: store_block<OB, 3>(w, k, x, o, n0, out_f, scale, bias, y); break;
    case 2: store_block<OB, 2>(w, k, x, o, n0, out_f, scale, bias, y); break;
    case 1: store_block<OB, 1>(w, k, x, o, n0, out_f, scale, bias, y); break;
    default: break;
  }
}

template <typename W>
void small_matmul(const W* w, const float* x, const float* scale, const float* bias, float* y, int64_t n,
                  int64_t k, int64_t out_f) {
  // ~16 KB of weight per task at least, so 2-4 threads split a layer without per-task overhead
  const int64_t row_bytes = std::max<int64_t>(k * static_cast<int64_t>(sizeof(W)), 1);
  const int64_t grain = std::max<int64_t>(kOutBlock, (16384 / row_bytes) & ~int64_t(kOutBlock - 1));
  at::parallel_for(0, out_f, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    if (kRowLoop &&
        (n == 1 || (n <= kRowBlock && n * k * static_cast<int64_t>(sizeof(float)) <= kRowLoopActivationBytes))) {
      for (; o < end; ++o) out_row(w, k, x, n, o, out_f, scale, bias, y);
      return;
    }
    for (; o + kOutBlock <= end; o += kOutBlock) out_block<kOutBlock>(w, k, x, n, o, out_f, scale, bias, y);
    for (; o < end; ++o) out_block<1>(w, k, x, n, o, out_f, scale, bias, y);
  });
}

at::Tensor check_x(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": weight must be a contiguous [out, in] matrix");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x's last dimension ", x.size(-1),
              " does not match the weight's ", w.size(1), " inputs");
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return at::empty(sizes, x.options());
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t out_f, const char* op) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_f, op,
              ": bias must be a contiguous float32 [out] vector");
  return bias->data_ptr<float>();
}

// x float32 [..., in] @ weight bf16 [out, in].T (+ bias float32) -> float32 [..., out]
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: weight must be bfloat16");
  at::Tensor y = check_x(x, weight, "linear_bf16");
  const int64_t k = weight.size(1), out_f = weight.size(0);
  small_matmul(weight.data_ptr<c10::BFloat16>(), x.data_ptr<float>(), nullptr, bias_ptr(bias, out_f, "linear_bf16"),
               y.data_ptr<float>(), x.numel() / std::max<int64_t>(k, 1), k, out_f);
  return y;
}

// x float32 [..., in] @ (weight int8 [out, in] * scales float32 [out, 1]).T (+ bias) -> float32 [..., out]
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "linear_int8: weight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == weight.size(0),
              "linear_int8: scales must be a contiguous float32 [out] vector");
  at::Tensor y = check_x(x, weight, "linear_int8");
  const int64_t k = weight.size(1), out_f = weight.size(0);
  small_matmul(weight.data_ptr<int8_t>(), x.data_ptr<float>(), scales.data_ptr<float>(),
               bias_ptr(bias, out_f, "linear_int8"), y.data_ptr<float>(), x.numel() / std::max<int64_t>(k, 1), k,
               out_f);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, TORCH_FN(linear_bf16));
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, TORCH_FN(linear_int8));
}
