#include "common.h"

#include <cstdlib>
#include <string>

#if SF_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sf {

static int detect_isa() {
  int level = kGeneric;
#if SF_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    level = kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma"))
    level = kAvx512;
#endif
  const char* env = std::getenv("SPECFORK_ISA");
  if (env != nullptr && std::string(env) == "generic") level = kGeneric;
  if (env != nullptr && std::string(env) == "avx2" && level > kAvx2) level = kAvx2;
  return level;
}

int isa_level() {
  static const int level = detect_isa();
  return level;
}

bool has_avx512bf16() {
#if SF_X86
  static const bool yes = isa_level() == kAvx512 && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// AMX needs the CPU (CPUID 7.0 EDX bits 24 tile, 25 int8), the OS saving tile state (XCR0 bits
// 17-18) and, on Linux, this process's permission to use tile data (arch_prctl, once).
static bool detect_amx() {
#if SF_X86 && SF_HAVE_AMX && defined(__linux__)
  if (isa_level() != kAvx512) return false;
  const char* env = std::getenv("SPECFORK_ISA");
  if (env != nullptr && std::string(env) == "avx512") return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
    return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
  return false;
#endif
}

bool has_amx_int8() {
  static const bool yes = detect_amx();
  return yes;
}

const char* isa_name() {
  if (isa_level() == kAvx512 && has_amx_int8())
    return has_avx512bf16() ? "avx512-vnni-bf16-amx" : "avx512-vnni-amx";
  if (isa_level() == kAvx512) return has_avx512bf16() ? "avx512-vnni-bf16" : "avx512-vnni";
  if (isa_level() == kAvx2) return "avx2";
  return "generic";
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow → inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 23) - 112) << 10 | (abs >> 13 & 0x3ffu);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

}  // namespace sf
