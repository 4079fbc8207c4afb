// AMX's tile state, shared by the kernels that use the tiles (linear_amx.h's int8 products,
// paged_attention.cpp's bf16 ones). A header, not a .cpp: the build compiles csrc/*.cpp and hashes
// csrc/*.h with them.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tokenops {

// Linux gives a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// ldtilecfg's 64-byte operand, palette 1: each kernel fills in its tiles' shapes; the configuration is
// per thread, so a kernel loads its own before its first tile instruction and releases the tiles after
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole 64 bytes as its operand: GCC's _tile_loadconfig names only the first 8 as
// read, so the optimiser may drop the stores of the tiles' shapes before it (an invalid configuration
// faults)
inline void load_tile_config(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }

}  // namespace tokenops
#endif
