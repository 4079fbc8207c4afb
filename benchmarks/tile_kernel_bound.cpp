// Instruction-throughput probes for tile_kernel_bound.py (x86 with AVX2 and FMA; built with g++ -O2
// -march=native). Each probe runs a fixed block of independent register-only instructions many times
// and prints the cycles one block takes, the clock taken from a chain of dependent scalar adds (one
// cycle each). Output: one JSON object on stdout.
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr int64_t kLoops = 40000000;

template <class F>
double ns_per_loop(F f) {
  const auto a = std::chrono::steady_clock::now();
  f();
  const auto b = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(b - a).count() / kLoops;
}

#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

// 8 multiply-adds into 8 registers, nothing depending on anything else in the block
#define EIGHT(op) \
  op " %%ymm15, %%ymm14, %%ymm0\n " op " %%ymm15, %%ymm14, %%ymm1\n " op " %%ymm15, %%ymm14, %%ymm2\n " \
  op " %%ymm15, %%ymm14, %%ymm3\n " op " %%ymm15, %%ymm14, %%ymm4\n " op " %%ymm15, %%ymm14, %%ymm5\n " \
  op " %%ymm15, %%ymm14, %%ymm6\n " op " %%ymm15, %%ymm14, %%ymm7\n"

}  // namespace

int main() {
  asm volatile("vpxor %%ymm15, %%ymm15, %%ymm15\n vpcmpeqb %%ymm14, %%ymm14, %%ymm14" ::: CLOBBER);
  int64_t x = 1;
  const double ns_per_cycle = ns_per_loop([&] {
                                for (int64_t i = 0; i < kLoops; ++i)
                                  asm volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0" : "+r"(x));
                              }) / 4;
  const double maddubs = ns_per_loop([] {
    for (int64_t i = 0; i < kLoops; ++i) asm volatile(EIGHT("vpmaddubsw") ::: CLOBBER);
  });
  const double fma = ns_per_loop([] {
    for (int64_t i = 0; i < kLoops; ++i) asm volatile(EIGHT("vfmadd231ps") ::: CLOBBER);
  });
  // One activation row against one Q4 tile block (8 weight rows x 32 inputs): the shipped AVX2 loop's
  // work per row and block, with a quarter of the block's unpacking (it serves 4 rows): 8 vpmaddubsw,
  // 7 int16 adds, the widening vpmaddwd, the conversion, d * dx, two FMAs, and 1 and + 1 shift.
#define Q4_MIX                                                                                          \
  EIGHT("vpmaddubsw")                                                                                   \
  "vpaddw %%ymm0, %%ymm1, %%ymm1\n vpaddw %%ymm2, %%ymm3, %%ymm3\n"                                     \
  "vpaddw %%ymm4, %%ymm5, %%ymm5\n vpaddw %%ymm6, %%ymm7, %%ymm7\n"                                     \
  "vpaddw %%ymm1, %%ymm3, %%ymm3\n vpaddw %%ymm5, %%ymm7, %%ymm7\n"                                     \
  "vpaddw %%ymm3, %%ymm7, %%ymm7\n vpmaddwd %%ymm15, %%ymm7, %%ymm7\n"                                  \
  "vcvtdq2ps %%ymm7, %%ymm7\n vpand %%ymm15, %%ymm11, %%ymm11\n vpsrlw $4, %%ymm12, %%ymm12\n"         \
  "vmulps %%ymm15, %%ymm13, %%ymm13\n vfmadd231ps %%ymm7, %%ymm13, %%ymm8\n"                            \
  "vfmadd231ps %%ymm15, %%ymm15, %%ymm9\n"
  const double q4_row_block = ns_per_loop([] {
    for (int64_t i = 0; i < kLoops; ++i) asm volatile(Q4_MIX ::: CLOBBER);
  });
  // The same with the loop's loads from L1: the 8 activation quads broadcast to the lanes (vpbroadcastd),
  // the row's dx and block sum (vbroadcastss) and a quarter of the block's 4 code loads
  alignas(64) static const int32_t l1[16] = {};
  const int32_t* src = l1;
  const double q4_row_block_loads = ns_per_loop([src] {
    for (int64_t i = 0; i < kLoops; ++i)
      asm volatile(Q4_MIX
                   "vpbroadcastd (%0), %%ymm10\n vpbroadcastd 4(%0), %%ymm10\n vpbroadcastd 8(%0), %%ymm10\n"
                   "vpbroadcastd 12(%0), %%ymm10\n vpbroadcastd 16(%0), %%ymm10\n vpbroadcastd 20(%0), %%ymm10\n"
                   "vpbroadcastd 24(%0), %%ymm10\n vpbroadcastd 28(%0), %%ymm10\n vbroadcastss 32(%0), %%ymm10\n"
                   "vbroadcastss 36(%0), %%ymm10\n vmovdqu (%0), %%ymm10\n" ::"r"(src)
                   : CLOBBER);
  });
  // The Q8_0 loop's per row and block: per chunk of 4 inputs the sign trick (vpsignb), vpmaddubsw and
  // the widening vpmaddwd, then 7 int32 adds, the conversion, d * dx and one FMA (plus a quarter of
  // the block's 8 vpsignb magnitudes: 2).
  const double q8_row_block = ns_per_loop([] {
    for (int64_t i = 0; i < kLoops; ++i)
      asm volatile(EIGHT("vpsignb") EIGHT("vpmaddubsw") EIGHT("vpmaddwd")
                   "vpaddd %%ymm0, %%ymm1, %%ymm1\n vpaddd %%ymm2, %%ymm3, %%ymm3\n"
                   "vpaddd %%ymm4, %%ymm5, %%ymm5\n vpaddd %%ymm6, %%ymm7, %%ymm7\n"
                   "vpaddd %%ymm1, %%ymm3, %%ymm3\n vpaddd %%ymm5, %%ymm7, %%ymm7\n"
                   "vpaddd %%ymm3, %%ymm7, %%ymm7\n vcvtdq2ps %%ymm7, %%ymm7\n"
                   "vpsignb %%ymm15, %%ymm11, %%ymm11\n vpsignb %%ymm15, %%ymm12, %%ymm12\n"
                   "vmulps %%ymm15, %%ymm13, %%ymm13\n vfmadd231ps %%ymm7, %%ymm13, %%ymm8\n" ::: CLOBBER);
  });
  std::printf(
      "{\"ghz\": %.3f, \"cycles\": {\"vpmaddubsw_ymm\": %.3f, \"vfmadd231ps_ymm\": %.3f, "
      "\"q4_row_block_mix\": %.3f, \"q4_row_block_mix_with_loads\": %.3f, \"q8_row_block_mix\": %.3f}, "
      "\"sink\": %lld}\n",
      1.0 / ns_per_cycle, maddubs / ns_per_cycle / 8, fma / ns_per_cycle / 8, q4_row_block / ns_per_cycle,
      q4_row_block_loads / ns_per_cycle, q8_row_block / ns_per_cycle, static_cast<long long>(x & 1));
  return 0;
}
