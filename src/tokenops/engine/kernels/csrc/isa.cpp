// Which vector paths this build of the kernels compiled (TOKENOPS_KERNEL_ISA picks the -march): the
// sources choose AVX-512, AVX2 or portable code from the same macros tested here.
#include <string>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenops, m) {
  m.def("compiled_isa() -> str");
  m.impl("compiled_isa", c10::DispatchKey::CatchAll, TORCH_FN(compiled_isa));
}
