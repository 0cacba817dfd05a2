// y = x @ w.t() with w held as the GGUF file's own blocks (Q4_1 or Q8_0), on the CPU.
//
// The weight is gguf's float32 dequantization of it (Q4_1: w = q * d + m, Q8_0: w = q * d, d and
// m float16 widened to float32), with float32 activations and accumulators: the result is the
// dense float32 matmul on the dequantized weight, up to float32 rounding. Each decode step then
// reads 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32.
//
// Three regimes by the number of rows M of x:
//   M == 1         one pass over the blocks: Q8_0 dequantized in registers and used at once, Q4_1
//                  as sum_g d_g * (q_g . x_g) + m_g * sum(x_g) (float32 either way);
//   2 <= M <= 128  a thread dequantizes a tile of 8 weight rows into a buffer it reuses for
//                  every row of x;
//   M > 128        (prefill) the whole weight is dequantized once and handed to at::mm.
// The AVX2 kernels are chosen at run time; other CPUs take the portable loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace fastdeploy_ops {
namespace {

constexpr int64_t kBlock = 32;       // weights per GGUF block (both types)
constexpr int64_t kQ4_1Bytes = 20;   // float16 d, float16 m, 16 bytes of two codes each
constexpr int64_t kQ8_0Bytes = 34;   // float16 d, 32 int8 codes
constexpr int64_t kTileRows = 8;     // weight rows a thread dequantizes at once for 2 <= M <= 128
constexpr int64_t kMaxGemvRows = 128;  // past this, one dequantization of the weight pays for at::mm

enum GgufType : int64_t { kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type ids

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One block's 32 float32 weights, in element order.
void dequantize_block(const uint8_t* b, int64_t type, float* out) {
  const float d = half_to_float(load_u16(b));
  if (type == kQ4_1) {
    const float m = half_to_float(load_u16(b + 2));
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
      out[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
  }
}

int64_t block_bytes(int64_t type) { return type == kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes; }

#ifdef FD_X86
// The block's weights as four vectors of 8 (elements 0-7, 8-15, 16-23, 24-31).
__attribute__((target("avx2,fma,f16c"))) inline void dequantize_block_avx2(const uint8_t* b, int64_t type,
                                                                           __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
  if (type == kQ4_1) {
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_and_si128(qs, _mm_set1_epi8(0x0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0f));
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d, m);
    }
  } else {
    const uint8_t* qs = b + 2;
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
}

// Q8_0, y[n] = w[n] . x for rows [begin, end) of w, x one row of K floats: each block
// dequantized in registers and used at once. This reads the codes about as fast as memory
// gives them; factoring d out as for Q4_1 below measured no faster.
__attribute__((target("avx2,fma,f16c"))) void gemv_q8_0_avx2(const float* x, const uint8_t* blocks, int64_t k,
                                                             int64_t begin, int64_t end, float* y) {
  const int64_t nb = k / kBlock;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = blocks + n * nb * kQ8_0Bytes;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < nb; ++g) {
      __m256 w[4];
      dequantize_block_avx2(row + g * kQ8_0Bytes, kQ8_0, w);
      const float* xg = x + g * kBlock;
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i), acc[i]);
    }
    y[n] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
}

// Q4_1 block b's share of a row's dot product with x's block xg: d * (q . xg) as 8 partial sums,
// and m (for m * sum(xg)). Both 128-bit lanes hold the block's 16 bytes; in-lane shuffles widen
// bytes 0-7 and 8-15 to 32 bits, whose low and high nibbles are elements j and j + 16.
__attribute__((target("avx2,fma,f16c"))) inline __m256 q4_1_block_dot_avx2(const uint8_t* b, const float* xg,
                                                                           __m256i widen_first,
                                                                           __m256i widen_second, float* m) {
  uint32_t dm;  // float16 d, then float16 m
  std::memcpy(&dm, b, 4);
  const __m128 scale_min = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
  *m = _mm_cvtss_f32(_mm_movehdup_ps(scale_min));
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
  const __m256i first = _mm256_shuffle_epi8(bytes, widen_first);
  const __m256i second = _mm256_shuffle_epi8(bytes, widen_second);
  const __m256i low = _mm256_set1_epi32(0x0f);
  __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, low)), _mm256_loadu_ps(xg));
  __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, low)), _mm256_loadu_ps(xg + 8));
  p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), _mm256_loadu_ps(xg + 16), p0);
  p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), _mm256_loadu_ps(xg + 24), p1);
  return _mm256_mul_ps(_mm256_add_ps(p0, p1), _mm256_broadcastss_ps(scale_min));
}

// Q4_1, y[n] = sum_g d_g * (q_g . x_g) + m_g * xsum_g for rows [begin, end) of w, x one row of K
// floats with per-block sums xsum. The codes convert exactly to float, so this is the dense
// float32 product on the dequantized weight up to float32 rounding, without the multiply-add per
// weight that dequantizing costs: that work, not the memory read, bounded the step.
__attribute__((target("avx2,fma,f16c"))) void gemv_q4_1_avx2(const float* x, const float* xsum,
                                                             const uint8_t* blocks, int64_t k, int64_t begin,
                                                             int64_t end, float* y) {
  const int64_t nb = k / kBlock;
  const __m256i widen_first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,  //
                                               4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i widen_second = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,  //
                                                12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = blocks + n * nb * kQ4_1Bytes;
    // Blocks two at a time into two accumulators, so that consecutive blocks do not wait on each other.
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offset0 = 0.f, offset1 = 0.f, m0, m1;  // sum_g m_g * xsum_g
    int64_t g = 0;
    for (; g + 2 <= nb; g += 2) {
      acc0 = _mm256_add_ps(acc0, q4_1_block_dot_avx2(row + g * kQ4_1Bytes, x + g * kBlock, widen_first,
                                                     widen_second, &m0));
      acc1 = _mm256_add_ps(acc1, q4_1_block_dot_avx2(row + (g + 1) * kQ4_1Bytes, x + (g + 1) * kBlock,
                                                     widen_first, widen_second, &m1));
      offset0 += m0 * xsum[g];
      offset1 += m1 * xsum[g + 1];
    }
    if (g < nb) {
      acc0 = _mm256_add_ps(acc0, q4_1_block_dot_avx2(row + g * kQ4_1Bytes, x + g * kBlock, widen_first,
                                                     widen_second, &m0));
      offset0 += m0 * xsum[g];
    }
    y[n] = hsum(_mm256_add_ps(acc0, acc1)) + (offset0 + offset1);
  }
}

__attribute__((target("avx2,fma,f16c"))) void dequantize_rows_avx2(const uint8_t* blocks, int64_t type, int64_t k,
                                                                  int64_t begin, int64_t end, float* out) {
  const int64_t nb = k / kBlock, bb = block_bytes(type);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = blocks + n * nb * bb;
    float* o = out + (n - begin) * k;
    for (int64_t g = 0; g < nb; ++g) {
      __m256 w[4];
      dequantize_block_avx2(row + g * bb, type, w);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + g * kBlock + 8 * i, w[i]);
    }
  }
}

// y[m, n] = tile[n - begin] . x[m] for every row m of x (M rows, K floats each, row stride ldy of y).
// Blocks of 4 rows of x by 2 weight rows share their loads: 6 loads feed 8 FMAs.
__attribute__((target("avx2,fma"))) void tile_dot_avx2(const float* x, int64_t m_rows, const float* tile,
                                                      int64_t rows, int64_t k, int64_t begin, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* w0 = tile + r * k;
    const float* w1 = w0 + k;
    int64_t m = 0;
    for (; m + 4 <= m_rows; m += 4) {
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; j += 8) {
        const __m256 a = _mm256_loadu_ps(w0 + j), b = _mm256_loadu_ps(w1 + j);
        for (int i = 0; i < 4; ++i) {
          const __m256 xv = _mm256_loadu_ps(x + (m + i) * k + j);
          acc[i][0] = _mm256_fmadd_ps(a, xv, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(b, xv, acc[i][1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        y[(m + i) * ldy + begin + r] = hsum(acc[i][0]);
        y[(m + i) * ldy + begin + r + 1] = hsum(acc[i][1]);
      }
    }
    for (; m < m_rows; ++m) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; j += 8) {
        const __m256 xv = _mm256_loadu_ps(x + m * k + j);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + j), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + j), xv, a1);
      }
      y[m * ldy + begin + r] = hsum(a0);
      y[m * ldy + begin + r + 1] = hsum(a1);
    }
  }
  for (; r < rows; ++r) {
    const float* w = tile + r * k;
    for (int64_t m = 0; m < m_rows; ++m) {
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + m * k + j), a0);
      y[m * ldy + begin + r] = hsum(a0);
    }
  }
}
#endif

void dequantize_rows(const uint8_t* blocks, int64_t type, int64_t k, int64_t begin, int64_t end, float* out) {
#ifdef FD_X86
  if (has_avx2()) return dequantize_rows_avx2(blocks, type, k, begin, end, out);
#endif
  const int64_t nb = k / kBlock, bb = block_bytes(type);
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t g = 0; g < nb; ++g) {
      dequantize_block(blocks + (n * nb + g) * bb, type, out + (n - begin) * k + g * kBlock);
    }
  }
}

void tile_dot(const float* x, int64_t m_rows, const float* tile, int64_t rows, int64_t k, int64_t begin, float* y,
              int64_t ldy) {
#ifdef FD_X86
  if (has_avx2()) return tile_dot_avx2(x, m_rows, tile, rows, k, begin, y, ldy);
#endif
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += tile[r * k + j] * x[m * k + j];
      y[m * ldy + begin + r] = acc;
    }
  }
}

void check_args(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(type == kQ4_1 || type == kQ8_0, "gguf matmul: type ", type, " is neither Q4_1 (3) nor Q8_0 (8)");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "gguf matmul: in_features ", k, " is not a multiple of ", kBlock);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              "gguf matmul: blocks must be a contiguous CPU uint8 [out, in / 32 * block bytes] tensor");
  TORCH_CHECK(blocks.size(1) == k / kBlock * block_bytes(type), "gguf matmul: blocks have ", blocks.size(1),
              " bytes a row, expected ", k / kBlock * block_bytes(type));
}

// float32 [out, in]: the weight as the matmul multiplies by it.
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t k) {
  check_args(blocks, type, k);
  const int64_t n = blocks.size(0);
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows(b, type, k, begin, end, o + begin * k);
  });
  return out;
}

// x float32 [M, K] -> float32 [M, N] for blocks [N, K / 32 * block bytes].
at::Tensor gguf_matmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "gguf matmul: x must be a float32 CPU [rows, in] tensor");
  const int64_t m_rows = x_in.size(0), k = x_in.size(1), n = blocks.size(0);
  check_args(blocks, type, k);
  if (m_rows > kMaxGemvRows) return at::mm(x_in, gguf_dequantize(blocks, type, k).t());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({m_rows, n}, x.options());
  if (m_rows == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#ifdef FD_X86
  if (m_rows == 1 && has_avx2()) {
    if (type == kQ8_0) {
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { gemv_q8_0_avx2(xp, b, k, begin, end, yp); });
      return y;
    }
    std::vector<float> xsum(k / kBlock, 0.f);  // each block's sum of x, which Q4_1's minimums multiply
    for (int64_t j = 0; j < k; ++j) xsum[j / kBlock] += xp[j];
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      gemv_q4_1_avx2(xp, xsum.data(), b, k, begin, end, yp);
    });
    return y;
  }
#endif
  at::parallel_for(0, (n + kTileRows - 1) / kTileRows, 2, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<float> tile(kTileRows * k);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t begin = t * kTileRows, end = std::min(n, begin + kTileRows);
      dequantize_rows(b, type, k, begin, end, tile.data());
      tile_dot(xp, m_rows, tile.data(), end - begin, k, begin, yp, n);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdeploy_cpu, m) {
  m.def("gguf_matmul(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdeploy_cpu, CPU, m) {
  m.impl("gguf_matmul", &gguf_matmul);
  m.impl("gguf_dequantize", &gguf_dequantize);
}

}  // namespace fastdeploy_ops
