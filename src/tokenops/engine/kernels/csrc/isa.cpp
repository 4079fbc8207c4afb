// Which vector paths this build of the kernels compiled (TOKENOPS_KERNEL_ISA picks the -march): the
// sources choose AVX-512, AVX2 or portable code from the same macros tested here.
#include <string>
#include <torch/library.h>

#include "int8_dot.h"

namespace {

std::string compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// The integer dot product of the block-quantised linears (linear_blocks.cpp, int8_dot.h): vpdpbusd
// where the target has AVX-VNNI or AVX512-VNNI with VL, else AVX2's vpmaddubsw + vpmaddwd, else scalar.
std::string compiled_int8_dot() {
#if defined(TOKENOPS_BLOCKS_VNNI)
  return "vnni";
#elif defined(TOKENOPS_BLOCKS_AVX2)
  return "maddubs";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("compiled_isa() -> str");
  m.impl("compiled_isa", c10::DispatchKey::CatchAll, TORCH_FN(compiled_isa));
  m.def("compiled_int8_dot() -> str");
  m.impl("compiled_int8_dot", c10::DispatchKey::CatchAll, TORCH_FN(compiled_int8_dot));
}
