// Quantise this step's keys or values to int8 and write them into their cache slots, in one pass.
//
// Bitwise the same as tokenops.engine.kv_cache.quantize + index_copy_ (a dozen torch ops per layer
// and tensor): kv_int8.h's per (token, kv head) rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_int8.h"

namespace {

template <typename T>
void quantize_rows(const T* x, int8_t* data, at::Half* scale, const int64_t* slots, int64_t tokens, int64_t heads,
                   int64_t d) {
  at::parallel_for(0, tokens * heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t dst = slots[r / heads] * heads + r % heads;
      quantise_kv_head(x + r * d, d, data + dst * d, scale + dst);
    }
  });
}

void quantize_kv_into(const at::Tensor& x, at::Tensor& data, at::Tensor& scale, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && data.dim() == 4 && data.scalar_type() == at::kChar && data.is_contiguous() &&
                  data.size(2) == x.size(1) && data.size(3) == x.size(2),
              "quantize_kv_into: x must be [T, KV, D] and data a contiguous int8 [blocks, block_size, KV, D]");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == data.numel() / data.size(3),
              "quantize_kv_into: scale must be contiguous float16, one per (slot, kv head)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "quantize_kv_into: one int64 slot per token");
  const int64_t num_slots = data.size(0) * data.size(1);
  at::Tensor s = slots.contiguous(), xc = x.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.numel(); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "quantize_kv_into: slot out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_kv_into", [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), data.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), sp,
                            x.size(0), x.size(1), x.size(2));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("quantize_kv_into(Tensor x, Tensor(a!) data, Tensor(b!) scale, Tensor slots) -> ()");
  m.impl("quantize_kv_into", c10::DispatchKey::CPU, TORCH_FN(quantize_kv_into));
}
