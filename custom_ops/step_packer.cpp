// Packed step output on the CPU: slot layout -> frame bytes, and frame bytes -> array views.
// Held byte for byte to fastdeploy/common/step_slots.py (pack_step_slots_reference) and
// fastdeploy/common/step_frame.py (unpack_step_frame) by tests/ops/test_step_packer.py.
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "step_frame_layout.h"
#include "step_slots_args.h"

namespace fastdeploy_ops {
namespace {

// Zero bytes between the end of an array and its 8-byte boundary: the frame's padding.
void zero_padding(uint8_t* base, int64_t offset, int64_t nbytes) {
  std::memset(base + offset + nbytes, 0, pad8(nbytes) - nbytes);
}

at::Tensor pack_step_slots_cpu(int64_t message_id, const at::Tensor& seq_ids, const at::Tensor& accept_counts,
                               const at::Tensor& token_ids, int64_t num_logprobs,
                               const c10::optional<at::Tensor>& lp_ids, const c10::optional<at::Tensor>& lp_values,
                               const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& mask_offsets,
                               const c10::optional<at::Tensor>& mask_ids, const c10::optional<at::Tensor>& logz) {
  const SlotArgs a = prepare_slot_args(message_id, seq_ids, accept_counts, token_ids, num_logprobs, lp_ids,
                                       lp_values, ranks, mask_offsets, mask_ids, logz);
  const int64_t B = a.batch, S = a.slots, width = a.k + 1;
  const int32_t* counts = a.accept_counts.data_ptr<int32_t>();
  const int32_t* in_off = a.has_mask ? a.mask_offsets.data_ptr<int32_t>() : nullptr;
  const int64_t num_in_ids = a.has_mask ? a.mask_ids.numel() : 0;

  int64_t n = 0, m = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(counts[b] >= 0 && counts[b] <= S, "accept_counts must lie in 0..", S, ", got ", counts[b]);
    n += counts[b];
    for (int64_t s = 0; in_off && s < counts[b]; ++s) {
      const int64_t row = b * S + s;
      TORCH_CHECK_VALUE(0 <= in_off[row] && in_off[row] <= in_off[row + 1] && in_off[row + 1] <= num_in_ids,
                        "mask_offsets row ", row, " is not a valid CSR range over mask_ids");
      m += in_off[row + 1] - in_off[row];
    }
  }

  const FrameLayout l = frame_layout(B, n, m, width, a.has_lp, a.has_mask);
  at::Tensor out = at::empty({l.total}, at::TensorOptions().dtype(at::kByte));
  uint8_t* base = out.data_ptr<uint8_t>();
  const int64_t meta[kMetaLen] = {a.message_id, a.flag_word, B, n, m, 0, 0, 0};
  std::memcpy(base, meta, sizeof(meta));
  std::memcpy(base + l.seq_ids, a.seq_ids.data_ptr<int64_t>(), 8 * B);
  std::memcpy(base + l.num_tokens, counts, 4 * B);
  zero_padding(base, l.num_tokens, 4 * B);

  const int64_t* tokens = a.token_ids.data_ptr<int64_t>();
  auto* out_tokens = reinterpret_cast<int64_t*>(base + l.token_ids);
  auto* out_lp_ids = reinterpret_cast<int64_t*>(base + l.lp_ids);
  auto* out_lp_values = reinterpret_cast<float*>(base + l.lp_values);
  auto* out_ranks = reinterpret_cast<int64_t*>(base + l.ranks);
  auto* out_off = reinterpret_cast<int32_t*>(base + l.mask_offsets);
  auto* out_ids = reinterpret_cast<int32_t*>(base + l.mask_ids);
  auto* out_logz = reinterpret_cast<float*>(base + l.logz);
  int64_t i = 0, ids_written = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < counts[b]; ++s, ++i) {
      const int64_t row = b * S + s;
      out_tokens[i] = tokens[row];
      if (a.has_lp) {
        std::memcpy(out_lp_ids + i * width, a.lp_ids.data_ptr<int64_t>() + row * a.lp_stride, 8 * width);
        std::memcpy(out_lp_values + i * width, a.lp_values.data_ptr<float>() + row * a.lp_stride, 4 * width);
        out_ranks[i] = a.ranks.data_ptr<int64_t>()[row];
      }
      if (a.has_mask) {
        const int64_t len = in_off[row + 1] - in_off[row];
        out_off[i] = static_cast<int32_t>(ids_written);
        std::memcpy(out_ids + ids_written, a.mask_ids.data_ptr<int32_t>() + in_off[row], 4 * len);
        ids_written += len;
        out_logz[i] = a.logz.data_ptr<float>()[row];
      }
    }
  }
  if (a.has_lp) zero_padding(base, l.lp_values, 4 * n * width);
  if (a.has_mask) {
    out_off[n] = static_cast<int32_t>(m);
    zero_padding(base, l.mask_offsets, 4 * (n + 1));
    zero_padding(base, l.mask_ids, 4 * m);
    zero_padding(base, l.logz, 4 * n);
  }
  return out;
}

at::Tensor view_as(const at::Tensor& frame, int64_t offset, int64_t count, at::ScalarType dtype) {
  return frame.narrow(0, offset, count * at::elementSize(dtype)).view(dtype);
}

// Views into `frame`: [meta, seq_ids, num_tokens, token_ids] then, as meta[1]'s flag says,
// [lp_ids (N, k+1), lp_values (N, k+1), ranks] and [mask_offsets, mask_ids, logz].
std::vector<at::Tensor> unpack_step_frame_cpu(const at::Tensor& frame) {
  TORCH_CHECK_VALUE(frame.dim() == 1 && frame.scalar_type() == at::kByte && frame.is_contiguous(),
                    "frame must be a contiguous 1-D uint8 tensor");
  const int64_t size = frame.numel();
  TORCH_CHECK_VALUE(size >= kMetaLen * 8, "step frame is truncated");
  int64_t meta[kMetaLen];
  std::memcpy(meta, frame.data_ptr<uint8_t>(), sizeof(meta));
  const int64_t flag = meta[1] & 0xFF, k = meta[1] >> 8, B = meta[2], n = meta[3], m = meta[4];
  TORCH_CHECK_VALUE(B >= 0 && n >= 0 && m >= 0 && k >= 0, "step frame header is corrupt");
  const bool has_lp = flag & kHasLogprobs, has_mask = flag & kHasMask;
  const FrameLayout l = frame_layout(B, n, m, k + 1, has_lp, has_mask);
  TORCH_CHECK_VALUE(l.total <= size, "step frame is truncated");

  std::vector<at::Tensor> out = {
      view_as(frame, 0, kMetaLen, at::kLong),
      view_as(frame, l.seq_ids, B, at::kLong),
      view_as(frame, l.num_tokens, B, at::kInt),
      view_as(frame, l.token_ids, n, at::kLong),
  };
  if (has_lp) {
    out.push_back(view_as(frame, l.lp_ids, n * (k + 1), at::kLong).view({n, k + 1}));
    out.push_back(view_as(frame, l.lp_values, n * (k + 1), at::kFloat).view({n, k + 1}));
    out.push_back(view_as(frame, l.ranks, n, at::kLong));
  }
  if (has_mask) {
    out.push_back(view_as(frame, l.mask_offsets, n + 1, at::kInt));
    out.push_back(view_as(frame, l.mask_ids, m, at::kInt));
    out.push_back(view_as(frame, l.logz, n, at::kFloat));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fastdeploy_ops, m) {
  m.def(
      "pack_step_slots(int message_id, Tensor seq_ids, Tensor accept_counts, Tensor token_ids, int num_logprobs, "
      "Tensor? lp_ids, Tensor? lp_values, Tensor? ranks, Tensor? mask_offsets, Tensor? mask_ids, Tensor? logz) "
      "-> Tensor");
  m.def("unpack_step_frame(Tensor frame) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(fastdeploy_ops, CPU, m) {
  m.impl("pack_step_slots", &pack_step_slots_cpu);
  m.impl("unpack_step_frame", &unpack_step_frame_cpu);
}

}  // namespace fastdeploy_ops
