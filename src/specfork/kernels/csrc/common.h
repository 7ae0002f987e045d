// Shared definitions of specfork's CPU kernels: instruction-set levels, number conversions,
// and the thread split every kernel uses.
//
// Batch invariance is the rule throughout: the value computed for one row (one token) never
// depends on how many rows share the call, on where a row sits among them, or on the number of
// threads. Work is split across threads by output columns, heads or rows only, never along a
// reduction, and every reduction runs in one fixed order.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pool.h"

// x86 vector code (AVX2, AVX-512) is compiled only for x86; elsewhere the portable C++ runs.
// SPECFORK_NO_X86 builds the portable code alone on x86 too (to check that it builds).
#if (defined(__x86_64__) || defined(__i386__)) && !defined(SPECFORK_NO_X86)
#define SF_X86 1
#include <immintrin.h>
#else
#define SF_X86 0
#endif

#define SF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define SF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SF_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,f16c,fma")))
// AMX int8 tiles (Sapphire Rapids and later), where the compiler knows them (GCC 11, Clang 12).
#if SF_X86 && ((defined(__clang__) && __clang_major__ >= 12) || \
               (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SF_HAVE_AMX 1
#define SF_AMX \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#else
#define SF_HAVE_AMX 0
#endif

namespace sf {

// Instruction-set levels, chosen once per process (SPECFORK_ISA=avx512|avx2|generic may lower
// it; avx512 keeps AVX-512 but leaves AMX tiles unused).
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

int isa_level();        // kGeneric, kAvx2 or kAvx512
bool has_avx512bf16();  // native bf16 dot products (vdpbf16ps)
bool has_amx_int8();    // AMX int8 tiles, enabled by the OS for this process (on AVX-512 only)
const char* isa_name();

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);  // IEEE half (exact)
uint16_t f32_to_f16(float f);  // round to nearest even

// Parts of a region per thread. One: a worker that is descheduled or asleep before it claims
// its part leaves it to the caller; more parts would also split a share a worker claimed and
// then lost its core over, but each part costs two atomic operations on lines both threads
// write (2 parts a thread: +0.3 us a region, ~1.5% of a decoding step; 4 or 16: forwards of
// 16-64 rows 5-20% slower), and an adaptive pool backs off on busy cores anyway.
constexpr int64_t kPartsPerThread = 1;

// Splits [0, n) over the kernels' threads (pool.h); `fn(begin, end)` runs on each part.
template <typename F>
inline void parallel(int64_t n, F&& fn) {
  if (n <= 0) return;
  using Fn = std::remove_reference_t<F>;
  pool_run(n, kPartsPerThread,
           [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); },
           const_cast<void*>(static_cast<const void*>(&fn)));
}

// fn(begin, end) over rows [0, n): split over the threads from `min_rows` rows (a parallel
// region costs microseconds, more than a few rows of element-wise work), in one call below.
// Each row's result is the same either way.
template <typename F>
inline void parallel_rows(int64_t n, int64_t min_rows, F&& fn) {
  if (n >= min_rows)
    parallel(n, fn);
  else if (n > 0)
    fn(0, n);
}

// Runs fn(i) for every i in [0, n), threads taking the next item as they finish one (for items
// of uneven cost). `init()` makes each thread's scratch state, passed to fn.
template <typename Init, typename F>
inline void parallel_dynamic(int64_t n, Init&& init, F&& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto part = [&](int64_t, int64_t) {  // a part per thread; each takes items until none is left
    auto state = init();
    for (int64_t i = next++; i < n; i = next++) fn(i, state);
  };
  pool_run(n, 1, [](void* ctx, int64_t b, int64_t e) { (*static_cast<decltype(part)*>(ctx))(b, e); },
           &part);
}

// Denormal floats flushed to zero and read as zero (MXCSR FTZ | DAZ) while a kernel call runs
// (the pool's threads keep it for good): a product or exponential that underflows otherwise
// costs a microcode assist per operation. Random-weight models whose SiLU saturates ran 8-row
// forwards 3x slower than with the flush (docs/benchmarks.md). Every path of a call runs under
// it, so rows stay batch-invariant; only values below 1.2e-38 change (to zero).
#if SF_X86
inline void flush_denormals_for_good() { _mm_setcsr(_mm_getcsr() | 0x8040); }
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};
#else
inline void flush_denormals_for_good() {}
struct FlushDenormals {};
#endif

}  // namespace sf
