// Rotary position embedding applied in place to q and k together ([T, heads, D], rotate-half).
//
// Matches tokenops.engine.models.layers.apply_rotary, which follows HF: x * cos + rotate_half(x) * sin
// with cos/sin cast to x's dtype and each product and the sum rounded to it. `cos` and `sin` are
// float32 [T, D/2] (the two halves of HF's table are equal), computed once per step and shared by
// every layer. q and k may be row-strided views of the fused qkv output: only heads and D must be
// dense, so the split costs no copy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

namespace {

// one rounding to T, as torch's elementwise ops in T do (a no-op for float)
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
void rotate_heads(T* x, int64_t row_stride, int64_t heads, int64_t d, const float* cos, const float* sin,
                  int64_t rows) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = j / heads;
      T* a = x + t * row_stride + (j % heads) * d;
      T* b = a + half;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
        const float ai = static_cast<float>(a[i]), bi = static_cast<float>(b[i]);
        a[i] = static_cast<T>(round_to<T>(ai * ci) + round_to<T>(-bi * si));
        b[i] = static_cast<T>(round_to<T>(bi * ci) + round_to<T>(ai * si));
      }
    }
  });
}

void check_heads(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "rotary_: ", name, " must be a CPU tensor [T, heads, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: ", name, "'s heads and head_dim must be contiguous (rows may be strided)");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == 2 * cos.size(1),
              "rotary_: ", name, " must have cos's rows and twice its width");
}

void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "rotary_: cos and sin must be contiguous float32 [T, D/2]");
  check_heads(q, cos, "q");
  check_heads(k, cos, "k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_: q and k must have one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_", [&] {
    for (const at::Tensor* x : {&q, &k}) {
      rotate_heads<scalar_t>(x->data_ptr<scalar_t>(), x->stride(0), x->size(1), x->size(2), cos.data_ptr<float>(),
                             sin.data_ptr<float>(), x->size(0));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
}
