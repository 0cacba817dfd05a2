// Packed step output on CUDA: gathers the accepted slots on the device and writes the
// frame straight into pinned host memory, so the only bytes that cross PCIe are the
// frame's own, in one pass, with no size read back first.
//
// The frame's size depends on device data (accept counts, mask row lengths). Two
// kernels on the current stream: a single-block scan computes each accepted row's
// source slot, the CSR offsets, N, M and the header; a grid-wide gather then places
// every array at the offset frame_layout() gives. The host allocates pinned memory for
// the largest frame the shapes allow (every slot accepted), synchronises once and
// returns the first meta-determined `total` bytes.
//
// pack_step_slots_split returns once the frame's head (everything but the mask ids) is on
// the host, with the mask ids still being written behind it on the same stream: the
// engine can schedule the next step from the tokens while the bulk of a masked frame
// crosses PCIe. The caller records an event on the stream and waits on it before it
// reads the mask ids. With write_mask_ids=false the ids are not written at all: a caller
// whose ids already lie in frame order copies them in itself (a plain device-to-host
// copy on a copy stream, off the compute stream's critical path).
//
// pack_step_slots_staged is the alternative measured in benchmarks/output_packing.py:
// the frame is built in device memory, a 64-byte header is read back to learn the size,
// then one copy of exactly the frame crosses PCIe (two transfers, two synchronisations).
//
// Invalid inputs cannot raise from the device: accept counts are clamped to 0..S and
// mask row ranges to [0, M_in] (the CPU op rejects both); rows that overlap so much
// that they hold more than M_in ids are reported through the header and raise.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <cub/block/block_scan.cuh>
#include <torch/library.h>

#include "step_frame_layout.h"
#include "step_slots_args.h"

namespace fastdeploy_ops {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kGatherThreads = 256;

#define FD_CUDA_CHECK(expr)                                                          \
  do {                                                                               \
    cudaError_t err_ = (expr);                                                       \
    TORCH_CHECK(err_ == cudaSuccess, #expr " failed: ", cudaGetErrorString(err_)); \
  } while (0)

// Which parts of the frame a gather launch writes.
enum PackPart : int { kHead = 1, kMaskIds = 2, kWholeFrame = kHead | kMaskIds };

struct PackParams {
  int64_t message_id, flag_word, batch, slots, width, lp_stride, num_in_ids;
  int part;  // PackPart
  bool has_lp, has_mask;
  const int64_t* seq_ids;
  const int32_t* counts;
  const int64_t* tokens;
  const int64_t* lp_ids;
  const float* lp_values;
  const int64_t* ranks;
  const int32_t* in_off;
  const int32_t* in_ids;
  const float* logz;
  // Workspace in device memory, written by the scan, read by the gather.
  int32_t* row_src;  // [B*S] source slot of accepted row n
  int32_t* out_off;  // [B*S+1] CSR offsets of the accepted rows
  int64_t* totals;   // [2] N, M
  uint8_t* dest;     // frame bytes: device memory or mapped pinned host memory
};

__device__ __forceinline__ int32_t clamp_count(int32_t c, int64_t slots) {
  return c < 0 ? 0 : (c > slots ? static_cast<int32_t>(slots) : c);
}

__device__ __forceinline__ int64_t clamp_offset(int32_t o, int64_t num_ids) {
  return o < 0 ? 0 : (o > num_ids ? num_ids : o);
}

__device__ __forceinline__ void mask_row_range(const PackParams& p, int32_t src, int64_t& start, int64_t& end) {
  start = clamp_offset(p.in_off[src], p.num_in_ids);
  end = clamp_offset(p.in_off[src + 1], p.num_in_ids);
  if (end < start) end = start;
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(PackParams p) {
  using BlockScan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  // Accepted rows in sequence order: row n = tok_start[b] + s comes from slot b*S + s.
  for (int64_t base = 0; base < p.batch; base += kScanThreads) {
    const int64_t b = base + threadIdx.x;
    const int32_t c = b < p.batch ? clamp_count(p.counts[b], p.slots) : 0;
    int64_t start, tile_total;
    BlockScan(temp).ExclusiveSum(static_cast<int64_t>(c), start, tile_total);
    start += carry;
    for (int32_t s = 0; s < c; ++s) p.row_src[start + s] = static_cast<int32_t>(b * p.slots + s);
    __syncthreads();  // every thread has read carry and temp before they change
    if (threadIdx.x == 0) carry += tile_total;
    __syncthreads();
  }
  const int64_t n = carry;
  __syncthreads();  // row_src complete; everyone has read n before carry is reused
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  if (p.has_mask) {
    for (int64_t base = 0; base < n; base += kScanThreads) {
      const int64_t i = base + threadIdx.x;
      int64_t len = 0;
      if (i < n) {
        int64_t start, end;
        mask_row_range(p, p.row_src[i], start, end);
        len = end - start;
      }
      int64_t off, tile_total;
      BlockScan(temp).ExclusiveSum(len, off, tile_total);
      if (i < n) p.out_off[i] = static_cast<int32_t>(carry + off);
      __syncthreads();
      if (threadIdx.x == 0) carry += tile_total;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    // Overlapping rows (not a CSR) could sum past the buffer sized for M_in ids: report -1.
    const int64_t m = !p.has_mask ? 0 : (carry > p.num_in_ids ? -1 : carry);
    if (p.has_mask) p.out_off[n] = static_cast<int32_t>(m);
    p.totals[0] = n;
    p.totals[1] = m;
    int64_t* meta = reinterpret_cast<int64_t*>(p.dest);
    meta[0] = p.message_id;
    meta[1] = p.flag_word;
    meta[2] = p.batch;
    meta[3] = n;
    meta[4] = m;
    meta[5] = meta[6] = meta[7] = 0;
  }
}

// Zero the 4 bytes after an array of `count` 4-byte items when count is odd (8-byte padding).
__device__ __forceinline__ void pad_int32(uint8_t* dest, int64_t offset, int64_t count) {
  if (count & 1) reinterpret_cast<int32_t*>(dest + offset)[count] = 0;
}

// The accepted row holding output id j (0 <= j < out_off[n]): the last i with out_off[i] <= j.
// Empty rows share their offset with the next row, so the last such i is the non-empty one.
__device__ __forceinline__ int64_t row_of(const int32_t* out_off, int64_t n, int64_t j) {
  int64_t lo = 0, hi = n;  // out_off[lo] <= j < out_off[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (out_off[mid] <= j) lo = mid; else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(kGatherThreads) gather_kernel(PackParams p) {
  const int64_t n = p.totals[0], m = p.totals[1];
  if (m < 0) return;
  const FrameLayout l = frame_layout(p.batch, n, m, p.width, p.has_lp, p.has_mask);
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint8_t* d = p.dest;
  if (p.has_mask && (p.part & kMaskIds)) {
    // One thread per output id, consecutive threads on consecutive ids, so every warp
    // writes whole 128-byte lines: rows run from empty (null) to 100k+ ids, and a warp
    // per row left a batch of 256 long rows to 8 warps (2.8 GB/s into pinned memory).
    int32_t* out = reinterpret_cast<int32_t*>(d + l.mask_ids);
    for (int64_t j = tid; j < m; j += stride) {
      const int64_t i = row_of(p.out_off, n, j);
      int64_t start, end;
      mask_row_range(p, p.row_src[i], start, end);
      out[j] = p.in_ids[start + (j - p.out_off[i])];
    }
  }
  if (!(p.part & kHead)) return;

  for (int64_t b = tid; b < p.batch; b += stride) {
    reinterpret_cast<int64_t*>(d + l.seq_ids)[b] = p.seq_ids[b];
    reinterpret_cast<int32_t*>(d + l.num_tokens)[b] = clamp_count(p.counts[b], p.slots);
  }
  for (int64_t i = tid; i < n; i += stride) {
    const int32_t src = p.row_src[i];
    reinterpret_cast<int64_t*>(d + l.token_ids)[i] = p.tokens[src];
    if (p.has_lp) reinterpret_cast<int64_t*>(d + l.ranks)[i] = p.ranks[src];
    if (p.has_mask) reinterpret_cast<float*>(d + l.logz)[i] = p.logz[src];
  }
  if (p.has_lp) {
    for (int64_t cell = tid; cell < n * p.width; cell += stride) {
      const int64_t i = cell / p.width, col = cell - i * p.width;
      const int64_t from = p.row_src[i] * p.lp_stride + col;
      reinterpret_cast<int64_t*>(d + l.lp_ids)[cell] = p.lp_ids[from];
      reinterpret_cast<float*>(d + l.lp_values)[cell] = p.lp_values[from];
    }
  }
  if (p.has_mask) {
    for (int64_t i = tid; i <= n; i += stride) reinterpret_cast<int32_t*>(d + l.mask_offsets)[i] = p.out_off[i];
  }
  if (tid == 0) {
    pad_int32(d, l.num_tokens, p.batch);
    if (p.has_lp) pad_int32(d, l.lp_values, n * p.width);
    if (p.has_mask) {
      pad_int32(d, l.mask_offsets, n + 1);
      pad_int32(d, l.mask_ids, m);
      pad_int32(d, l.logz, n);
    }
  }
}

int gather_blocks(int64_t work) {
  return static_cast<int>(std::clamp<int64_t>((work + kGatherThreads - 1) / kGatherThreads, 1, 1024));
}

// Launches the scan and the gather on `stream`, writing the frame to `dest`. With
// `head_event`, the head and the mask ids are two launches with the event recorded
// between them; otherwise one launch writes the whole frame.
void launch_pack(const SlotArgs& a, uint8_t* dest, const at::Tensor& workspace, cudaStream_t stream,
                 cudaEvent_t head_event = nullptr, bool write_mask_ids = true) {
  PackParams p;
  p.message_id = a.message_id;
  p.flag_word = a.flag_word;
  p.batch = a.batch;
  p.slots = a.slots;
  p.width = a.k + 1;
  p.lp_stride = a.lp_stride;
  p.has_lp = a.has_lp;
  p.has_mask = a.has_mask;
  p.num_in_ids = a.has_mask ? a.mask_ids.numel() : 0;
  p.seq_ids = a.seq_ids.data_ptr<int64_t>();
  p.counts = a.accept_counts.data_ptr<int32_t>();
  p.tokens = a.token_ids.data_ptr<int64_t>();
  p.lp_ids = a.has_lp ? a.lp_ids.data_ptr<int64_t>() : nullptr;
  p.lp_values = a.has_lp ? a.lp_values.data_ptr<float>() : nullptr;
  p.ranks = a.has_lp ? a.ranks.data_ptr<int64_t>() : nullptr;
  p.in_off = a.has_mask ? a.mask_offsets.data_ptr<int32_t>() : nullptr;
  p.in_ids = a.has_mask ? a.mask_ids.data_ptr<int32_t>() : nullptr;
  p.logz = a.has_mask ? a.logz.data_ptr<float>() : nullptr;
  const int64_t rows = a.batch * a.slots;
  auto* ws = reinterpret_cast<int32_t*>(workspace.data_ptr());
  p.totals = reinterpret_cast<int64_t*>(ws);
  p.row_src = ws + 4;
  p.out_off = ws + 4 + rows;
  p.dest = dest;

  scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
  FD_CUDA_CHECK(cudaGetLastError());
  if (head_event == nullptr) {
    p.part = kWholeFrame;
    gather_kernel<<<gather_blocks(std::max(rows * p.width, p.num_in_ids)), kGatherThreads, 0, stream>>>(p);
    FD_CUDA_CHECK(cudaGetLastError());
    return;
  }
  p.part = kHead;
  gather_kernel<<<gather_blocks(rows * p.width), kGatherThreads, 0, stream>>>(p);
  FD_CUDA_CHECK(cudaGetLastError());
  FD_CUDA_CHECK(cudaEventRecord(head_event, stream));
  if (!p.has_mask || !write_mask_ids) return;
  p.part = kMaskIds;
  gather_kernel<<<gather_blocks(p.num_in_ids), kGatherThreads, 0, stream>>>(p);
  FD_CUDA_CHECK(cudaGetLastError());
}

at::Tensor workspace_for(const SlotArgs& a) {
  // totals (2 x int64 = 4 x int32), row_src [B*S], out_off [B*S+1]
  return at::empty({4 + 2 * a.batch * a.slots + 1}, a.token_ids.options().dtype(at::kInt));
}

int64_t largest_frame(const SlotArgs& a) {
  const int64_t rows = a.batch * a.slots;
  return frame_layout(a.batch, rows, a.has_mask ? a.mask_ids.numel() : 0, a.k + 1, a.has_lp, a.has_mask).total;
}

int64_t frame_size(const SlotArgs& a, const int64_t* meta) {
  TORCH_CHECK_VALUE(meta[4] >= 0, "mask_offsets is not a valid CSR over mask_ids");
  return frame_layout(a.batch, meta[3], meta[4], a.k + 1, a.has_lp, a.has_mask).total;
}

at::Tensor pinned_bytes(int64_t size) {
  return at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
}

// The frame packed straight into pinned memory. `split`: return once the head is on the
// host, with the mask-id kernel still writing behind it (pack_step_slots_split), or, without
// `write_mask_ids`, with the mask ids left for the caller to copy in.
at::Tensor pack_mapped(const SlotArgs& a, bool split, bool write_mask_ids = true) {
  const c10::cuda::CUDAGuard guard(a.token_ids.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor host = pinned_bytes(largest_frame(a));
  void* mapped = nullptr;
  FD_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, host.data_ptr(), 0));
  const at::Tensor workspace = workspace_for(a);
  if (!split) {
    launch_pack(a, static_cast<uint8_t*>(mapped), workspace, stream);
    FD_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    cudaEvent_t head = nullptr;
    FD_CUDA_CHECK(cudaEventCreateWithFlags(&head, cudaEventDisableTiming));
    launch_pack(a, static_cast<uint8_t*>(mapped), workspace, stream, head, write_mask_ids);
    // The pinned pool must not hand this block out again before the mask-id kernel is done
    // with it, even if the caller drops the frame without waiting.
    at::getHostAllocator(at::kCUDA)->record_event(host.data_ptr(), host.storage().data_ptr().get_context(),
                                                  at::cuda::getCurrentCUDAStream().unwrap());
    const cudaError_t waited = cudaEventSynchronize(head);
    FD_CUDA_CHECK(cudaEventDestroy(head));
    FD_CUDA_CHECK(waited);
  }
  return host.narrow(0, 0, frame_size(a, static_cast<const int64_t*>(host.data_ptr())));
}

at::Tensor pack_step_slots_cuda(int64_t message_id, const at::Tensor& seq_ids, const at::Tensor& accept_counts,
                                const at::Tensor& token_ids, int64_t num_logprobs,
                                const c10::optional<at::Tensor>& lp_ids, const c10::optional<at::Tensor>& lp_values,
                                const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& mask_offsets,
                                const c10::optional<at::Tensor>& mask_ids, const c10::optional<at::Tensor>& logz) {
  return pack_mapped(prepare_slot_args(message_id, seq_ids, accept_counts, token_ids, num_logprobs, lp_ids,
                                       lp_values, ranks, mask_offsets, mask_ids, logz), false);
}

at::Tensor pack_step_slots_split_cuda(int64_t message_id, const at::Tensor& seq_ids, const at::Tensor& accept_counts,
                                      const at::Tensor& token_ids, int64_t num_logprobs,
                                      const c10::optional<at::Tensor>& lp_ids,
                                      const c10::optional<at::Tensor>& lp_values,
                                      const c10::optional<at::Tensor>& ranks,
                                      const c10::optional<at::Tensor>& mask_offsets,
                                      const c10::optional<at::Tensor>& mask_ids,
                                      const c10::optional<at::Tensor>& logz, bool write_mask_ids) {
  return pack_mapped(prepare_slot_args(message_id, seq_ids, accept_counts, token_ids, num_logprobs, lp_ids,
                                       lp_values, ranks, mask_offsets, mask_ids, logz), true, write_mask_ids);
}

at::Tensor pack_step_slots_staged_cuda(int64_t message_id, const at::Tensor& seq_ids,
                                       const at::Tensor& accept_counts, const at::Tensor& token_ids,
                                       int64_t num_logprobs, const c10::optional<at::Tensor>& lp_ids,
                                       const c10::optional<at::Tensor>& lp_values,
                                       const c10::optional<at::Tensor>& ranks,
                                       const c10::optional<at::Tensor>& mask_offsets,
                                       const c10::optional<at::Tensor>& mask_ids,
                                       const c10::optional<at::Tensor>& logz) {
  const SlotArgs a = prepare_slot_args(message_id, seq_ids, accept_counts, token_ids, num_logprobs, lp_ids,
                                       lp_values, ranks, mask_offsets, mask_ids, logz);
  const c10::cuda::CUDAGuard guard(token_ids.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor device_frame = at::empty({largest_frame(a)}, token_ids.options().dtype(at::kByte));
  const at::Tensor workspace = workspace_for(a);
  launch_pack(a, device_frame.data_ptr<uint8_t>(), workspace, stream);
  at::Tensor meta = pinned_bytes(kMetaLen * 8);
  FD_CUDA_CHECK(cudaMemcpyAsync(meta.data_ptr(), device_frame.data_ptr(), kMetaLen * 8, cudaMemcpyDeviceToHost,
                                stream));
  FD_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t size = frame_size(a, static_cast<const int64_t*>(meta.data_ptr()));
  at::Tensor host = pinned_bytes(size);
  FD_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), device_frame.data_ptr(), size, cudaMemcpyDeviceToHost, stream));
  FD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastdeploy_ops, m) {
  m.def(
      "pack_step_slots_staged(int message_id, Tensor seq_ids, Tensor accept_counts, Tensor token_ids, "
      "int num_logprobs, Tensor? lp_ids, Tensor? lp_values, Tensor? ranks, Tensor? mask_offsets, "
      "Tensor? mask_ids, Tensor? logz) -> Tensor");
  m.def(
      "pack_step_slots_split(int message_id, Tensor seq_ids, Tensor accept_counts, Tensor token_ids, "
      "int num_logprobs, Tensor? lp_ids, Tensor? lp_values, Tensor? ranks, Tensor? mask_offsets, "
      "Tensor? mask_ids, Tensor? logz, bool write_mask_ids=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastdeploy_ops, CUDA, m) {
  m.impl("pack_step_slots", &pack_step_slots_cuda);
  m.impl("pack_step_slots_staged", &pack_step_slots_staged_cuda);
  m.impl("pack_step_slots_split", &pack_step_slots_split_cuda);
}

}  // namespace fastdeploy_ops
