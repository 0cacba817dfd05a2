// Byte layout of the packed step frame (fastdeploy/common/step_frame.py is normative).
// Shared by the CPU and CUDA packers so both place every array at the same offset.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FD_HOST_DEVICE __host__ __device__
#else
#define FD_HOST_DEVICE
#endif

namespace fastdeploy_ops {

constexpr int64_t kMetaLen = 8;
constexpr int64_t kHasLogprobs = 1;
constexpr int64_t kHasMask = 2;

FD_HOST_DEVICE inline int64_t pad8(int64_t nbytes) { return (nbytes + 7) & ~int64_t(7); }

// Byte offset of each array; absent arrays get the offset where they would start and
// size 0, so `total` is right either way.
struct FrameLayout {
  int64_t seq_ids, num_tokens, token_ids, lp_ids, lp_values, ranks, mask_offsets, mask_ids, logz, total;
};

FD_HOST_DEVICE inline FrameLayout frame_layout(int64_t batch, int64_t n, int64_t m, int64_t width, bool has_lp,
                                               bool has_mask) {
  FrameLayout l;
  l.seq_ids = kMetaLen * 8;
  l.num_tokens = l.seq_ids + 8 * batch;
  l.token_ids = l.num_tokens + pad8(4 * batch);
  l.lp_ids = l.token_ids + 8 * n;
  int64_t lp_cells = has_lp ? n * width : 0;
  l.lp_values = l.lp_ids + 8 * lp_cells;
  l.ranks = l.lp_values + pad8(4 * lp_cells);
  l.mask_offsets = l.ranks + (has_lp ? 8 * n : 0);
  l.mask_ids = l.mask_offsets + (has_mask ? pad8(4 * (n + 1)) : 0);
  l.logz = l.mask_ids + (has_mask ? pad8(4 * m) : 0);
  l.total = l.logz + (has_mask ? pad8(4 * n) : 0);
  return l;
}

}  // namespace fastdeploy_ops
