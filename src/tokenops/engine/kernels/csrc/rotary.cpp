// Rotary position embedding applied in place to q and k together ([T, heads, D], rotate-half).
//
// Matches tokenops.engine.models.layers.apply_rotary, which follows HF: x * cos + rotate_half(x) * sin
// with cos/sin cast to x's dtype and each product and the sum rounded to it. `cos` and `sin` are
// float32 [T, D/2] (the two halves of HF's table are equal), computed once per step and shared by
// every layer. q and k may be row-strided views of the fused qkv output: only heads and D must be
// dense, so the split costs no copy.
//
// rotary_store_kv_ is the attention's whole prologue on a fused qkv row [q heads | k heads | v heads]
// in one call: q and k rotated in place, then k and v copied into their flat KV slots (cast to the
// cache's dtype, as write_kv's index_copy_ does; into an int8 cache quantised per slot and kv head
// with its float16 scales, as write_kv's quantize_kv_into does). A decode step of a small model
// spends as long in the dozen Python-level calls this replaces per layer (split, views, rotary_,
// views, casts, index_copy_) as in some of its kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstring>
#include <optional>
#include <type_traits>
#include <torch/library.h>

#include "kv_int8.h"

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

// one token's kv heads [KV * D] from the qkv row into a cache slot, cast to the cache's dtype
template <typename S, typename C>
inline void store_heads(const S* src, C* dst, int64_t n) {
  if constexpr (std::is_same_v<S, C>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
  }
}

template <typename S>
void store_kv(const S* qkv, int64_t row, int64_t k_off, int64_t v_off, int64_t width, const int64_t* slots,
              int64_t rows, at::Tensor& k_cache, at::Tensor& v_cache) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "rotary_store_kv_", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        store_heads(qkv + t * row + k_off, kc + slots[t] * width, width);
        store_heads(qkv + t * row + v_off, vc + slots[t] * width, width);
      }
    });
  });
}

// the int8 cache: each token's kv heads quantised into their slot, scale [slot * kv_heads + h]
template <typename S>
void store_kv_int8(const S* qkv, int64_t row, int64_t k_off, int64_t v_off, int64_t kv_heads, int64_t d,
                   const int64_t* slots, int64_t rows, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& k_scale, const at::Tensor& v_scale) {
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  at::Half* ks = k_scale.data_ptr<at::Half>();
  at::Half* vs = v_scale.data_ptr<at::Half>();
  at::parallel_for(0, rows * kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = j / kv_heads, h = j % kv_heads, dst = slots[t] * kv_heads + h;
      quantise_kv_head(qkv + t * row + k_off + h * d, d, kc + dst * d, ks + dst);
      quantise_kv_head(qkv + t * row + v_off + h * d, d, vc + dst * d, vs + dst);
    }
  });
}

void rotary_store_kv_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "rotary_store_kv_: cos and sin must be contiguous float32 [T, D/2]");
  const int64_t T = cos.size(0), D = 2 * cos.size(1);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && D > 0, "rotary_store_kv_: head counts and head_dim must be positive");
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(0) == T &&
                  qkv.size(1) == (heads + 2 * kv_heads) * D,
              "rotary_store_kv_: qkv must be a contiguous CPU [T, (heads + 2 * kv_heads) * head_dim] matrix");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(2) == kv_heads && k_cache.size(3) == D,
              "rotary_store_kv_: caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  const auto ct = k_cache.scalar_type();
  const bool int8 = ct == at::kChar;
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf || int8,
              "rotary_store_kv_: caches must be float32, bfloat16, float16 or int8");
  TORCH_CHECK(int8 ? k_scale && v_scale : !k_scale && !v_scale,
              "rotary_store_kv_: an int8 cache takes k_scale and v_scale, a float cache neither");
  for (const auto* s : {&k_scale, &v_scale})
    if (*s)
      TORCH_CHECK((*s)->scalar_type() == at::kHalf && (*s)->is_contiguous() &&
                      (*s)->numel() == k_cache.numel() / D,
                  "rotary_store_kv_: scales must be contiguous float16, one per (slot, kv head)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T,
              "rotary_store_kv_: slots must be int64 [T]");
  const at::Tensor slots_c = slots.contiguous();
  const int64_t* sl = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "rotary_store_kv_: slot ", sl[t], " is out of the cache's range");
  const int64_t row = qkv.size(1), k_off = heads * D, v_off = (heads + kv_heads) * D, width = kv_heads * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_store_kv_", [&] {
    scalar_t* x = qkv.data_ptr<scalar_t>();
    rotate_heads<scalar_t>(x, row, heads, D, cos.data_ptr<float>(), sin.data_ptr<float>(), T);
    rotate_heads<scalar_t>(x + k_off, row, kv_heads, D, cos.data_ptr<float>(), sin.data_ptr<float>(), T);
    if (int8) {
      store_kv_int8<scalar_t>(x, row, k_off, v_off, kv_heads, D, sl, T, k_cache, v_cache, *k_scale, *v_scale);
    } else {
      store_kv<scalar_t>(x, row, k_off, v_off, width, sl, T, k_cache, v_cache);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.def(
      "rotary_store_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, "
      "int heads, int kv_heads, Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None) -> ()");
  m.impl("rotary_store_kv_", c10::DispatchKey::CPU, TORCH_FN(rotary_store_kv_));
}
