// Llama decoder layers with int4 tile weights as one call (models/llama.py's `_one_call_run`): per layer
// the same native ops as the layer's Python path, in the same order on the same tensors, so the same bits,
// called through the dispatcher from C++ (the gate|up projection and its activation as the one op that
// gives the two ops' bits). A call of a small op from Python costs 4-5 us of argument
// parsing and dispatch; a one-row step makes about nine per layer, a fifth of its time on the EPYC
// AVX-512 kind (docs/benchmarks.md, engine_step_profile.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <optional>
#include <torch/library.h>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor rms_norm(const at::Tensor& x, const OptTensor& residual, const at::Tensor& w, double eps) {
  static const auto f = op<at::Tensor(const at::Tensor&, const OptTensor&, const at::Tensor&, double, bool)>(
      "tokenops::rms_norm");
  return f.call(x, residual, w, eps, false);
}

// weights[3i .. 3i + 2]: projection i's codes, d and m (qkv, o, gate|up, down)
at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& out,
                  const c10::List<OptTensor>& biases, int64_t i, int64_t group_size) {
  static const auto f = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, int64_t, const OptTensor&)>("tokenops::linear_q4");
  return f.call(x, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], out[i], group_size, biases.get(i));
}

// h: the previous layer's output, residual: the stream before it, updated in place as the Python path's
// fused norms do; k_scale and v_scale: an int8 cache's float16 scales (None for a float cache);
// -> this layer's output
at::Tensor llama_layer_q4(
    const at::Tensor& h, at::Tensor& residual, const at::Tensor& input_norm, const at::Tensor& post_norm,
    double eps, at::TensorList weights, at::IntArrayRef out_features, int64_t group_size,
    const c10::List<OptTensor>& biases, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
    at::Tensor& v_cache, const OptTensor& k_scale, const OptTensor& v_scale, const at::Tensor& slots,
    const at::Tensor& tables, const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& lens,
    const OptTensor& gaps, double scale, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(weights.size() == 12 && out_features.size() == 4 && biases.size() == 4,
              "llama_layers_q4: per layer 4 projections (qkv, o, gate|up, down), each codes, d and m");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && residual.is_contiguous(),
              "llama_layers_q4: h and residual must be contiguous [T, hidden]");
  static const auto rotary_store = op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                           at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&,
                                           const OptTensor&)>("tokenops::rotary_store_kv_");
  static const auto attend =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                    int64_t, double)>("tokenops::paged_prefill_attention");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("tokenops::silu_mul");
  static const auto gate_up_silu =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(
          "tokenops::linear_q4_silu_mul");
  const std::vector<at::Tensor> w = weights.vec();
  const std::vector<int64_t> out = out_features.vec();
  const int64_t head_dim = out[0] / (heads + 2 * kv_heads);
  at::Tensor x = rms_norm(h, residual, input_norm, eps);
  at::Tensor qkv = linear(x, w, out, biases, 0, group_size);
  rotary_store.call(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, k_scale, v_scale);
  const at::Tensor q = qkv.view({-1, heads + 2 * kv_heads, head_dim}).slice(1, 0, heads);
  const at::Tensor o =
      attend.call(q, k_cache, v_cache, k_scale, v_scale, tables, q_start, q_len, lens, gaps, 0, scale);
  at::Tensor attn = linear(o.reshape({-1, heads * head_dim}), w, out, biases, 1, group_size);
  x = rms_norm(attn, residual, post_norm, eps);
  // the gate|up projection and its activation in one pass where it has no bias (the same bits)
  const at::Tensor act = biases.get(2).has_value()
                             ? silu_mul.call(linear(x, w, out, biases, 2, group_size))
                             : gate_up_silu.call(x, w[6], w[7], w[8], out[2], group_size);
  return linear(act, w, out, biases, 3, group_size);
}

// Consecutive layers as one call (the op): llama_layer_q4 per layer i on its 2 norms (norms[2i..]), 12
// weights (weights[12i..]), 4 biases (biases[4i..]) and cache (k_caches[i], ...), the step's attention
// arguments shared. A step's Python makes one call instead of one per layer (~30 us each: argument
// lists built and parsed).
at::Tensor llama_layers_q4(
    const at::Tensor& h, at::Tensor& residual, at::TensorList norms, double eps, at::TensorList weights,
    at::IntArrayRef out_features, int64_t group_size, const c10::List<OptTensor>& biases, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const c10::List<OptTensor>& k_scales,
    const c10::List<OptTensor>& v_scales, const at::Tensor& slots, const at::Tensor& tables,
    const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& lens, const OptTensor& gaps,
    double scale, int64_t heads, int64_t kv_heads) {
  const int64_t n = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * n && static_cast<int64_t>(weights.size()) == 12 * n &&
                  static_cast<int64_t>(biases.size()) == 4 * n && static_cast<int64_t>(v_caches.size()) == n &&
                  static_cast<int64_t>(k_scales.size()) == n && static_cast<int64_t>(v_scales.size()) == n,
              "llama_layers_q4: per layer 2 norms, 12 weights, 4 biases, a key and a value cache and their scales");
  at::Tensor x = h;
  for (int64_t i = 0; i < n; ++i) {
    c10::List<OptTensor> b;
    for (int64_t j = 0; j < 4; ++j) b.push_back(biases.get(4 * i + j));
    at::Tensor k = k_caches[i], v = v_caches[i];
    x = llama_layer_q4(x, residual, norms[2 * i], norms[2 * i + 1], eps, weights.slice(12 * i, 12), out_features,
                       group_size, b, cos, sin, k, v, k_scales.get(i), v_scales.get(i), slots, tables, q_start, q_len,
                       lens, gaps, scale, heads, kv_heads);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def(
      "llama_layers_q4(Tensor h, Tensor(a!) residual, Tensor[] norms, float eps, Tensor[] weights, "
      "int[] out_features, int group_size, Tensor?[] biases, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor?[] k_scales, Tensor?[] v_scales, Tensor slots, Tensor tables, "
      "Tensor q_start, Tensor q_len, Tensor lens, Tensor? gaps, float scale, int heads, int kv_heads) -> Tensor");
  m.impl("llama_layers_q4", c10::DispatchKey::CPU, TORCH_FN(llama_layers_q4));
}
