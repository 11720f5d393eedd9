// The fused band pass of the recorder (SPEC §3.2; issue 13): one read of a site's float64
// values gives their float32 roundings and the flat indices that may lie in the band, with each
// element's bound e = scale·base + floor computed on the way (protocol/engine/bounds.py,
// `Affine`). It computes exactly what the torch-ops path computes
// (`protocol.engine.precision.band_candidates` on `Affine.dense`), operation for operation, so
// both give the same bits: tests/protocol/engine/test_fused.py checks it.
//
// Compiled with -ffp-contract=off: `scale * base + floor` must be two roundings, as in torch,
// never one fused multiply-add.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// float64 -> float32 facts (precision.py `_FORMATS`): the 29 low bits of a float64 are its
// position inside a float32 ULP; 2**54 turns "half the distance <= 2e" into one compare.
constexpr int kShift = 52 - 23;
constexpr int64_t kLowMask = (int64_t{1} << kShift) - 1;
constexpr int64_t kHalf = int64_t{1} << (kShift - 1);
constexpr int64_t kExpMask = 0x7FF0000000000000LL;
constexpr int64_t kAbsMask = 0x7FFFFFFFFFFFFFFFLL;
constexpr int64_t kMinNormalBits = int64_t{1023 - 126} << 52;
constexpr double kBandScale = 18014398509481984.0;  // 2**54
constexpr double kZeroBand = 0x1p-151;  // a zero is in the band from e = this (precision.py)
constexpr int64_t kGrain = 1 << 15;                  // elements per chunk of work

// How an element's `base` is found (bounds.py `Affine`, in the same order).
enum Mode : int64_t {
  kRelative = 0,  // base = |y_i|
  kRows = 1,      // base = m[i / inner]  (m holds one value per run of `inner` elements)
  kOuter = 2,     // base = m[i / inner] * col[(i / (rows * inner)) * inner + i % inner]
                  //        (+ add[i % inner] or + add[i], where `add` is given)
};

struct Spec {
  int64_t mode;
  const double* m;
  const double* col;
  const double* add;
  bool add_per_column;
  int64_t inner;
  int64_t rows;
  double scale;
  double floor;
};

inline bool in_band(double y, double e) {
  if (std::isnan(e)) e = std::numeric_limits<double>::infinity();  // certifies nothing
  if (!(e > 0)) return false;  // a correctly rounded result: no machine lands elsewhere
  int64_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  const int64_t low = bits & kLowMask;
  const int64_t power_bits = bits & kExpMask;
  double power;  // 2**E of y's binade; 0 for zero and subnormals
  std::memcpy(&power, &power_bits, sizeof power);
  const int64_t magnitude = bits & kAbsMask;
  if (magnitude < kMinNormalBits) return magnitude != 0 || e >= kZeroBand;
  const double far = static_cast<double>(std::llabs(low - kHalf)) * power;
  return far <= e * kBandScale;
}

// Rounds y[begin:end) into r and appends the band candidates among them to `out`.
void scan(const Spec& s, const double* y, float* r, int64_t begin, int64_t end,
          std::vector<int64_t>& out) {
  if (s.mode == kRelative) {
    for (int64_t i = begin; i < end; ++i) {
      const double v = y[i];
      r[i] = static_cast<float>(v);
      if (in_band(v, s.scale * std::fabs(v) + s.floor)) out.push_back(i);
    }
    return;
  }
  int64_t row = begin / s.inner, j = begin % s.inner;
  for (int64_t i = begin; i < end; ++i) {
    const double v = y[i];
    r[i] = static_cast<float>(v);
    double base = s.m[row];
    if (s.mode == kOuter) {
      base = base * s.col[(row / s.rows) * s.inner + j];
      if (s.add != nullptr) base = base + s.add[s.add_per_column ? j : i];
    }
    if (in_band(v, s.scale * base + s.floor)) out.push_back(i);
    if (++j == s.inner) {
      j = 0;
      ++row;
    }
  }
}

const double* factor(const c10::optional<at::Tensor>& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.has_value(), "round_band: this mode needs ", name);
  TORCH_CHECK(t->dtype() == at::kDouble && t->is_contiguous() && t->device().is_cpu(),
              "round_band: ", name, " must be a contiguous float64 CPU tensor");
  TORCH_CHECK(t->numel() == numel, "round_band: ", name, " has ", t->numel(),
              " elements, expected ", numel);
  return t->data_ptr<double>();
}

std::tuple<at::Tensor, at::Tensor> round_band(const at::Tensor& y, int64_t mode,
                                              const c10::optional<at::Tensor>& m,
                                              const c10::optional<at::Tensor>& col,
                                              const c10::optional<at::Tensor>& add, int64_t inner,
                                              int64_t rows, double scale, double floor) {
  TORCH_CHECK(y.dim() == 1 && y.dtype() == at::kDouble && y.is_contiguous() &&
                  y.device().is_cpu(),
              "round_band: y must be a 1-D contiguous float64 CPU tensor");
  const int64_t n = y.numel();
  Spec s{mode,  nullptr, nullptr, nullptr, false, std::max<int64_t>(inner, 1),
         std::max<int64_t>(rows, 1), scale, floor};
  if (mode == kRows || mode == kOuter) {
    TORCH_CHECK(n % s.inner == 0, "round_band: ", n, " elements are not runs of ", s.inner);
    s.m = factor(m, n / s.inner, "m");
    if (mode == kOuter) {
      TORCH_CHECK((n / s.inner) % s.rows == 0, "round_band: rows do not divide the batch");
      s.col = factor(col, n / (s.rows * s.inner) * s.inner, "col");
      if (add.has_value()) {
        s.add_per_column = add->numel() == s.inner;  // (the same indexing when n == inner)
        s.add = factor(add, s.add_per_column ? s.inner : n, "add");
      }
    }
  } else {
    TORCH_CHECK(mode == kRelative, "round_band: unknown mode ", mode);
  }
  at::Tensor r = at::empty({n}, y.options().dtype(at::kFloat));
  const double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  const int64_t chunks = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<std::vector<int64_t>> found(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      scan(s, yp, rp, c * kGrain, std::min(n, (c + 1) * kGrain), found[static_cast<size_t>(c)]);
    }
  });
  size_t total = 0;
  for (const auto& f : found) total += f.size();
  at::Tensor candidates = at::empty({static_cast<int64_t>(total)}, y.options().dtype(at::kLong));
  int64_t* out = candidates.data_ptr<int64_t>();
  for (const auto& f : found) out = std::copy(f.begin(), f.end(), out);
  return {r, candidates};
}

}  // namespace

TORCH_LIBRARY(ovt, lib) {
  lib.def(
      "round_band(Tensor y, int mode, Tensor? m, Tensor? col, Tensor? add, int inner, int rows, "
      "float scale, float floor) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ovt, CPU, lib) { lib.impl("round_band", &round_band); }

// An importable Python module with nothing in it: importing it loads this library, which
// registers torch.ops.ovt.round_band.
static PyModuleDef band_module = {PyModuleDef_HEAD_INIT, "_band", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__band(void) { return PyModule_Create(&band_module); }
