// What the CPU kernels (gguf_matmul_cpu.cpp, cpu_decode_ops.cpp) share: the run-time AVX2 check
// and the horizontal sum of a vector. Built without -mavx2: AVX2 code is chosen at run time.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FD_X86 1

namespace fastdeploy_ops {

// AVX2 with FMA and F16C (every AVX2 CPU has both).
inline bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace fastdeploy_ops
#else
namespace fastdeploy_ops {
inline bool has_avx2() { return false; }
}  // namespace fastdeploy_ops
#endif
