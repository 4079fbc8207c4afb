// One cache slot's keys or values of one kv head in int8, shared by quantize_kv_into and
// rotary_store_kv_ so both write the bits tokenops.engine.kv_cache.quantize does: the float16 scale
// is max|x| / 127 (at least 1e-7), rounded to float16 first; the values are round-half-even(x / scale)
// clamped to [-127, 127]. A header, not a .cpp: the build compiles csrc/*.cpp and hashes csrc/*.h.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>

template <typename T>
inline void quantise_kv_head(const T* x, int64_t d, int8_t* q, at::Half* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  const at::Half s = static_cast<at::Half>(std::max(amax / 127.0f, 1e-7f));
  const float sf = static_cast<float>(s);
  for (int64_t i = 0; i < d; ++i)
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[i]) / sf), -127.f, 127.f));
  *scale = s;
}
