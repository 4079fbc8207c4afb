// Cephes' expf as a polynomial the compiler vectorises (libm's expf is scalar here), accurate to a
// couple of float32 ulp, which is what torch's own vectorised exp promises. Shared by the gated
// activations (activations.cpp) and the sampler (sample_rows.cpp). A header, not a .cpp: the build
// compiles csrc/*.cpp and hashes csrc/*.h with them.
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenops {

// e^x = 2^n * e^r with |r| <= ln2/2, a degree-6 polynomial for e^r
inline float exp_poly(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // 2^n stays a normal float
  // round to nearest by adding 1.5 * 2^23 (std::floor would keep the loop from vectorising)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace tokenops
