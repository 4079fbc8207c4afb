// Block-quantised weights against 8-bit activations, llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot
// products: y[n, o] = sum_k x[n, k] * w[o, k] + bias[o], with
//   linear_q4: w = code * d + m per group of G inputs, 4-bit codes 0..15 (W4A8);
//   linear_q8: w = code * d per block of 32 inputs, int8 codes -127..127 (W8A8).
//
// Each activation row is quantised per block of 32 inputs (symmetric int8, scale dx = max|x| / 127,
// q = round-half-even(x / dx)), and then a block of 32 weights costs one integer multiply-add
// (vpmaddubsw: 32 u8 codes x 32 s8 activations into 16 int16 pair sums, which 15 * 127 * 2 cannot
// overflow; int8 codes go in as |code| against the activations carrying the code's sign, 127 * 127
// * 2 < 32767), one widening add, one int-to-float conversion and one FMA with d * dx:
//   sum_i w_i x_i ~ d * dx * sum_i code_i q_i + m * dx * sum_i q_i.
// The second term (Q4 only) needs only the activations' block sums, computed once per row. Widening each
// weight to float32 instead (gemv.cpp's int8 / bf16 path) costs a conversion and an FMA per 8
// weights per row, which on cores with 128-bit vector units bounds a decode step by arithmetic
// rather than by the weight's bytes.
//
// Q4 layout: [out, in' / 2] bytes, in' = in padded to 32; per block of 32 inputs, 16 bytes whose
// byte j holds input j in its low nibble and input j + 16 in its high one (llama.cpp's order: the
// low nibbles of a 16-byte load are the first 16 inputs, the high ones the next 16). d and m are
// float32 [out, in' / G], G a power-of-two multiple of 32. Q8 layout: int8 [out, in'], d float32
// [out, in' / 32].
//
// Every output is one accumulator in block order, then its m term in block order, whatever the
// number of rows in the call or the threads: a row's result never depends on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <torch/library.h>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENOPS_BLOCKS_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // inputs per block
constexpr int kOutBlock = 4;         // weight rows side by side: independent accumulator chains
constexpr int kRowBlock = 2;         // activation rows per pass (4 x 2 accumulators fit 16 registers)
constexpr int64_t kRowChunk = 64;    // activation rows whose int8 copy stays in L2 while a slice of weights passes

// The activations of one call, quantised per block of 32 (zero past `k`).
struct QuantisedRows {
  std::vector<int8_t> q;  // [n, blocks * 32]
  std::vector<float> d;   // [n, blocks] scale
  std::vector<float> s;   // [n, blocks] d * sum(q)
};

void quantise_rows(const float* x, int64_t n, int64_t k, int64_t blocks, QuantisedRows& out) {
  out.q.assign(static_cast<size_t>(n * blocks * kBlock), 0);
  out.d.assign(static_cast<size_t>(n * blocks), 0.f);
  out.s.assign(static_cast<size_t>(n * blocks), 0.f);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + b * kBlock;
      const int64_t len = std::min<int64_t>(kBlock, k - b * kBlock);
      float amax = 0.f;
      for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float inv = d > 0.f ? 1.0f / d : 0.f;
      int8_t* qb = out.q.data() + (r * blocks + b) * kBlock;
      int sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        qb[i] = static_cast<int8_t>(v);
        sum += v;
      }
      out.d[r * blocks + b] = d;
      out.s[r * blocks + b] = d * static_cast<float>(sum);
    }
  }
}

struct Weights {
  const uint8_t* codes;
  const float* d;
  const float* m;     // Q4's offsets; nullptr for Q8
  int64_t row_bytes;  // blocks * bytes per block
  int64_t groups;     // per row
  int gshift;         // log2(G / 32): block b is in group b >> gshift
};

// the two code formats: bytes per block of 32, and (AVX2) the block's 8 int32 partial sums of
// code * q, or (portable) its integer dot
struct Q4 {
  static constexpr int64_t kBytes = 16;
#ifdef TOKENOPS_BLOCKS_AVX2
  static inline __m256i sums(const uint8_t* p, __m256i q) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1));
  }
#endif
  static inline int32_t dot(const uint8_t* p, const int8_t* q) {
    int32_t acc = 0;
    for (int i = 0; i < 16; ++i) acc += (p[i] & 15) * q[i] + (p[i] >> 4) * q[i + 16];
    return acc;
  }
};
struct Q8 {
  static constexpr int64_t kBytes = 32;
#ifdef TOKENOPS_BLOCKS_AVX2
  static inline __m256i sums(const uint8_t* p, __m256i q) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i prods = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(q, codes));
    return _mm256_madd_epi16(prods, _mm256_set1_epi16(1));
  }
#endif
  static inline int32_t dot(const uint8_t* p, const int8_t* q) {
    const int8_t* c = reinterpret_cast<const int8_t*>(p);
    int32_t acc = 0;
    for (int i = 0; i < 32; ++i) acc += c[i] * q[i];
    return acc;
  }
};

#ifdef TOKENOPS_BLOCKS_AVX2

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[j * R + r] = the block sums of weight rows o..o+OB against activation rows r0..r0+R
template <typename F, int OB, int R>
inline void dot_block(const Weights& w, int64_t o, const QuantisedRows& a, int64_t r0, int64_t blocks, float* out) {
  __m256 acc[OB * R];
#pragma GCC unroll 8
  for (int i = 0; i < OB * R; ++i) acc[i] = _mm256_setzero_ps();
  const uint8_t* wrow = w.codes + o * w.row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i q[R];
    float dx[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + ((r0 + r) * blocks + b) * kBlock));
      dx[r] = a.d[(r0 + r) * blocks + b];
    }
    const int64_t g = b >> w.gshift;
#pragma GCC unroll 4
    for (int j = 0; j < OB; ++j) {
      const uint8_t* p = wrow + j * w.row_bytes + b * F::kBytes;
      // one line ahead of the next block of weight rows, once per 64 bytes
      if ((b * F::kBytes) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + OB * w.row_bytes), _MM_HINT_T0);
      const float dw = w.d[(o + j) * w.groups + g];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256i sums = F::sums(p, q[r]);
        acc[j * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dw * dx[r]), acc[j * R + r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < OB * R; ++i) out[i] = hsum8(acc[i]);
}

#else

// portable: the same sums, one output at a time
template <typename F, int OB, int R>
inline void dot_block(const Weights& w, int64_t o, const QuantisedRows& a, int64_t r0, int64_t blocks, float* out) {
  for (int j = 0; j < OB; ++j) {
    const uint8_t* wrow = w.codes + (o + j) * w.row_bytes;
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t dot = F::dot(wrow + b * F::kBytes, a.q.data() + ((r0 + r) * blocks + b) * kBlock);
        acc += static_cast<float>(dot) * (w.d[(o + j) * w.groups + (b >> w.gshift)] * a.d[(r0 + r) * blocks + b]);
      }
      out[j * R + r] = acc;
    }
  }
}

#endif

template <typename F, int OB, int R>
inline void store_block(const Weights& w, int64_t o, const QuantisedRows& a, int64_t r0, int64_t blocks,
                        const float* bias, int64_t out_f, float* y) {
  float dots[OB * R];
  dot_block<F, OB, R>(w, o, a, r0, blocks, dots);
  for (int j = 0; j < OB; ++j) {
    for (int r = 0; r < R; ++r) {
      float offset = 0.f;
      if (w.m) {
        const float* m = w.m + (o + j) * w.groups;
        const float* s = a.s.data() + (r0 + r) * blocks;
        for (int64_t b = 0; b < blocks; ++b) offset += m[b >> w.gshift] * s[b];
      }
      y[(r0 + r) * out_f + o + j] = dots[j * R + r] + offset + (bias ? bias[o + j] : 0.f);
    }
  }
}

template <typename F, int OB>
inline void out_block(const Weights& w, int64_t o, const QuantisedRows& a, int64_t r_begin, int64_t r_end,
                      int64_t blocks, const float* bias, int64_t out_f, float* y) {
  int64_t r = r_begin;
  for (; r + kRowBlock <= r_end; r += kRowBlock) store_block<F, OB, kRowBlock>(w, o, a, r, blocks, bias, out_f, y);
  for (; r < r_end; ++r) store_block<F, OB, 1>(w, o, a, r, blocks, bias, out_f, y);
}

// the checks shared by both ops: x against the weight's padded width, the bias; y allocated
at::Tensor check_x(const at::Tensor& x, const at::Tensor& codes, int64_t padded, int64_t group_size,
                   const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), op, ": x must be contiguous float32");
  const int64_t k = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK(x.dim() >= 1 && k <= padded && k > padded - group_size, op, ": x's last dimension ", k,
              " does not match the weight's ", padded, " (padded) inputs");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == codes.size(0), op,
                ": bias must be a contiguous float32 [out] vector");
  auto sizes = x.sizes().vec();
  sizes.back() = codes.size(0);
  return at::empty(sizes, x.options());
}

void check_params(const at::Tensor& t, int64_t out_f, int64_t groups, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == out_f &&
                  t.size(1) == groups,
              what);
}

template <typename F>
void run(const at::Tensor& x, const Weights& w, int64_t blocks, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t k = x.size(-1), out_f = y.size(-1);
  const int64_t n = x.numel() / std::max<int64_t>(k, 1);
  if (n == 0 || out_f == 0) return;
  QuantisedRows a;
  quantise_rows(x.data_ptr<float>(), n, k, blocks, a);
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // ~16 KB of codes per task at least, in whole blocks of weight rows
  const int64_t grain = std::max<int64_t>(kOutBlock, (16384 / w.row_bytes) & ~int64_t(kOutBlock - 1));
  at::parallel_for(0, out_f, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < n; r0 += kRowChunk) {
      const int64_t r1 = std::min(n, r0 + kRowChunk);
      int64_t o = begin;
      for (; o + kOutBlock <= end; o += kOutBlock) out_block<F, kOutBlock>(w, o, a, r0, r1, blocks, b, out_f, yp);
      for (; o < end; ++o) out_block<F, 1>(w, o, a, r0, r1, blocks, b, out_f, yp);
    }
  });
}

// x float32 [..., in] @ (codes * d + m).T (+ bias) -> float32 [..., out]; codes uint8 [out, in' / 2]
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "linear_q4: codes must be a contiguous uint8 [out, in' / 2] matrix");
  TORCH_CHECK(group_size >= kBlock && group_size % kBlock == 0 && (group_size & (group_size - 1)) == 0,
              "linear_q4: group_size must be a power of two multiple of 32, got ", group_size);
  const int64_t out_f = codes.size(0), row_bytes = codes.size(1);
  TORCH_CHECK(row_bytes % Q4::kBytes == 0, "linear_q4: codes rows must hold whole blocks of 32 inputs");
  const int64_t blocks = row_bytes / Q4::kBytes, groups = blocks * kBlock / group_size;
  TORCH_CHECK(groups * group_size == blocks * kBlock, "linear_q4: the padded width is not whole groups");
  check_params(d, out_f, groups, "linear_q4: d and m must be contiguous float32 [out, in' / group_size]");
  check_params(m, out_f, groups, "linear_q4: d and m must be contiguous float32 [out, in' / group_size]");
  at::Tensor y = check_x(x, codes, blocks * kBlock, group_size, bias, "linear_q4");
  int gshift = 0;
  while ((kBlock << gshift) < group_size) ++gshift;
  run<Q4>(x, Weights{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), row_bytes, groups, gshift},
          blocks, bias, y);
  return y;
}

// x float32 [..., in] @ (codes * d).T (+ bias) -> float32 [..., out]; codes int8 [out, in'] in -127..127
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "linear_q8: codes must be a contiguous int8 [out, in'] matrix");
  const int64_t out_f = codes.size(0), row_bytes = codes.size(1);
  TORCH_CHECK(row_bytes % Q8::kBytes == 0, "linear_q8: codes rows must hold whole blocks of 32 inputs");
  const int64_t blocks = row_bytes / Q8::kBytes;
  check_params(d, out_f, blocks, "linear_q8: d must be a contiguous float32 [out, in' / 32]");
  at::Tensor y = check_x(x, codes, row_bytes, kBlock, bias, "linear_q8");
  run<Q8>(x, Weights{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), d.data_ptr<float>(), nullptr,
                     row_bytes, blocks, 0},
          blocks, bias, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("linear_q4(Tensor x, Tensor codes, Tensor d, Tensor m, int group_size, Tensor? bias) -> Tensor");
  m.impl("linear_q4", c10::DispatchKey::CPU, TORCH_FN(linear_q4));
  m.def("linear_q8(Tensor x, Tensor codes, Tensor d, Tensor? bias) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(linear_q8));
}
