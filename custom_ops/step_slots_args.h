// Checks and normalises the arguments of pack_step_slots (fastdeploy/common/step_slots.py
// defines the contract). Shared by the CPU and CUDA packers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include "step_frame_layout.h"

namespace fastdeploy_ops {

struct SlotArgs {
  int64_t message_id;
  int64_t batch, slots;     // B, S
  int64_t k;                // top_logprobs columns kept (k + 1 travel); 0 without logprobs
  int64_t lp_stride;        // K + 1: columns per slot in lp_ids / lp_values
  bool has_lp, has_mask;
  int64_t flag_word;        // meta[1]
  at::Tensor seq_ids, accept_counts, token_ids, lp_ids, lp_values, ranks, mask_offsets, mask_ids, logz;
};

inline at::Tensor checked(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), ", token_ids on ", device);
  return t.contiguous();
}

inline SlotArgs prepare_slot_args(int64_t message_id, const at::Tensor& seq_ids, const at::Tensor& accept_counts,
                                  const at::Tensor& token_ids, int64_t num_logprobs,
                                  const c10::optional<at::Tensor>& lp_ids, const c10::optional<at::Tensor>& lp_values,
                                  const c10::optional<at::Tensor>& ranks,
                                  const c10::optional<at::Tensor>& mask_offsets,
                                  const c10::optional<at::Tensor>& mask_ids, const c10::optional<at::Tensor>& logz) {
  SlotArgs a;
  const at::Device dev = token_ids.device();
  TORCH_CHECK_VALUE(token_ids.dim() == 2, "token_ids must be [B, S]");
  a.message_id = message_id;
  a.batch = token_ids.size(0);
  a.slots = token_ids.size(1);
  a.token_ids = checked(token_ids, "token_ids", at::kLong, dev);
  a.seq_ids = checked(seq_ids, "seq_ids", at::kLong, dev);
  a.accept_counts = checked(accept_counts, "accept_counts", at::kInt, dev);
  TORCH_CHECK_VALUE(a.seq_ids.numel() == a.batch && a.accept_counts.numel() == a.batch,
                    "seq_ids and accept_counts must have B = ", a.batch, " entries");
  a.has_lp = num_logprobs >= 0;
  a.k = a.has_lp ? num_logprobs : 0;
  a.lp_stride = 0;
  if (a.has_lp) {
    TORCH_CHECK_VALUE(lp_ids.has_value() && lp_values.has_value() && ranks.has_value(),
                      "num_logprobs >= 0 needs lp_ids, lp_values and ranks");
    a.lp_ids = checked(*lp_ids, "lp_ids", at::kLong, dev);
    a.lp_values = checked(*lp_values, "lp_values", at::kFloat, dev);
    a.ranks = checked(*ranks, "ranks", at::kLong, dev);
    TORCH_CHECK_VALUE(a.lp_ids.dim() == 3 && a.lp_ids.size(0) == a.batch && a.lp_ids.size(1) == a.slots,
                      "lp_ids must be [B, S, K+1]");
    TORCH_CHECK_VALUE(a.lp_values.sizes() == a.lp_ids.sizes(), "lp_values must have the shape of lp_ids");
    TORCH_CHECK_VALUE(a.ranks.numel() == a.batch * a.slots, "ranks must be [B, S]");
    a.lp_stride = a.lp_ids.size(2);
    TORCH_CHECK_VALUE(a.lp_stride >= a.k + 1, "lp_ids has ", a.lp_stride - 1, " top-k columns, fewer than k = ", a.k);
  }
  a.has_mask = mask_offsets.has_value();
  if (a.has_mask) {
    TORCH_CHECK_VALUE(mask_ids.has_value() && logz.has_value(), "mask_offsets needs mask_ids and logz");
    a.mask_offsets = checked(*mask_offsets, "mask_offsets", at::kInt, dev);
    a.mask_ids = checked(*mask_ids, "mask_ids", at::kInt, dev);
    a.logz = checked(*logz, "logz", at::kFloat, dev);
    TORCH_CHECK_VALUE(a.mask_offsets.numel() == a.batch * a.slots + 1, "mask_offsets must have B*S+1 entries");
    TORCH_CHECK_VALUE(a.logz.numel() == a.batch * a.slots, "logz must be [B, S]");
  }
  const int64_t flag = (a.has_lp ? kHasLogprobs : 0) | (a.has_mask ? kHasMask : 0);
  a.flag_word = (flag & 0xFF) | (a.k << 8);
  return a;
}

}  // namespace fastdeploy_ops
