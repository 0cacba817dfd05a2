// The small per-layer ops of a CPU decode step, each one call instead of the 5-20 PyTorch ops
// it replaces (at batch 1 the step's time went to dispatching those, not to arithmetic):
//
//   add_rms_norm_         residual += x where a residual is given, x = RMSNorm(residual, else x) * weight
//   silu_mul              silu(gate) * up of a fused [T, 2I] gate/up output
//   rope_paged_decode     RoPE of this step's q/k, k/v written to the paged cache, and attention
//                         of each decode token over its sequence's cached tokens
//
// float32 only, the math of the PyTorch ops they replace (layers/layernorm.py, rotary.py,
// attention.py) up to the order of sums. Work too small to pay for waking a second thread
// runs on the calling one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_simd.h"

namespace fastdeploy_ops {
namespace {

constexpr int64_t kParallelWork = 1 << 18;  // multiply-adds below which an op stays on one thread
// Attention reads a layer's cached K/V from memory (the weights streamed since evict it), so it
// pays for a second thread at far less arithmetic: 128 cached tokens ran 123 us on one thread.
constexpr int64_t kAttentionParallelWork = 1 << 14;

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

void add_rms_norm_(at::Tensor& x, const std::optional<at::Tensor>& residual_in, const at::Tensor& weight,
                   double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  const bool add = residual_in.has_value();
  // Without a residual, x is its own: the sum below reads and writes x.
  at::Tensor residual = add ? *residual_in : x;
  check_float_cpu(residual, "residual");
  const int64_t h = weight.numel();
  TORCH_CHECK(x.numel() % h == 0 && x.numel() == residual.numel(), "add_rms_norm_: shapes do not match");
  const int64_t rows = x.numel() / h;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelWork / h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * h;
      float* rr = rp + r * h;
      float sum = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        const float v = add ? rr[i] + xr[i] : xr[i];
        rr[i] = v;
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) xr[i] = w[i] * (rr[i] * inv);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1), inter = width / 2, rows = gate_up.numel() / width;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelWork / inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * width;
      for (int64_t i = 0; i < inter; ++i) {
        const float a = gr[i];
        o[r * inter + i] = a / (1.f + std::exp(-a)) * gr[inter + i];
      }
    }
  });
  return out;
}

#ifdef FD_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float* y, float a, const float* x, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
#else
float dot_avx2(const float*, const float*, int64_t) { return 0.f; }
void axpy_avx2(float*, float, const float*, int64_t) {}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  if (has_avx2()) return dot_avx2(a, b, n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  if (has_avx2()) return axpy_avx2(y, a, x, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// HF rotate-half RoPE of one head in place: x * cos + rotate_half(x) * sin.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// qkv [D, (H + 2 KVH) * Dh] of D decode tokens (one per sequence), rotated in place; their k/v
// written to kv_cache [2, blocks, block_size, KVH, Dh] at slot_mapping; returns the attention
// output [D, H * Dh] over each sequence's first context_lens[s] cached tokens (block_tables [D, B]).
at::Tensor rope_paged_decode(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, double scale) {
  check_float_cpu(qkv, "qkv");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  check_float_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  slot_mapping.is_contiguous() && context_lens.is_contiguous(),
              "rope_paged_decode: slot_mapping, block_tables and context_lens must be contiguous int64");
  const int64_t seqs = qkv.size(0), dh = head_dim, kvh = num_kv_heads, group = num_heads / num_kv_heads;
  const int64_t width = (num_heads + 2 * kvh) * dh;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "rope_paged_decode: qkv must be [D, (H + 2 KVH) * Dh]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == kvh && kv_cache.size(4) == dh,
              "rope_paged_decode: kv_cache must be [2, blocks, block_size, KVH, Dh]");
  TORCH_CHECK(cos.size(0) == seqs && cos.size(1) == dh && sin.sizes() == cos.sizes(),
              "rope_paged_decode: cos/sin must be [D, Dh]");
  TORCH_CHECK(slot_mapping.numel() == seqs && context_lens.numel() == seqs && block_tables.size(0) == seqs,
              "rope_paged_decode: one slot, context length and block table row per token");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t token_stride = kvh * dh, half_cache = num_blocks * block_size * token_stride;
  float* qp = qkv.data_ptr<float>();
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + half_cache;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(slots[s] >= 0 && slots[s] < num_blocks * block_size, "rope_paged_decode: slot out of range");
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "rope_paged_decode: context length ",
                lens[s], " out of range");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "rope_paged_decode: block id out of range");
    }
    work += lens[s] * num_heads * dh * 2;
  }
  // RoPE and the cache write first: every token attends to its own key.
  for (int64_t s = 0; s < seqs; ++s) {
    float* row = qp + s * width;
    for (int64_t h = 0; h < num_heads + kvh; ++h) rope_head(row + h * dh, cp + s * dh, sp + s * dh, dh);
    std::copy(row + num_heads * dh, row + (num_heads + kvh) * dh, kc + slots[s] * token_stride);
    std::copy(row + (num_heads + kvh) * dh, row + width, vc + slots[s] * token_stride);
  }
  // Attention per (sequence, KV head), its group's query heads together. At small batches those
  // pairs are fewer than twice the threads (batch 1 of a 3-KV-head model: 3 pairs on 2 threads, one
  // thread doing two), so each pair's keys are split into block-aligned parts, each part's softmax
  // kept unnormalised (its max, its sum, its weighted values), and the parts merged after.
  const int64_t pairs = seqs * kvh, threads = at::get_num_threads();
  const int64_t parts =
      pairs >= 2 * threads ? 1 : std::min<int64_t>((2 * threads + pairs - 1) / pairs, max_blocks);
  const int64_t tasks = pairs * parts, part_floats = group * (dh + 2);  // per head: dh weighted values, max, sum
  std::vector<float> partial(parts > 1 ? tasks * part_floats : 0);
  at::Tensor out = at::empty({seqs, num_heads * dh}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, tasks * kAttentionParallelWork / std::max<int64_t>(work, 1));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, whole_stats(2 * group);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pair = t / parts, part = t % parts, s = pair / kvh, kh = pair % kvh, len = lens[s];
      const int64_t len_blocks = (len + block_size - 1) / block_size;
      const int64_t first = part * len_blocks / parts * block_size;
      const int64_t last = std::min(len, (part + 1) * len_blocks / parts * block_size), n = last - first;
      // [group][dh] weighted values, then [group] maxima, [group] sums; one part writes the output itself.
      float* out_part = parts == 1 ? op + s * num_heads * dh + kh * group * dh : partial.data() + t * part_floats;
      float* maxima = parts == 1 ? whole_stats.data() : out_part + group * dh;
      float* sums = maxima + group;
      std::fill(out_part, out_part + group * dh, 0.f);
      if (n <= 0) {  // a short sequence's empty part: weight 0 in the merge
        std::fill(maxima, maxima + group, -std::numeric_limits<float>::infinity());
        std::fill(sums, sums + group, 0.f);
        continue;
      }
      scores.resize(group * n);
      const int64_t* table = tables + s * max_blocks;
      const float* q = qp + s * width + kh * group * dh;  // the group's query heads, one after another
      // Keys block by block (no division per key), each key against all of its group's queries.
      for (int64_t j0 = first; j0 < last; j0 += block_size) {
        const float* k = kc + table[j0 / block_size] * block_size * token_stride + kh * dh;
        for (int64_t j = j0; j < std::min(last, j0 + block_size); ++j, k += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            scores[g * n + j - first] = dot(q + g * dh, k, dh) * static_cast<float>(scale);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // this part's softmax numerators of each query head
        float* sc = scores.data() + g * n;
        const float best = *std::max_element(sc, sc + n);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sc[j] = std::exp(sc[j] - best);
          total += sc[j];
        }
        maxima[g] = best;
        sums[g] = total;
      }
      for (int64_t j0 = first; j0 < last; j0 += block_size) {  // numerators times values, block by block
        const float* v = vc + table[j0 / block_size] * block_size * token_stride + kh * dh;
        for (int64_t j = j0; j < std::min(last, j0 + block_size); ++j, v += token_stride) {
          for (int64_t g = 0; g < group; ++g) axpy(out_part + g * dh, scores[g * n + j - first], v, dh);
        }
      }
      if (parts == 1) {
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.f / sums[g];
          for (int64_t i = 0; i < dh; ++i) out_part[g * dh + i] *= inv;
        }
      }
    }
  });
  for (int64_t pair = 0; parts > 1 && pair < pairs; ++pair) {  // merge each pair's parts: rescale to the common max
    const int64_t s = pair / kvh, kh = pair % kvh;
    for (int64_t g = 0; g < group; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < parts; ++part) {
        best = std::max(best, partial[(pair * parts + part) * part_floats + group * dh + g]);
      }
      float* o = op + s * num_heads * dh + (kh * group + g) * dh;
      std::fill(o, o + dh, 0.f);
      float total = 0.f;
      for (int64_t part = 0; part < parts; ++part) {
        const float* out_part = partial.data() + (pair * parts + part) * part_floats;
        const float weight = std::exp(out_part[group * dh + g] - best);
        total += weight * out_part[group * dh + group + g];
        if (weight > 0.f) axpy(o, weight, out_part + g * dh, dh);
      }
      const float inv = 1.f / total;
      for (int64_t i = 0; i < dh; ++i) o[i] *= inv;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdeploy_cpu, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_paged_decode(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, int head_dim, float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastdeploy_cpu, CPU, m) {
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_paged_decode", &rope_paged_decode);
}

}  // namespace fastdeploy_ops
