// The band passes on a CUDA device (issue 13; protocol/engine/fused.py): round_band, nearest
// and apply_entries for a site's values in GPU memory, with the CPU passes' decisions element
// for element (band.h, shared with fused.cpp; built with --fmad=false, so that
// `scale * base + floor` is two roundings, as in torch). The band pass and `nearest` are one
// kernel over the values where the torch ops launch a dozen (the band pass one more to widen
// the values back, where asked); `apply_entries` one kernel over the entries to check them, and
// only where all are valid up to three to write them (the rounding where asked, directions,
// values). Registered for the CUDA dispatch key by the module `_fused_cuda`, which setup.py
// builds where nvcc and a CUDA build of torch are present, and fused.py imports after `_fused`
// (whose schemas these implement).
//
// What comes back to the host is small: a site's candidates (a superset of its band, a few per
// ten thousand elements) and, in replay, whether its entries are valid. Each pass reads that
// with one wait for the GPU, where the torch ops wait in `nonzero`.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include <Python.h>

#include "band.h"
#include "module.h"
#include "sites.h"

namespace {

using namespace ovt;

constexpr int kThreads = 256;
// A replayed entry's code beside its position: a direction (down, up), or a value's bits (>= 0).
constexpr int64_t kDown = -1;
constexpr int64_t kUp = -2;

// Blocks of a grid-stride loop over n elements on the current device: enough to fill it.
int blocks_for(int64_t n) {
  int device = 0, processors = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  const int64_t most = static_cast<int64_t>(processors) * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                                  most)));
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// r = RNE(y), and each band candidate (fused.cpp `scan`: the same test) appended to `slots` as
// (index, its bound's bits, its value's bits), in no particular order, while there is room;
// `count` counts them all.
__global__ void band_kernel(const Spec s, const double* __restrict__ y, float* __restrict__ r,
                            int64_t n, unsigned long long* count, int64_t* slots,
                            unsigned long long capacity) {
  const double floor54 = s.floor * kBandScale;
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const double v = y[i];
    r[i] = narrow(v);
    if (in_band(v, scaled_bound(s.scale * base_at(s, y, i), floor54))) {
      const unsigned long long k = atomicAdd(count, 1ULL);
      if (k < capacity) {
        slots[3 * k] = i;
        slots[3 * k + 1] = bits_of(bound_at(s, y, i));
        slots[3 * k + 2] = bits_of(v);
      }
    }
  }
}

// r = RNE(y), and with `widen` y = r widened (fused.cpp `nearest`).
__global__ void nearest_kernel(double* y, float* r, int64_t n, bool widen) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = narrow(y[i]);
    r[i] = v;
    if (widen) y[i] = static_cast<double>(v);
  }
}

// y = r widened (round_band's `widen_back`, once the candidates are read).
__global__ void widen_kernel(double* y, const float* r, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = static_cast<double>(r[i]);
}

// Each entry (position, code) checked (band.h `direction_valid`, `value_valid`): a valid one's
// rounding written to out, `bad` set where any is invalid (out is then not read). RNE(y) is read
// from r, or computed where r is null (fused.cpp `entry_roundings`).
__global__ void check_kernel(const Spec s, const double* y, const float* r,
                             const int64_t* entries, int64_t count, double overflow, double wide,
                             float* out, int* bad) {
  for (int64_t k = first_index(); k < count; k += grid_stride()) {
    const int64_t i = entries[2 * k], code = entries[2 * k + 1];
    const float rv = r != nullptr ? r[i] : narrow(y[i]);
    if (code < 0 ? !direction_valid(s, y, i, rv, overflow)
                 : !value_valid(s, y, i, code, overflow, wide)) {
      atomicOr(bad, 1);
      continue;
    }
    out[k] = code < 0 ? directed(rv, y[i], code == kUp)
                      : as_float(static_cast<int32_t>(static_cast<uint32_t>(code)));
  }
}

// Entries [first, last) written: r[i] = their rounding, and y[i] too, widened, where y is given.
__global__ void scatter_kernel(const int64_t* entries, const float* out, int64_t first,
                               int64_t last, float* r, double* y) {
  for (int64_t k = first + first_index(); k < last; k += grid_stride()) {
    const int64_t i = entries[2 * k];
    r[i] = out[k];
    if (y != nullptr) y[i] = static_cast<double>(out[k]);
  }
}

// The site's values must be on one CUDA device, which the kernels then run on.
void check_device(const at::Tensor& y, const char* op) {
  TORCH_CHECK(y.is_cuda(), op, ": y must be a CUDA tensor here");
}

// fused.cpp `round_band`, on the device: the same rounding, the same candidates (sorted, as
// the CPU pass finds them), their bounds and values, as CPU tensors (the recorder decides the
// entries there). The candidates land in slots sized for a few per hundred elements; where a
// site has more (a bound wide against the target ULP), the kernel runs again with room for all,
// y being untouched until they are read: then, with `widen_back`, it is overwritten.
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> round_band_cuda(
    const at::Tensor& y, const at::Tensor& r, int64_t mode, const c10::optional<at::Tensor>& m,
    const c10::optional<at::Tensor>& col, const c10::optional<at::Tensor>& add, int64_t inner,
    int64_t rows, double scale, double floor, double weight, bool widen_back) {
  check_device(y, "round_band");
  const int64_t n = site_length(y, r, "round_band");
  const Spec s = make_spec(n, mode, m, col, add, inner, rows, scale, floor, weight, y.device(),
                           "round_band");
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  const bool widen = widen_back && may_widen(yp, n, s, m, col, add);
  int64_t capacity = std::min<int64_t>(n, std::max<int64_t>(4096, n / 64));
  int64_t found = 0;
  at::Tensor slots;
  for (;;) {
    slots = at::empty({1 + 3 * capacity}, y.options().dtype(at::kLong));  // the count, the slots
    int64_t* sp = slots.data_ptr<int64_t>();
    C10_CUDA_CHECK(cudaMemsetAsync(sp, 0, sizeof(int64_t), stream));
    if (n > 0) {
      band_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
          s, yp, rp, n, reinterpret_cast<unsigned long long*>(sp), sp + 1,
          static_cast<unsigned long long>(capacity));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    C10_CUDA_CHECK(cudaMemcpyAsync(&found, sp, sizeof found, cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (found <= capacity) break;
    capacity = found;
  }
  if (widen && n > 0) {
    widen_kernel<<<blocks_for(n), kThreads, 0, stream>>>(yp, rp, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (found == 0) {
    const at::TensorOptions on_host = at::TensorOptions().dtype(at::kDouble);
    return {at::empty({0}, on_host.dtype(at::kLong)), at::empty({0}, on_host),
            at::empty({0}, on_host), widen};
  }
  const at::Tensor host = slots.narrow(0, 1, 3 * found).to(at::kCPU).view({found, 3});
  const auto [candidates, order] = at::sort(host.select(1, 0).contiguous());
  const at::Tensor bounds = host.select(1, 1).index_select(0, order).view(at::kDouble);
  const at::Tensor values = host.select(1, 2).index_select(0, order).view(at::kDouble);
  return {candidates, bounds, values, widen};
}

// fused.cpp `nearest`, on the device.
void nearest_cuda(const at::Tensor& y, const at::Tensor& r, bool widen) {
  check_device(y, "nearest");
  const int64_t n = site_length(y, r, "nearest");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(y.device());
  nearest_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      y.data_ptr<double>(), r.data_ptr<float>(), n, widen);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// fused.cpp `apply_entries`, on the device: the entries in the result's range gathered on the
// host (where the log is) as (position, code) pairs, directions first, copied over, checked and
// their roundings found by one kernel; only where all are valid are they written (directions,
// then values, as the CPU pass and the torch ops write them), after the rounding itself where
// `widen_back` asks for it to be written here too.
bool apply_entries_cuda(const at::Tensor& y, const at::Tensor& r, int64_t offset,
                        const at::Tensor& indices, const at::Tensor& up,
                        const at::Tensor& value_indices, const at::Tensor& values, int64_t mode,
                        const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& col,
                        const c10::optional<at::Tensor>& add, int64_t inner, int64_t rows,
                        double scale, double floor, double weight, double overflow, double wide,
                        bool widen_back) {
  check_device(y, "apply_entries");
  const int64_t n = site_length(y, r, "apply_entries");
  check_entries(indices, up, value_indices, values);
  const Spec s = make_spec(n, mode, m, col, add, inner, rows, scale, floor, weight, y.device(),
                           "apply_entries");
  const int64_t* dir = entry_indices(indices, "indices");
  const bool* dir_up = up.data_ptr<bool>();
  const int64_t* val = entry_indices(value_indices, "value_indices");
  const int64_t* bits = entry_indices(values, "values");
  const auto mine = [offset, n](int64_t index) { return index >= offset && index < offset + n; };
  std::vector<int64_t> packed;
  for (int64_t k = 0; k < indices.numel(); ++k) {
    if (!mine(dir[k])) continue;
    packed.push_back(dir[k] - offset);
    packed.push_back(dir_up[k] ? kUp : kDown);
  }
  const int64_t directions = static_cast<int64_t>(packed.size()) / 2;
  for (int64_t k = 0; k < value_indices.numel(); ++k) {
    if (!mine(val[k])) continue;
    if (bits[k] < 0 || bits[k] > 0xFFFFFFFFLL) return false;  // (not a float32 pattern)
    packed.push_back(val[k] - offset);
    packed.push_back(bits[k]);
  }
  const int64_t count = static_cast<int64_t>(packed.size()) / 2;
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  if (count > 0) {
    // (through pinned memory, so that the copy does not wait for the device: the flag's does)
    const at::Tensor entries =
        at::from_blob(packed.data(), {count, 2}, at::TensorOptions().dtype(at::kLong))
            .pin_memory()
            .to(y.device(), at::kLong, /*non_blocking=*/true);
    const at::Tensor out = at::empty({count}, r.options());
    const at::Tensor bad = at::zeros({1}, y.options().dtype(at::kInt));
    check_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
        s, yp, widen_back ? nullptr : rp, entries.data_ptr<int64_t>(), count, overflow, wide,
        out.data_ptr<float>(), bad.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    int flag = 0;
    C10_CUDA_CHECK(cudaMemcpyAsync(&flag, bad.data_ptr<int>(), sizeof flag,
                                   cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (flag != 0) return false;
    if (widen_back && n > 0) nearest_cuda(y, r, true);
    double* written = widen_back ? yp : nullptr;
    for (const auto [first, last] : {std::pair<int64_t, int64_t>{0, directions},
                                     std::pair<int64_t, int64_t>{directions, count}}) {
      if (first == last) continue;
      scatter_kernel<<<blocks_for(last - first), kThreads, 0, stream>>>(
          entries.data_ptr<int64_t>(), out.data_ptr<float>(), first, last, rp, written);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return true;
  }
  if (widen_back && n > 0) nearest_cuda(y, r, true);
  return true;
}

}  // namespace

TORCH_LIBRARY_IMPL(ovt, CUDA, lib) {
  lib.impl("round_band", &round_band_cuda);
  lib.impl("nearest", &nearest_cuda);
  lib.impl("apply_entries", &apply_entries_cuda);
}

// The module that loads these kernels: SOURCE and OWN_STANDARD_LIBRARY, as `_fused` has them.
static PyModuleDef cuda_module = {PyModuleDef_HEAD_INIT, "_fused_cuda", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__fused_cuda(void) { return ovt::describe_module(&cuda_module); }
