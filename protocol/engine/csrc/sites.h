// The checks of a band pass's operands, on either device (fused.cpp for the CPU, fused_cuda.cu
// for CUDA): a site's values and their rounding, a result's bound factors (`ovt::Spec`), and a
// replayed site's log entries (which stay on the CPU, where the log is).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "band.h"

namespace ovt {

inline const double* factor(const c10::optional<at::Tensor>& t, int64_t numel,
                            const at::Device& device, const char* op, const char* name) {
  TORCH_CHECK(t.has_value(), op, ": this mode needs ", name);
  TORCH_CHECK(t->dtype() == at::kDouble && t->is_contiguous() && t->device() == device,
              op, ": ", name, " must be a contiguous float64 tensor on ", device);
  TORCH_CHECK(t->numel() == numel, op, ": ", name, " has ", t->numel(),
              " elements, expected ", numel);
  return t->data_ptr<double>();
}

// The bound of a result of n elements in the form bandpass.py `_FlatBound` gives it, its
// factors on `device` (the result's).
inline Spec make_spec(int64_t n, int64_t mode, const c10::optional<at::Tensor>& m,
                      const c10::optional<at::Tensor>& col, const c10::optional<at::Tensor>& add,
                      int64_t inner, int64_t rows, double scale, double floor, double weight,
                      const at::Device& device, const char* op) {
  Spec s{mode,  nullptr, nullptr, nullptr, false, std::max<int64_t>(inner, 1),
         std::max<int64_t>(rows, 1), scale, floor, weight};
  if (mode == kRows || mode == kOuter) {
    TORCH_CHECK(n % s.inner == 0, op, ": ", n, " elements are not runs of ", s.inner);
    s.m = factor(m, n / s.inner, device, op, "m");
    if (mode == kOuter) {
      TORCH_CHECK((n / s.inner) % s.rows == 0, op, ": rows do not divide the batch");
      s.col = factor(col, n / (s.rows * s.inner) * s.inner, device, op, "col");
      if (add.has_value()) {
        s.add_per_column = add->numel() == s.inner;  // (the same indexing when n == inner)
        s.add = factor(add, s.add_per_column ? s.inner : n, device, op, "add");
      }
    }
  } else if (mode == kPlus) {
    s.add = factor(add, n, device, op, "add");
  } else {
    TORCH_CHECK(mode == kRelative, op, ": unknown mode ", mode);
  }
  return s;
}

// The element count of a site's values `y` and their rounding `r`, checked to be 1-D
// contiguous float64 and float32 tensors of one length on one device.
inline int64_t site_length(const at::Tensor& y, const at::Tensor& r, const char* op) {
  TORCH_CHECK(y.dim() == 1 && y.dtype() == at::kDouble && y.is_contiguous(),
              op, ": y must be a 1-D contiguous float64 tensor");
  const int64_t n = y.numel();
  TORCH_CHECK(r.dim() == 1 && r.dtype() == at::kFloat && r.is_contiguous() &&
                  r.device() == y.device() && r.numel() == n,
              op, ": r must be a 1-D contiguous float32 tensor of ", n, " elements on ",
              y.device());
  return n;
}

// Whether the n doubles at p overlap the bytes of `t` (an optional bound factor): a result
// written back over its own bound factors would change them while they are read.
inline bool overlaps(const double* p, int64_t n, const double* t, int64_t t_n) {
  return t != nullptr && p < t + t_n && t < p + n;
}

// Whether `widen_back` may overwrite y (n doubles at yp) with its rounding: none of its bound
// factors lies in its memory.
inline bool may_widen(const double* yp, int64_t n, const Spec& s,
                      const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& col,
                      const c10::optional<at::Tensor>& add) {
  return !overlaps(yp, n, s.m, m.has_value() ? m->numel() : 0) &&
         !overlaps(yp, n, s.col, col.has_value() ? col->numel() : 0) &&
         !overlaps(yp, n, s.add, add.has_value() ? add->numel() : 0);
}

inline const int64_t* entry_indices(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
              "apply_entries: ", name, " must be a 1-D contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

// A replayed site's log entries as apply_entries reads them on either device (rounding.py
// `_entry_tensors`): direction indices and one direction each, value indices and one value's
// bits each, on the CPU (where the log is).
inline void check_entries(const at::Tensor& indices, const at::Tensor& up,
                          const at::Tensor& value_indices, const at::Tensor& values) {
  entry_indices(indices, "indices");
  entry_indices(value_indices, "value_indices");
  entry_indices(values, "values");
  TORCH_CHECK(up.dtype() == at::kBool && up.is_contiguous() && up.device().is_cpu() &&
                  up.numel() == indices.numel(),
              "apply_entries: up must be a contiguous bool CPU tensor, one per index");
  TORCH_CHECK(values.numel() == value_indices.numel(),
              "apply_entries: values must be one per value index");
}

}  // namespace ovt
