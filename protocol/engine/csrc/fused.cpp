// The fused passes of the rounding engine (issue 13; protocol/engine/fused.py), each one read
// of its input computing what a sequence of torch ops computes, the same bits (checked by
// tests/protocol/engine/test_bandpass.py):
// - round_band, the recorder's band pass (SPEC §3.2): a site's float64 values give their
//   float32 roundings (written to the caller's `r`: a part's destination, or a new tensor),
//   the flat indices that may lie in the band, and their bounds and values,
//   with each element's bound e = scale·base + floor computed on the way
//   (protocol/engine/bounds.py, `Affine`), as
//   `precision.band_candidates` on `Affine.dense` does it, operation for operation; and, asked
//   to (`widen_back`), the site's values overwritten with their roundings widened, so that
//   they serve as the compute-dtype copy of the result (interceptor.py `WidenCache.note`);
// - nearest, a cast and, asked to, that write-back, for a result whose bounds are not read (the
//   cast alone: bandpass.py `to_target`);
// - decide, the recorder's decision on its band candidates (rounding.py `SiteRecorder._decide`):
//   which are entries, and of which kind, with the same tests as its torch ops;
// - apply_entries, the replayer's logged entries of one result (rounding.py `SiteReplayer`):
//   each entry's validity checked and, where all are valid, the logged roundings applied, as
//   `_apply_directions` and `_apply_values` do it with torch ops;
// - pointwise, an elementwise op whose float64 result is fixed by IEEE-754 (a correctly rounded
//   operation, or a fixed formula of them: protocol/engine/pointwise.py), computed straight
//   from float32 inputs and rounded to float32 in one pass, as the torch ops on widened inputs
//   compute it; pointwise_list, its foreach form;
// - fused_normalize and fused_normalize_backward, the normalize formulas of layer and batch
//   norm (protocol/engine/normops.py), fixed formulas likewise, straight from float32 operands;
// - sum_bound, embedding_backward_bound, norms, channel_sums, window_norms, window_norms_at,
//   layer_norm_backward_bound, softmax_backward_bound and log_softmax_backward_bound, bound
//   rules' own arithmetic (no torch twin: see there);
// - row_stats and row_backward_sums, the normalisation statistics in their own summation order
//   (normops.py; no torch twin either), and row_extremes, their rules' terms;
// - philox, the words of a portable random stream (rng.py `RandomStream.words`).
//
// Compiled with -ffp-contract=off: `scale * base + floor` must be two roundings, as in torch,
// never one fused multiply-add. The band passes' element arithmetic (an element's bound, the band
// test, an entry's check) is band.h's, which the CUDA kernels (fused_cuda.cu) share.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <Python.h>

#include "band.h"
#include "module.h"
#include "sites.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

// The vectorised loops are compiled three times on x86-64, for AVX-512, AVX2 and the baseline,
// and the loader picks one by the CPU (identical bits: IEEE operations per element, no FMA
// contraction; what combines elements, a minimum or an `or`, is order-free).
#if defined(__x86_64__) && defined(__GNUC__)
#define OVT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OVT_CLONES
#endif


namespace {

using namespace ovt;

// Elements per chunk of work (the band arithmetic itself: band.h).
constexpr int64_t kGrain = 1 << 15;

// Rounds y[begin:end) into r and appends the band candidates among them to `out`, where
// `base(i, y_i)` gives element i's base. Block by block: a vectorised pass writes each
// element's cast (a NaN's bits as the conversion leaves them) and tells whether any element of
// the block may be in the band (`may_be_in_band`, about 1.4x faster than `in_band` on every
// block: on a value of float32's normal range it is the band test itself, so a block passes it
// where it holds a candidate, a small value, a NaN or a zero under a wide bound — a few in a
// hundred of a matmul's, whose Cauchy–Schwarz bounds are the widest). Only such a
// block is read again: a vectorised pass writes r as every rounding does (`narrow`) and each
// element's band test into `flags`, and tells whether any is in the band; then its flags (not
// its elements: testing each element again, branch by branch, cost more than the vectorised
// pass) give its indices.
template <typename Base>
__attribute__((always_inline)) inline void scan_range(const double* y, float* r, int64_t begin,
                                                      int64_t end, double scale, double floor,
                                                      Base base, std::vector<int64_t>& out) {
  constexpr int64_t kBlock = 128;
  const double floor54 = floor * kBandScale;
  int64_t flags[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    int64_t maybe = 0;
    for (int64_t k = 0; k < n; ++k) {
      const double v = y[b + k];
      r[b + k] = static_cast<float>(v);
      maybe |= may_be_in_band(v, scaled_bound(scale * base(b + k, v), floor54));
    }
    if (!maybe) continue;  // (a NaN makes `maybe`: its r is written again below)
    int64_t any = 0;
    for (int64_t k = 0; k < n; ++k) {
      const double v = y[b + k];
      r[b + k] = narrow(v);
      flags[k] = in_band(v, scaled_bound(scale * base(b + k, v), floor54));
      any |= flags[k];
    }
    if (any) {
      for (int64_t k = 0; k < n; ++k) {
        if (flags[k] != 0) out.push_back(b + k);
      }
    }
  }
}

// One chunk [begin, end) of a site, in the mode of `s`; compiled for AVX2 too, chosen at load.
OVT_CLONES
void scan(const Spec& s, const double* y, float* r, int64_t begin, int64_t end,
          std::vector<int64_t>& out) {
  const double scale = s.scale, floor = s.floor, weight = s.weight;
  if (s.mode == kRelative) {
    scan_range(y, r, begin, end, scale, floor, [](int64_t, double v) { return std::fabs(v); },
               out);
    return;
  }
  if (s.mode == kPlus) {
    const double* add = s.add;
    scan_range(y, r, begin, end, scale, floor,
               [add, weight](int64_t i, double v) {
                 return std::fabs(v) + weight * std::fabs(add[i]);
               },
               out);
    return;
  }
  if (s.mode == kRows && s.inner == 1) {
    const double* m = s.m;
    if (weight != 0) {
      scan_range(y, r, begin, end, scale, floor,
                 [m, weight](int64_t i, double v) { return m[i] + weight * std::fabs(v); }, out);
    } else {
      scan_range(y, r, begin, end, scale, floor, [m](int64_t i, double) { return m[i]; }, out);
    }
    return;
  }
  // Row by row: a row's factor (and its column block) is found once, not per element.
  int64_t i = begin, row = begin / s.inner, j = begin % s.inner;
  while (i < end) {
    const int64_t stop = std::min(end, i + (s.inner - j));
    const int64_t start = i - j;  // the row's first element
    const double m = s.m[row];
    if (s.mode == kRows && weight != 0) {
      scan_range(y, r, i, stop, scale, floor,
                 [m, weight](int64_t, double v) { return m + weight * std::fabs(v); }, out);
    } else if (s.mode == kRows) {
      scan_range(y, r, i, stop, scale, floor, [m](int64_t, double) { return m; }, out);
    } else {
      const double* col = s.col + (row / s.rows) * s.inner;  // this batch's column factors
      if (s.add == nullptr) {
        scan_range(y, r, i, stop, scale, floor,
                   [m, col, start](int64_t idx, double) { return m * col[idx - start]; }, out);
      } else {
        const double* add = s.add;
        const int64_t shift = s.add_per_column ? start : 0;  // add[j] or add[idx]
        scan_range(y, r, i, stop, scale, floor,
                   [m, col, start, add, shift](int64_t idx, double) {
                     return m * col[idx - start] + add[idx - shift];
                   },
                   out);
      }
    }
    i = stop;
    j = 0;
    ++row;
  }
}

// Whether v is a float32 value, as 0 or 1 (so that a conjunction over a loop vectorises).
__attribute__((always_inline)) inline int64_t holds_float32(double v) {
  return static_cast<int64_t>(static_cast<double>(static_cast<float>(v)) == v);
}

// |v|'s bits, which order like the magnitudes, and +inf's for a zero: the smallest key of a
// set of terms is its smallest nonzero magnitude (+inf where all are zero).
__attribute__((always_inline)) inline int64_t nonzero_key(double v) {
  const int64_t magnitude = __builtin_bit_cast(int64_t, v) & kAbsMask;
  return magnitude == 0 ? kInfBits : magnitude;
}

// Columns [i0, i1) of one (reduced, inner) block of `sum_terms`: each column's smallest nonzero
// magnitude (`nonzero_key`) into m and its Σ|x| into sums (in row order), both taken further
// from what the caller put there (+inf's bits and 0 to start); returns whether every element
// read is a float32 value.
OVT_CLONES
int64_t column_terms(const double* x, int64_t* m, double* sums, int64_t reduced, int64_t inner,
                     int64_t i0, int64_t i1) {
  int64_t ok = 1;
  for (int64_t r = 0; r < reduced; ++r) {
    const double* row = x + r * inner;
    for (int64_t i = i0; i < i1; ++i) {
      const double v = row[i];
      const int64_t key = nonzero_key(v);
      m[i] = key < m[i] ? key : m[i];
      sums[i] += std::fabs(v);
      ok &= holds_float32(v);
    }
  }
  return ok;
}

// The elementwise ops of `pointwise` (pointwise.py `_CODES`), each as a float64 expression of
// float32 values a, b, c and a scalar v, evaluated in the order written (-ffp-contract=off).
enum Pointwise : int64_t {
  kMulScalar = 0,  // a * v
  kMul = 1,        // a * b
  kAddScalar = 2,  // a + v
  kAdd = 3,        // a + b
  kSubScalar = 4,  // a - v
  kSub = 5,        // a - b
  kAddcmul = 6,    // a + (v * b) * c
  kAddcdiv = 7,    // a + v * (b / c)
  kLerp = 8,       // a + v * (b - a)
  kSqrt = 9,       // sqrt(a): the correctly rounded float32 square root (pointwise.py)
  kDivScalar = 10, // a / v
  kDiv = 11,       // a / b
};

// out[i] = float32(op(a[i], b[i], c[i], v)) for i in [begin, end); compiled for AVX2 too.
// Element i of every input is read before out[i] is written, so out may be a (whole) input.
OVT_CLONES
void pointwise_range(int64_t op, const float* a, const float* b, const float* c, double v,
                     float* out, int64_t begin, int64_t end) {
  switch (op) {
    case kMulScalar:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} * v);
      break;
    case kMul:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} * double{b[i]});
      break;
    case kAddScalar:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} + v);
      break;
    case kAdd:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} + double{b[i]});
      break;
    case kSubScalar:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} - v);
      break;
    case kSub:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} - double{b[i]});
      break;
    case kAddcmul:
      for (int64_t i = begin; i < end; ++i) {
        out[i] = narrow(double{a[i]} + (v * double{b[i]}) * double{c[i]});
      }
      break;
    case kAddcdiv:
      for (int64_t i = begin; i < end; ++i) {
        out[i] = narrow(double{a[i]} + v * (double{b[i]} / double{c[i]}));
      }
      break;
    case kLerp:
      for (int64_t i = begin; i < end; ++i) {
        out[i] = narrow(double{a[i]} + v * (double{b[i]} - double{a[i]}));
      }
      break;
    case kSqrt:  // IEEE's square root (vectorised: -fno-math-errno), then the conversion; the
      // root of a negative or a NaN is the one NaN (band.h `narrow`), found from the operand:
      // `narrow`'s own test, on the root, kept this loop from vectorising (2.7x slower)
      for (int64_t i = begin; i < end; ++i) {
        const float root = static_cast<float>(std::sqrt(double{a[i]}));
        const int32_t nan = -static_cast<int32_t>(!(a[i] >= 0.0f));
        out[i] = as_float((bits_of(root) & ~nan) | (kQuietNaN32 & nan));
      }
      break;
    case kDivScalar:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} / v);
      break;
    case kDiv:
      for (int64_t i = begin; i < end; ++i) out[i] = narrow(double{a[i]} / double{b[i]});
      break;
    default:
      break;
  }
}

const float* operand(const c10::optional<at::Tensor>& t, int64_t numel, const char* name,
                     bool needed) {
  if (!needed) return nullptr;
  TORCH_CHECK(t.has_value(), "pointwise: this op needs ", name);
  TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->device().is_cpu() &&
                  t->numel() == numel,
              "pointwise: ", name, " must be a contiguous float32 CPU tensor of ", numel,
              " elements");
  return t->data_ptr<float>();
}

// b broadcast over out: b[(i / b_inner) % b_count] for element i (pointwise.py `_broadcast`).
// Where b_inner > 1 a run of b_inner elements shares one b value, which enters as the scalar of
// the code's scalar form; where b_inner is 1 each row of b_count elements reads all of b.
void pointwise_broadcast(int64_t op, const float* a, const float* b, float* out, int64_t n,
                         int64_t b_inner, int64_t b_count) {
  if (b_inner == 1) {
    const int64_t rows = n / b_count;
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / b_count), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        pointwise_range(op, a + r * b_count, b, nullptr, 0.0, out + r * b_count, 0, b_count);
      }
    });
    return;
  }
  const int64_t runs = n / b_inner;
  const int64_t scalar_op = op == kMul ? kMulScalar : op == kAdd ? kAddScalar : kSubScalar;
  at::parallel_for(0, runs, std::max<int64_t>(1, kGrain / b_inner), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      pointwise_range(scalar_op, a + s * b_inner, nullptr, nullptr, double{b[s % b_count]},
                      out + s * b_inner, 0, b_inner);
    }
  });
}

// Whether op reads a tensor b, and a tensor c.
bool has_b(int64_t op) {
  return op != kMulScalar && op != kAddScalar && op != kSubScalar && op != kSqrt &&
         op != kDivScalar;
}

bool has_c(int64_t op) { return op == kAddcmul || op == kAddcdiv; }

void pointwise(int64_t op, const at::Tensor& a, const c10::optional<at::Tensor>& b,
               const c10::optional<at::Tensor>& c, double v, const at::Tensor& out,
               int64_t b_inner, int64_t b_count) {
  TORCH_CHECK(op >= kMulScalar && op <= kDiv, "pointwise: unknown op ", op);
  const int64_t n = a.numel();
  const float* ap = operand(a, n, "a", true);
  operand(out, n, "out", true);
  float* outp = out.data_ptr<float>();
  const bool broadcast = b_inner != 1 || b_count != n;
  if (broadcast) {
    TORCH_CHECK(op == kMul || op == kAdd || op == kSub, "pointwise: only mul, add and sub "
                "broadcast b");
    TORCH_CHECK(b_inner >= 1 && b_count >= 1 && n % (b_inner * b_count) == 0,
                "pointwise: b of ", b_count, " values in runs of ", b_inner,
                " does not tile ", n, " elements");
    pointwise_broadcast(op, ap, operand(b, b_count, "b", true), outp, n, b_inner, b_count);
    return;
  }
  const float* bp = operand(b, n, "b", has_b(op));
  const float* cp = operand(c, n, "c", has_c(op));
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    pointwise_range(op, ap, bp, cp, v, outp, begin, end);
  });
}

// Whether some quotient a[i] / b[i] (a[i] / v where b is None) of float32 operands is nonzero and
// below 2^-125 in magnitude: a site `pointwise` does not take (pointwise.py `small_quotients`,
// bounds.py `_quotient`). Each quotient is IEEE's float64 one, as `kDiv` computes it.
OVT_CLONES
int64_t count_small_quotients(const float* a, const float* b, double v, int64_t begin,
                              int64_t end) {
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double q = std::fabs(double{a[i]} / (b != nullptr ? double{b[i]} : v));
    count += static_cast<int64_t>(q < 0x1p-125) & static_cast<int64_t>(q != 0);
  }
  return count;
}

bool small_quotients(const at::Tensor& a, const c10::optional<at::Tensor>& b, double v) {
  const int64_t n = a.numel();
  const float* ap = operand(a, n, "a", true);
  const float* bp = operand(b, n, "b", b.has_value());
  std::atomic<int64_t> found{0};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    found += count_small_quotients(ap, bp, v, begin, end);
  });
  return found.load() != 0;
}

// The foreach form of `pointwise` (pointwise.py `ForeachCall`): list element i is
// pointwise(op, a[i], b[i], c[i], v[i]) into out[i], each operand of a[i]'s shape (no
// broadcast); b and c empty where the op has no such operand.
void check_lists(const char* name, int64_t op, at::TensorList a, at::TensorList b,
                 at::TensorList c, at::ArrayRef<double> v) {
  TORCH_CHECK(op >= kMulScalar && op <= kDiv, name, ": unknown op ", op);
  TORCH_CHECK(b.size() == (has_b(op) ? a.size() : 0) && c.size() == (has_c(op) ? a.size() : 0) &&
                  v.size() == a.size(),
              name, ": ", a.size(), " elements, but ", b.size(), " b, ", c.size(), " c and ",
              v.size(), " numbers for op ", op);
}

// Whether t is an operand the list form takes for an element whose a is `a`.
bool list_operand(const at::Tensor& t, const at::Tensor& a) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() &&
         t.sizes() == a.sizes();
}

// Whether `pointwise_list` serves these lists, asked before anything is claimed or written:
// every tensor a contiguous float32 CPU tensor, not empty, of its a[i]'s shape; in place, each
// a[i]'s memory its own and an operand in written memory only its element's a[i] itself, so
// that every element is read before it is written, as on the widened path, which reads copies
// (pointwise.py `fused_plan`); and no quotient below 2^-125 (`small_quotients`). Returns the
// elements' total, or -1 where it does not serve.
int64_t pointwise_list_serves(int64_t op, at::TensorList a, at::TensorList b, at::TensorList c,
                              at::ArrayRef<double> v, bool in_place) {
  check_lists("pointwise_list_serves", op, a, b, c, v);
  int64_t total = 0;
  std::vector<const void*> written;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].numel() == 0 || !list_operand(a[i], a[i]) ||
        (has_b(op) && !list_operand(b[i], a[i])) || (has_c(op) && !list_operand(c[i], a[i]))) {
      return -1;
    }
    total += a[i].numel();
    if (in_place) written.push_back(a[i].storage().data());
  }
  if (in_place) {
    std::sort(written.begin(), written.end());
    if (std::adjacent_find(written.begin(), written.end()) != written.end()) return -1;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const at::TensorList& list : {b, c}) {
        if (list.empty()) continue;
        const at::Tensor& t = list[i];
        const void* memory = t.storage().data();
        const bool itself = memory == a[i].storage().data() && t.data_ptr() == a[i].data_ptr();
        if (!itself && std::binary_search(written.begin(), written.end(), memory)) return -1;
      }
    }
  }
  if (op == kDiv || op == kDivScalar) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (small_quotients(a[i], has_b(op) ? c10::optional<at::Tensor>(b[i]) : c10::nullopt,
                          v[i])) {
        return -1;
      }
    }
  }
  return total;
}

void pointwise_list(int64_t op, at::TensorList a, at::TensorList b, at::TensorList c,
                    at::ArrayRef<double> v, at::TensorList out) {
  check_lists("pointwise_list", op, a, b, c, v);
  TORCH_CHECK(out.size() == a.size(), "pointwise_list: ", a.size(), " elements, but ",
              out.size(), " results");
  for (size_t i = 0; i < a.size(); ++i) {
    pointwise(op, a[i], has_b(op) ? c10::optional<at::Tensor>(b[i]) : c10::nullopt,
              has_c(op) ? c10::optional<at::Tensor>(c[i]) : c10::nullopt, v[i], out[i], 1,
              a[i].numel());
  }
}

// The normalize formulas of normops.py (`normalize`, `normalize_backward`), computed straight
// from float32 operands to float32 results, as the torch ops on widened operands compute them:
// one IEEE operation at a time in float64, in the order written (-ffp-contract=off), each
// result converted once. The statistics and parameters are per run of `n` elements: a layer
// norm row (its mean and rstd, with a weight and bias per element) or a batch norm channel's
// run (all four per channel).
// A layer norm row: weight and bias per element (either may be null).
OVT_CLONES
void normalize_row(const float* x, float* out, int64_t n, double mean, double rstd,
                   const float* weight, const float* bias) {
  for (int64_t i = 0; i < n; ++i) {
    double t = (double{x[i]} - mean) * rstd;
    if (weight != nullptr) t = t * double{weight[i]};
    if (bias != nullptr) t = t + double{bias[i]};
    out[i] = narrow(t);
  }
}

// A batch norm channel's run: weight and bias one value each, applied where `scaled` and
// `shifted` (a per-element load of one value would keep the loop from vectorising).
template <bool scaled, bool shifted>
OVT_CLONES void normalize_channel(const float* x, float* out, int64_t n, double mean, double rstd,
                                  double weight, double bias) {
  for (int64_t i = 0; i < n; ++i) {
    double t = (double{x[i]} - mean) * rstd;
    if (scaled) t = t * weight;
    if (shifted) t = t + bias;
    out[i] = narrow(t);
  }
}

OVT_CLONES
void normalize_backward_run(const float* g, const float* x, float* out, int64_t n, double mean,
                            double slope, double shift, double scale) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = narrow(((double{g[i]} - (double{x[i]} - mean) * slope) - shift) * scale);
  }
}

const float* norm_operand(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                  t.numel() == numel,
              "normalize: ", name, " must be a contiguous float32 CPU tensor of ", numel,
              " elements");
  return t.data_ptr<float>();
}

const float* norm_optional(const c10::optional<at::Tensor>& t, int64_t numel, const char* name) {
  return t.has_value() ? norm_operand(*t, numel, name) : nullptr;
}

// normops.normalize on x of (outer, channels, inner) elements: with `rows`, a layer norm's
// (channels 1): mean and rstd per outer index, weight and bias per inner one; else a batch
// norm's: all four per channel.
void normalize(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
               const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
               const at::Tensor& out, int64_t outer, int64_t channels, int64_t inner,
               bool rows) {
  TORCH_CHECK(outer >= 0 && channels >= 1 && inner >= 1 && (!rows || channels == 1),
              "normalize: bad layout");
  const int64_t n = outer * channels * inner;
  const int64_t stats = rows ? outer : channels, params = rows ? inner : channels;
  const float* xp = norm_operand(x, n, "x");
  float* op = const_cast<float*>(norm_operand(out, n, "out"));
  const float* mp = norm_operand(mean, stats, "mean");
  const float* rp = norm_operand(rstd, stats, "rstd");
  const float* wp = norm_optional(weight, params, "weight");
  const float* bp = norm_optional(bias, params, "bias");
  at::parallel_for(0, outer * channels, std::max<int64_t>(1, kGrain / inner),
                   [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      const int64_t s = rows ? run : run % channels;
      const float* xr = xp + run * inner;
      float* o = op + run * inner;
      const double m = double{mp[s]}, r = double{rp[s]};
      if (rows) {
        normalize_row(xr, o, inner, m, r, wp, bp);
        continue;
      }
      const double w = wp == nullptr ? 0.0 : double{wp[s]}, b = bp == nullptr ? 0.0 : double{bp[s]};
      if (wp != nullptr && bp != nullptr) {
        normalize_channel<true, true>(xr, o, inner, m, r, w, b);
      } else if (wp != nullptr) {
        normalize_channel<true, false>(xr, o, inner, m, r, w, b);
      } else if (bp != nullptr) {
        normalize_channel<false, true>(xr, o, inner, m, r, w, b);
      } else {
        normalize_channel<false, false>(xr, o, inner, m, r, w, b);
      }
    }
  });
}

// normops.normalize_backward on g and x of (outer, channels, inner) elements, every other
// operand per channel; `count` the elements a channel's sums ran over.
void normalize_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean,
                        const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                        const at::Tensor& sum_grad, const at::Tensor& sum_product,
                        const at::Tensor& out, int64_t outer, int64_t channels, int64_t inner,
                        int64_t count) {
  TORCH_CHECK(outer >= 0 && channels >= 1 && inner >= 1 && count >= 1,
              "normalize_backward: bad layout");
  const int64_t n = outer * channels * inner;
  const float* gp = norm_operand(g, n, "g");
  const float* xp = norm_operand(x, n, "x");
  float* op = const_cast<float*>(norm_operand(out, n, "out"));
  const float* mp = norm_operand(mean, channels, "mean");
  const float* rp = norm_operand(rstd, channels, "rstd");
  const float* wp = norm_optional(weight, channels, "weight");
  const float* s1 = norm_operand(sum_grad, channels, "sum_grad");
  const float* s2 = norm_operand(sum_product, channels, "sum_product");
  const double norm = 1.0 / static_cast<double>(count);
  std::vector<double> slope(channels), shift(channels), scale(channels);
  for (int64_t c = 0; c < channels; ++c) {  // as normops.normalize_backward forms them
    const double r = double{rp[c]};
    slope[c] = (double{s2[c]} * norm) * (r * r);
    shift[c] = double{s1[c]} * norm;
    scale[c] = wp == nullptr ? r : r * double{wp[c]};
  }
  at::parallel_for(0, outer * channels, std::max<int64_t>(1, kGrain / inner),
                   [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      const int64_t c = run % channels;
      normalize_backward_run(gp + run * inner, xp + run * inner, op + run * inner, inner,
                             double{mp[c]}, slope[c], shift[c], scale[c]);
    }
  });
}

// r[begin:end) = y[begin:end) rounded to nearest-even (a C++ cast, as torch's `to`).
OVT_CLONES
void narrow_range(const double* y, float* r, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) r[i] = narrow(y[i]);
}

// Writes y[begin:end) = r[begin:end) widened (`widen_back`: y then holds its own rounding, the
// compute-dtype copy a later op reads, so that none is made afresh).
OVT_CLONES
void widen_range(double* y, const float* r, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) y[i] = static_cast<double>(r[i]);
}

// How many equal chunks a band pass over n elements takes: a multiple of the intra-op thread
// count of at most kGrain elements each (`at::parallel_for` gives each thread a run of
// consecutive chunks: 81,920 elements in chunks of kGrain gave one thread two and the other one,
// and took as long as 131,072), but no more than n / kMinChunk (one for fewer than 2·kMinChunk
// elements): a chunk of fewer elements would cost more to schedule than it saves.
// The pass's results do not depend on the chunks (each element's rounding and band test are its
// own, the candidates are gathered in chunk order).
constexpr int64_t kMinChunk = 1 << 13;

int64_t band_chunks(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t most = std::max<int64_t>(1, n / kMinChunk);
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  const int64_t even = (chunks + threads - 1) / threads * threads;
  return std::max<int64_t>(1, std::min(even, most));
}

// With `widen_back`, y is overwritten, chunk by chunk once the chunk's candidates are taken,
// with r widened, unless a bound factor lies in y's memory (then y is left as it is); the last
// result says whether it was.
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> round_band(
    const at::Tensor& y, const at::Tensor& r, int64_t mode, const c10::optional<at::Tensor>& m,
    const c10::optional<at::Tensor>& col, const c10::optional<at::Tensor>& add, int64_t inner,
    int64_t rows, double scale, double floor, double weight, bool widen_back) {
  const int64_t n = site_length(y, r, "round_band");
  const Spec s = make_spec(n, mode, m, col, add, inner, rows, scale, floor, weight, y.device(),
                           "round_band");
  double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  const bool widen = widen_back && may_widen(yp, n, s, m, col, add);
  const int64_t chunks = band_chunks(n);
  const int64_t size = (n + chunks - 1) / chunks;
  // per chunk: its candidates, then their bounds and values (read before y is widened back)
  std::vector<std::vector<int64_t>> found(static_cast<size_t>(chunks));
  std::vector<std::vector<double>> found_bounds(static_cast<size_t>(chunks));
  std::vector<std::vector<double>> found_values(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const auto k = static_cast<size_t>(c);
      const int64_t begin = std::min(n, c * size), end = std::min(n, begin + size);
      scan(s, yp, rp, begin, end, found[k]);
      for (const int64_t i : found[k]) {
        found_bounds[k].push_back(bound_at(s, yp, i));
        found_values[k].push_back(yp[i]);
      }
      if (widen) widen_range(yp, rp, begin, end);
    }
  });
  size_t total = 0;
  for (const auto& f : found) total += f.size();
  const auto count = static_cast<int64_t>(total);
  at::Tensor candidates = at::empty({count}, y.options().dtype(at::kLong));
  at::Tensor bounds = at::empty({count}, y.options());
  at::Tensor values = at::empty({count}, y.options());
  int64_t* cp = candidates.data_ptr<int64_t>();
  double* bp = bounds.data_ptr<double>();
  double* vp = values.data_ptr<double>();
  for (size_t k = 0; k < found.size(); ++k) {
    cp = std::copy(found[k].begin(), found[k].end(), cp);
    bp = std::copy(found_bounds[k].begin(), found_bounds[k].end(), bp);
    vp = std::copy(found_values[k].begin(), found_values[k].end(), vp);
  }
  return {candidates, bounds, values, widen};
}

// y rounded to nearest-even into r (a cast, as `to` does, every NaN the one NaN) and, with
// `widen`, y overwritten with r widened, chunk by chunk while it is in the cache: the band
// pass's `widen_back` for a result with e = 0, or whose bounds are not read (a replayed site
// without entries); without it `bandpass.to_target` in one pass.
void nearest(const at::Tensor& y, const at::Tensor& r, bool widen) {
  const int64_t n = site_length(y, r, "nearest");
  double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kGrain) {
      const int64_t e = std::min(end, b + kGrain);
      narrow_range(yp, rp, b, e);
      if (widen) widen_range(yp, rp, b, e);
    }
  });
}

// Each band candidate's decision (rounding.py `SiteRecorder._decide`, the same tests on the same
// float64 operations): 0 where it is no entry (a y that is not finite, or δ > 2e), 3 for a value
// entry (wide · e >= the ULP of r = RNE(y)), else a direction: 2 where |r| > |y| (rounded away
// from zero), 1 where not. Candidates are few (a step's, about 1,600 in the transformer's), so
// one thread; the torch ops took a dozen passes of their own fixed cost.
at::Tensor decide(const at::Tensor& y, const at::Tensor& e, double overflow, double wide) {
  TORCH_CHECK(y.is_cpu() && e.is_cpu() && y.scalar_type() == at::kDouble &&
                  e.scalar_type() == at::kDouble && y.is_contiguous() && e.is_contiguous() &&
                  y.dim() == 1 && y.sizes() == e.sizes(),
              "decide: y and e must be contiguous 1-D float64 CPU tensors of one size");
  const int64_t n = y.numel();
  at::Tensor kind = at::empty({n}, y.options().dtype(at::kByte));
  const double* yp = y.data_ptr<double>();
  const double* ep = e.data_ptr<double>();
  uint8_t* kp = kind.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const double yv = yp[i], ev = ep[i];
    const float r = static_cast<float>(yv);
    uint8_t k = 0;
    if (ovt::finite(yv) && boundary_distance(yv, r, overflow) <= 2 * ev) {
      const bool up = magnitude(static_cast<double>(r)) > magnitude(yv);
      k = wide * ev >= target_ulp(r) ? 3 : (up ? 2 : 1);
    }
    kp[i] = k;
  }
  return kind;
}

// The roundings that the entries of one result give, where every entry in its range is valid
// (`apply_entries`), as (position in the result, float32 value) pairs, directions first; false
// at the first invalid one. RNE(y[i]) is read from rp, or computed where rp is null.
bool entry_roundings(const Spec& s, const double* yp, const float* rp, int64_t n, int64_t offset,
                     const at::Tensor& indices, const at::Tensor& up,
                     const at::Tensor& value_indices, const at::Tensor& values, double overflow,
                     double wide, std::vector<std::pair<int64_t, float>>& out) {
  const int64_t* dir = entry_indices(indices, "indices");
  const bool* dir_up = up.data_ptr<bool>();
  const int64_t* val = entry_indices(value_indices, "value_indices");
  const int64_t* bits = entry_indices(values, "values");
  const int64_t dirs = indices.numel(), vals = value_indices.numel();
  const auto mine = [offset, n](int64_t index) { return index >= offset && index < offset + n; };
  const auto nearest_at = [yp, rp](int64_t i) {
    return rp != nullptr ? rp[i] : narrow(yp[i]);
  };
  for (int64_t k = 0; k < dirs; ++k) {
    if (mine(dir[k]) && !direction_valid(s, yp, dir[k] - offset, nearest_at(dir[k] - offset),
                                         overflow)) {
      return false;
    }
  }
  for (int64_t k = 0; k < vals; ++k) {
    if (mine(val[k]) && !value_valid(s, yp, val[k] - offset, bits[k], overflow, wide)) {
      return false;
    }
  }
  for (int64_t k = 0; k < dirs; ++k) {
    if (!mine(dir[k])) continue;
    const int64_t i = dir[k] - offset;
    out.emplace_back(i, directed(nearest_at(i), yp[i], dir_up[k]));
  }
  for (int64_t k = 0; k < vals; ++k) {
    if (mine(val[k])) {
      const auto pattern = static_cast<int32_t>(static_cast<uint32_t>(bits[k]));
      out.emplace_back(val[k] - offset, as_float(pattern));
    }
  }
  return true;
}

// The replayer's logged entries of one result `y` of a site, the result at site positions
// [offset, offset + n) (rounding.py `SiteReplayer._apply_directions` and `_apply_values`, the
// same checks with the same operations): each entry in that range is checked — a direction
// entry needs e > 0, δ <= 4e and a finite y; a value entry e > 0, bits that fit float32, y
// within 4e of a boundary, 2·wide·e >= ULP(v), v not NaN and near y (within ULP(v)/2 + 4e; for
// an infinite v, y of its sign within 4e of the overflow threshold). Only if every one passes
// are they applied to r (float32, RNE(y)): directions by stepping one ULP where RNE went the
// other way, values by writing them. With `widen_back`, r need not hold RNE(y) yet: once the
// entries pass, one pass writes it and overwrites y with r widened (`nearest`), and the
// entries' roundings go into both (a result the caller owns: `round_result_in_place`).
// Returns whether they were applied; on false nothing is written and the caller's torch ops
// report the first violation.
bool apply_entries(const at::Tensor& y, const at::Tensor& r, int64_t offset,
                   const at::Tensor& indices, const at::Tensor& up,
                   const at::Tensor& value_indices, const at::Tensor& values, int64_t mode,
                   const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& col,
                   const c10::optional<at::Tensor>& add, int64_t inner, int64_t rows,
                   double scale, double floor, double weight, double overflow, double wide,
                   bool widen_back) {
  const int64_t n = site_length(y, r, "apply_entries");
  check_entries(indices, up, value_indices, values);
  const Spec s = make_spec(n, mode, m, col, add, inner, rows, scale, floor, weight, y.device(),
                           "apply_entries");
  double* yp = y.data_ptr<double>();
  float* rp = r.data_ptr<float>();
  std::vector<std::pair<int64_t, float>> roundings;
  if (!entry_roundings(s, yp, widen_back ? nullptr : rp, n, offset, indices, up, value_indices,
                       values, overflow, wide, roundings)) {
    return false;
  }
  if (widen_back) nearest(y, r, true);
  for (const auto& [i, v] : roundings) {
    rp[i] = v;
    if (widen_back) yp[i] = static_cast<double>(v);
  }
  return true;
}

// The bound rules' own arithmetic (bounds.py `_sum`, `_embedding_backward`, `_norms`,
// `_channel_sums`, `_window_norms`, `_layer_norm_backward`, `_softmax_backward`,
// `_log_softmax_backward`). Unlike the passes above these have no torch
// twin that gives the same bits: each computes a bound, whose sums may run in any order
// (`bounds.SAFETY` covers a sum's own rounding). Each sum here runs in one fixed order, whatever
// the thread count: the same bits on every run and machine.

// Four float64 lanes (GCC and clang vector extensions): the sums below are written in them, in
// interleaved partial sums, since the compiler does not reorder a sum itself (-fno-fast-math).
// (Each helper is inlined, so no Lanes value crosses a call: GCC's note that one would pass
// differently with AVX enabled does not apply.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef double Lanes __attribute__((vector_size(32)));
typedef int64_t LaneBits __attribute__((vector_size(32)));
typedef float FloatLanes __attribute__((vector_size(16)));
constexpr int64_t kWidth = 4;

__attribute__((always_inline)) inline Lanes load_lanes(const double* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

__attribute__((always_inline)) inline Lanes load_lanes(const float* p) {
  FloatLanes x;
  std::memcpy(&x, p, sizeof x);
  return __builtin_convertvector(x, Lanes);
}

__attribute__((always_inline)) inline void store_lanes(double* p, Lanes x) { std::memcpy(p, &x, sizeof x); }

__attribute__((always_inline)) inline Lanes abs_lanes(Lanes x) {
  return reinterpret_cast<Lanes>(reinterpret_cast<LaneBits>(x) & kAbsMask);
}

__attribute__((always_inline)) inline double sum_lanes(Lanes x) { return (x[0] + x[1]) + (x[2] + x[3]); }

// Σ_j term_j for j < n in float64, the order every sum here keeps: positions j into lane j % 8
// (two sets of four), the lanes added up in order, then the last n % 8 terms in order.
// `lanes(j)` gives terms j .. j + 3, `one(j)` term j.
template <typename LaneTerms, typename Term>
__attribute__((always_inline)) inline double lane_sum(int64_t n, LaneTerms lanes, Term one) {
  const Lanes zero = {0.0, 0.0, 0.0, 0.0};
  Lanes s0 = zero, s1 = zero;
  int64_t j = 0;
  for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
    s0 += lanes(j);
    s1 += lanes(j + kWidth);
  }
  double total = sum_lanes(s0) + sum_lanes(s1);
  for (; j < n; ++j) total += one(j);
  return total;
}

// Σ |x_j| for j < n in float64 (`lane_sum`).
template <typename T>
OVT_CLONES double magnitude_sum(const T* __restrict__ x, int64_t n) {
  return lane_sum(n, [x](int64_t j) { return abs_lanes(load_lanes(x + j)); },
                  [x](int64_t j) { return std::fabs(static_cast<double>(x[j])); });
}

// acc[c] += row[c]^2 for c < count, in float64.
template <typename T>
OVT_CLONES void add_squares(const T* __restrict__ row, double* __restrict__ acc, int64_t count) {
  for (int64_t c = 0; c < count; ++c) {
    const double v = row[c];
    acc[c] += v * v;
  }
}

// Σ x_j² for j < n in float64 (`lane_sum`).
template <typename T>
OVT_CLONES double square_sum(const T* __restrict__ x, int64_t n) {
  return lane_sum(n,
                  [x](int64_t j) {
                    const Lanes v = load_lanes(x + j);
                    return v * v;
                  },
                  [x](int64_t j) {
                    const double v = x[j];
                    return v * v;
                  });
}

// A norm along a dimension not adjacent in memory sums its squares in runs of this many terms,
// each run's sum in order, the runs' sums added in order: one order whatever the thread count,
// which `norms` and `matrix_norms` (whose runs of rows go to threads of their own) both keep.
constexpr int64_t kColumnRun = 64;

// out[a, c] = sqrt(sum over k of x[a, k, c]^2), x read through the strides (sa, sk, sc) from xp,
// in float64. Where k steps by one (a row in memory: a linear layer's inputs, its weights'
// rows) each norm is one `square_sum`, in its lane order, parallel over the rows (1.1-1.4x
// `vector_norm`'s speed on float64 rows on the development machine), a run longer than kGrain
// block by block; else in k order by runs (`kColumnRun`), adjacent columns together, parallel over
// blocks of c within each a.
template <typename T>
void norms_run(const T* xp, double* out, int64_t outer, int64_t reduced, int64_t inner,
               int64_t sa, int64_t sk, int64_t sc) {
  if (sk == 1) {  // each (a, c) a contiguous run of `reduced`: out holds them in that order
    const int64_t items = outer * inner;
    if (reduced <= kGrain) {
      at::parallel_for(0, items, std::max<int64_t>(1, kGrain / std::max<int64_t>(reduced, 1)),
                       [&](int64_t first, int64_t last) {
        int64_t a = first / inner, c = first % inner;
        for (int64_t item = first; item < last; ++item) {
          out[item] = std::sqrt(square_sum(xp + a * sa + c * sc, reduced));
          if (++c == inner) {
            c = 0;
            ++a;
          }
        }
      });
      return;
    }
    // Longer runs (a vector's norm, a few long rows): blocks of kGrain summed in parallel, then
    // each run's block sums added in block order, the same order whatever the thread count.
    const int64_t blocks = (reduced + kGrain - 1) / kGrain;
    std::vector<double> partial(static_cast<size_t>(items * blocks));
    at::parallel_for(0, items * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t unit = first; unit < last; ++unit) {
        const int64_t item = unit / blocks, start = (unit % blocks) * kGrain;
        const T* row = xp + (item / inner) * sa + (item % inner) * sc + start;
        partial[static_cast<size_t>(unit)] = square_sum(row, std::min(kGrain, reduced - start));
      }
    });
    for (int64_t item = 0; item < items; ++item) {
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) total += partial[static_cast<size_t>(item * blocks + b)];
      out[item] = std::sqrt(total);
    }
    return;
  }
  constexpr int64_t kColumns = 256;  // adjacent columns together
  const int64_t width = std::min<int64_t>(std::max<int64_t>(inner, 1), kColumns);
  const int64_t blocks = (inner + width - 1) / width;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(reduced * width, 1));
  at::parallel_for(0, outer * blocks, grain, [&](int64_t first, int64_t last) {
    double part[kColumns];
    for (int64_t item = first; item < last; ++item) {
      const int64_t a = item / blocks, c0 = (item % blocks) * width;
      const int64_t n = std::min(inner, c0 + width) - c0;
      double* acc = out + a * inner + c0;
      for (int64_t c = 0; c < n; ++c) acc[c] = 0.0;
      const T* base = xp + a * sa + c0 * sc;
      for (int64_t k0 = 0; k0 < reduced; k0 += kColumnRun) {  // (`kColumnRun`'s order)
        for (int64_t c = 0; c < n; ++c) part[c] = 0.0;
        for (int64_t k = k0; k < std::min(reduced, k0 + kColumnRun); ++k) {
          const T* row = base + k * sk;
          if (sc == 1) {
            add_squares(row, part, n);
          } else {
            for (int64_t c = 0; c < n; ++c) {
              const double v = row[c * sc];
              part[c] += v * v;
            }
          }
        }
        for (int64_t c = 0; c < n; ++c) acc[c] += part[c];
      }
      for (int64_t c = 0; c < n; ++c) acc[c] = std::sqrt(acc[c]);
    }
  });
}

// The Euclidean norms of x viewed as (outer, reduced, inner) with strides (sa, sk, sc) from its
// storage offset, over `reduced`: a contiguous float64 tensor of outer x inner.
at::Tensor norms(const at::Tensor& x, int64_t outer, int64_t reduced, int64_t inner, int64_t sa,
                 int64_t sk, int64_t sc) {
  TORCH_CHECK((x.dtype() == at::kDouble || x.dtype() == at::kFloat) && x.device().is_cpu(),
              "norms: x must be a float64 or float32 CPU tensor");
  TORCH_CHECK(outer >= 0 && reduced >= 0 && inner >= 0, "norms: negative sizes");
  if (outer * reduced * inner > 0) {  // the largest offset read must lie in x's storage
    const int64_t last = (outer - 1) * sa + (reduced - 1) * sk + (inner - 1) * sc;
    TORCH_CHECK(sa >= 0 && sk >= 0 && sc >= 0 && x.storage_offset() + last <
                    static_cast<int64_t>(x.storage().nbytes() / x.element_size()),
                "norms: the view reaches outside x's storage");
  }
  at::Tensor out = at::empty({outer, inner}, x.options().dtype(at::kDouble));
  if (x.dtype() == at::kDouble) {
    norms_run(x.data_ptr<double>(), out.data_ptr<double>(), outer, reduced, inner, sa, sk, sc);
  } else {
    norms_run(x.data_ptr<float>(), out.data_ptr<double>(), outer, reduced, inner, sa, sk, sc);
  }
  return out;
}

// Both norms of each matrix of x viewed as (batch, rows, cols), strides (sb, sr, 1): each
// row's over its columns (`square_sum`, as `norms` along a dimension adjacent in memory) and
// each column's over its rows (by runs of `kColumnRun` rows, as `norms` along any other
// dimension), in one read of x (bounds.py `BoundContext.norms`): the same bits as the two
// `norms` calls. The runs of rows in parallel, each run's column sums kept apart, then added
// in order.
template <typename T>
void matrix_norms_run(const T* xp, double* row_out, double* col_out, int64_t batch,
                      int64_t rows, int64_t cols, int64_t sb, int64_t sr) {
  const int64_t runs = (rows + kColumnRun - 1) / kColumnRun;
  std::vector<double> partial(static_cast<size_t>(batch * runs * cols));
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(kColumnRun * cols, 1));
  at::parallel_for(0, batch * runs, grain, [&](int64_t first, int64_t last) {
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b = unit / runs, r0 = (unit % runs) * kColumnRun;
      double* part = partial.data() + unit * cols;
      for (int64_t c = 0; c < cols; ++c) part[c] = 0.0;
      for (int64_t r = r0; r < std::min(rows, r0 + kColumnRun); ++r) {
        const T* row = xp + b * sb + r * sr;
        row_out[b * rows + r] = std::sqrt(square_sum(row, cols));
        add_squares(row, part, cols);
      }
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    double* acc = col_out + b * cols;
    for (int64_t c = 0; c < cols; ++c) acc[c] = 0.0;
    for (int64_t run = 0; run < runs; ++run) {
      const double* part = partial.data() + (b * runs + run) * cols;
      for (int64_t c = 0; c < cols; ++c) acc[c] += part[c];
    }
    for (int64_t c = 0; c < cols; ++c) acc[c] = std::sqrt(acc[c]);
  }
}

std::tuple<at::Tensor, at::Tensor> matrix_norms(const at::Tensor& x, int64_t batch, int64_t rows,
                                                int64_t cols, int64_t sb, int64_t sr) {
  TORCH_CHECK((x.dtype() == at::kDouble || x.dtype() == at::kFloat) && x.device().is_cpu(),
              "matrix_norms: x must be a float64 or float32 CPU tensor");
  TORCH_CHECK(batch >= 0 && rows >= 0 && cols >= 0 && cols <= kGrain,
              "matrix_norms: negative sizes, or rows longer than one run");
  if (batch * rows * cols > 0) {
    const int64_t last = (batch - 1) * sb + (rows - 1) * sr + (cols - 1);
    TORCH_CHECK(sb >= 0 && sr >= 0 && x.storage_offset() + last <
                    static_cast<int64_t>(x.storage().nbytes() / x.element_size()),
                "matrix_norms: the view reaches outside x's storage");
  }
  at::Tensor row_out = at::empty({batch, rows}, x.options().dtype(at::kDouble));
  at::Tensor col_out = at::empty({batch, cols}, x.options().dtype(at::kDouble));
  if (x.dtype() == at::kDouble) {
    matrix_norms_run(x.data_ptr<double>(), row_out.data_ptr<double>(), col_out.data_ptr<double>(),
                     batch, rows, cols, sb, sr);
  } else {
    matrix_norms_run(x.data_ptr<float>(), row_out.data_ptr<double>(), col_out.data_ptr<double>(),
                     batch, rows, cols, sb, sr);
  }
  return {row_out, col_out};
}

// Rows [o0, o1) of `sum_terms` with inner = 1: each row's smallest nonzero magnitude (as bits)
// into m and its Σ|x| into sums, and whether every element read is a float32 value. A block at
// a time: its Σ|x| (`magnitude_sum`, the blocks' sums added in order), then, from the cache,
// its minimum.
OVT_CLONES
int64_t row_terms(const double* x, int64_t* m, double* sums, int64_t reduced, int64_t o0,
                  int64_t o1) {
  constexpr int64_t kBlock = 2048;
  int64_t ok = 1;
  for (int64_t o = o0; o < o1; ++o) {
    const double* row = x + o * reduced;
    double total = 0.0;
    int64_t best = kInfBits;
    for (int64_t start = 0; start < reduced; start += kBlock) {
      const int64_t stop = std::min(reduced, start + kBlock);
      total += magnitude_sum(row + start, stop - start);
      for (int64_t r = start; r < stop; ++r) {
        const int64_t key = nonzero_key(row[r]);
        best = key < best ? key : best;
        ok &= holds_float32(row[r]);
      }
    }
    m[o] = best;
    sums[o] = total;
  }
  return ok;
}

// Each (outer, inner) column's smallest nonzero |x| over `reduced`, as bits, into m (+inf where
// all are zero), and its Σ|x| into sums, for x viewed as (outer, reduced, inner); and whether
// every element of x is a float32 value; where inner > 1, m and sums hold +inf's bits and 0 to
// start with (`column_terms` takes them further). A minimum and a conjunction are order-free
// (`nonzero_key`); each sum runs in one fixed order, whatever the thread count (`row_terms`;
// `column_terms`: in row order).
bool sum_terms(const double* xp, int64_t* mp, double* sp, int64_t outer, int64_t reduced,
               int64_t inner) {
  if (inner == 1) {  // a reduction along contiguous rows
    const int64_t rows = std::max<int64_t>(1, kGrain / std::max<int64_t>(reduced, 1));
    const int64_t chunks = (outer + rows - 1) / rows;
    std::vector<int64_t> exact(static_cast<size_t>(chunks), 1);
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t o0 = c * rows, o1 = std::min(outer, (c + 1) * rows);
        exact[static_cast<size_t>(c)] = row_terms(xp, mp, sp, reduced, o0, o1);
      }
    });
    return std::all_of(exact.begin(), exact.end(), [](int64_t ok) { return ok; });
  }
  // at least a few cache lines of adjacent columns per work item, even for a long reduction
  const int64_t width = std::min<int64_t>(
      inner, std::max<int64_t>(16, kGrain / std::max<int64_t>(reduced, 1)));
  const int64_t blocks = inner == 0 ? 0 : (inner + width - 1) / width;
  std::vector<int64_t> exact(static_cast<size_t>(outer * blocks), 1);
  at::parallel_for(0, outer * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t o = item / blocks, i0 = (item % blocks) * width;
      const int64_t i1 = std::min(inner, i0 + width);
      exact[static_cast<size_t>(item)] = column_terms(
          xp + o * reduced * inner, mp + o * inner, sp + o * inner, reduced, inner, i0, i1);
    }
  });
  return std::all_of(exact.begin(), exact.end(), [](int64_t ok) { return ok; });
}

// The exact-sum rule (bounds.py `_sum` and `_exact_where`): x viewed as (a, b, c), summed over
// b (keep_middle false: one sum per (a, c)) or over a and c (true: one per b: each (a, b) row's
// terms, then the rows' in a order). Each sum's bound is e = s·scale + floor, s its Σ|x|
// (`sum_terms`), but 0 where every order of the sum is exact — all terms zero, or
// s·slack < limit·m, m the float32 ULP of its smallest nonzero |term| — provided every element
// of x is a float32 value (else the rule does not apply, and e = s·scale + floor throughout).
at::Tensor sum_bound(const at::Tensor& x, int64_t a, int64_t b, int64_t c, bool keep_middle,
                     double scale, double floor, double slack, double limit) {
  TORCH_CHECK(x.dtype() == at::kDouble && x.is_contiguous() && x.device().is_cpu(),
              "sum_bound: x must be a contiguous float64 CPU tensor");
  TORCH_CHECK(a >= 0 && b >= 0 && c >= 0 && x.numel() == a * b * c,
              "sum_bound: x does not have ", a, " x ", b, " x ", c, " elements");
  const int64_t sums = keep_middle ? b : a * c;
  at::Tensor e = at::empty({sums}, x.options());
  std::vector<int64_t> smallest(static_cast<size_t>(sums), kInfBits);
  std::vector<double> total(static_cast<size_t>(sums), 0.0);
  const double* xp = x.data_ptr<double>();
  bool representable;
  if (keep_middle) {
    std::vector<int64_t> rows(static_cast<size_t>(a * b));
    std::vector<double> row_sums(static_cast<size_t>(a * b));
    representable = sum_terms(xp, rows.data(), row_sums.data(), a * b, c, 1);
    for (int64_t i = 0; i < a; ++i) {
      for (int64_t j = 0; j < b; ++j) {
        const size_t at = static_cast<size_t>(i * b + j), to = static_cast<size_t>(j);
        smallest[to] = rows[at] < smallest[to] ? rows[at] : smallest[to];
        total[to] += row_sums[at];
      }
    }
  } else {
    representable = sum_terms(xp, smallest.data(), total.data(), a, b, c);
  }
  double* ep = e.data_ptr<double>();
  for (int64_t o = 0; o < sums; ++o) {
    const int64_t key = smallest[static_cast<size_t>(o)];
    const double s = total[static_cast<size_t>(o)];
    const bool exact = representable && (key == kInfBits ||
        s * slack < limit * target_ulp(static_cast<float>(as_double(key))));
    ep[o] = exact ? 0.0 : s * scale + floor;
  }
  return e;
}

// The embedding backward's rule (bounds.py `_embedding_backward`): row w of the result sums the
// gradient rows (grad viewed as (positions, width)) of the positions whose index is w, except
// those at padding_idx, which the op skips. Each element's bound is e = s·scale + floor, s its
// Σ|g| (summed here in position order), but 0 where every order of its sum is exact: no terms
// (every row no index names), all terms zero, or s·slack < limit·m, m the float32 ULP of its
// smallest nonzero |term| — the last provided every element of grad is a float32 value, the
// padding positions' too (as the torch ops decide it, `_holds_target_values`: every party
// decides alike). Only the named rows are worked out; parallel over blocks of columns, each
// walking the positions in order.
at::Tensor embedding_backward_bound(const at::Tensor& grad, const at::Tensor& indices,
                                    int64_t num_weights, int64_t padding_idx, double scale,
                                    double floor, double slack, double limit) {
  TORCH_CHECK(grad.dtype() == at::kDouble && grad.dim() == 2 && grad.is_contiguous() &&
                  grad.device().is_cpu(),
              "embedding_backward_bound: grad must be a contiguous 2-D float64 CPU tensor");
  TORCH_CHECK(indices.dtype() == at::kLong && indices.dim() == 1 && indices.is_contiguous() &&
                  indices.device().is_cpu() && indices.numel() == grad.size(0),
              "embedding_backward_bound: indices must be a contiguous int64 CPU vector of ",
              grad.size(0), " positions");
  TORCH_CHECK(num_weights >= 0, "embedding_backward_bound: num_weights must not be negative");
  const int64_t positions = grad.size(0), width = grad.size(1);
  const int64_t* ip = indices.data_ptr<int64_t>();
  std::vector<int64_t> slot(static_cast<size_t>(num_weights), -1);  // row -> its slot, or -1
  std::vector<int64_t> rows;  // the named rows, in the order first named
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t w = ip[p];
    TORCH_CHECK(w >= 0 && w < num_weights, "embedding_backward_bound: index ", w,
                " is out of range for ", num_weights, " rows");
    if (w == padding_idx || slot[static_cast<size_t>(w)] >= 0) continue;
    slot[static_cast<size_t>(w)] = static_cast<int64_t>(rows.size());
    rows.push_back(w);
  }
  const int64_t named = static_cast<int64_t>(rows.size());
  std::vector<double> sums(static_cast<size_t>(named * width), 0.0);
  std::vector<int64_t> smallest(static_cast<size_t>(named * width), kInfBits);
  const double* gp = grad.data_ptr<double>();
  const int64_t block = std::min<int64_t>(
      width, std::max<int64_t>(16, kGrain / std::max<int64_t>(positions, 1)));
  const int64_t blocks = width == 0 ? 0 : (width + block - 1) / block;
  std::vector<int64_t> exact(static_cast<size_t>(blocks), 1);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t c0 = item * block, c1 = std::min(width, c0 + block);
      int64_t ok = 1;
      for (int64_t p = 0; p < positions; ++p) {
        const int64_t w = ip[p];
        if (w == padding_idx) {  // no terms, but read for the float32 check all the same
          const double* row = gp + p * width;
          for (int64_t c = c0; c < c1; ++c) ok &= holds_float32(row[c]);
          continue;
        }
        const int64_t at = slot[static_cast<size_t>(w)] * width;
        ok &= column_terms(gp + p * width, smallest.data() + at, sums.data() + at, 1, width,
                           c0, c1);
      }
      exact[static_cast<size_t>(item)] = ok;
    }
  });
  const bool representable =
      std::all_of(exact.begin(), exact.end(), [](int64_t ok) { return ok; });
  at::Tensor e = at::zeros({num_weights, width}, grad.options());
  double* ep = e.data_ptr<double>();
  for (int64_t k = 0; k < named; ++k) {
    double* out = ep + rows[static_cast<size_t>(k)] * width;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t key = smallest[static_cast<size_t>(k * width + c)];
      const double total = sums[static_cast<size_t>(k * width + c)];
      const bool zero = representable && (key == kInfBits ||
          total * slack < limit * target_ulp(static_cast<float>(as_double(key))));
      out[c] = zero ? 0.0 : total * scale + floor;
    }
  }
  return e;
}

// One (n, c) run of `size` elements: its squares added into acc[s], and into out its Σ t² and
// Σ |t| (two sets of lanes, positions s into lane s % 8, added up in lane order).
template <typename T>
OVT_CLONES void channel_run(const T* __restrict__ run, double* __restrict__ acc, int64_t size,
                            double* __restrict__ out) {
  const Lanes zero = {0.0, 0.0, 0.0, 0.0};
  Lanes q0 = zero, q1 = zero, a0 = zero, a1 = zero;
  int64_t s = 0;
  for (; s + 2 * kWidth <= size; s += 2 * kWidth) {
    const Lanes x0 = load_lanes(run + s), x1 = load_lanes(run + s + kWidth);
    const Lanes s0 = x0 * x0, s1 = x1 * x1;
    store_lanes(acc + s, load_lanes(acc + s) + s0);
    store_lanes(acc + s + kWidth, load_lanes(acc + s + kWidth) + s1);
    q0 += s0;
    q1 += s1;
    a0 += abs_lanes(x0);
    a1 += abs_lanes(x1);
  }
  double q = sum_lanes(q0) + sum_lanes(q1), a = sum_lanes(a0) + sum_lanes(a1);
  for (; s < size; ++s) {
    const double v = run[s];
    acc[s] += v * v;
    q += v * v;
    a += std::fabs(v);
  }
  out[0] = q;
  out[1] = a;
}

// Per-sample and per-channel sums of t viewed as (N, C, S), S the spatial size (bounds.py
// `_channel_sums`): Σ_c t² per (n, s) — a convolution's window norms start from these — and per
// channel Σ t² and Σ |t|, in float64. Each (n, s) sums over c in order; each channel's run of S
// elements per sample in interleaved lanes (`channel_run`), then the samples' sums in order.
template <typename T>
void channel_sums_run(const T* tp, double* spatial, double* squares, double* magnitudes,
                      int64_t samples, int64_t channels, int64_t size) {
  std::vector<double> cells(static_cast<size_t>(samples * channels * 2));
  at::parallel_for(0, samples, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      double* acc = spatial + n * size;
      for (int64_t s = 0; s < size; ++s) acc[s] = 0.0;
      for (int64_t c = 0; c < channels; ++c) {
        channel_run(tp + (n * channels + c) * size, acc, size,
                    cells.data() + (n * channels + c) * 2);
      }
    }
  });
  for (int64_t c = 0; c < channels; ++c) {
    double q = 0.0, a = 0.0;
    for (int64_t n = 0; n < samples; ++n) {
      const double* cell = cells.data() + (n * channels + c) * 2;
      q += cell[0];
      a += cell[1];
    }
    squares[c] = q;
    magnitudes[c] = a;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> channel_sums(const at::Tensor& t) {
  TORCH_CHECK((t.dtype() == at::kDouble || t.dtype() == at::kFloat) && t.is_contiguous() &&
                  t.device().is_cpu() && t.dim() >= 2,
              "channel_sums: t must be a contiguous float64 or float32 CPU tensor of two or "
              "more dimensions");
  const int64_t samples = t.size(0), channels = t.size(1);
  const int64_t size = samples > 0 && channels > 0 ? t.numel() / (samples * channels) : 0;
  const auto options = t.options().dtype(at::kDouble);
  at::Tensor spatial = at::empty({samples, size}, options);
  at::Tensor squares = at::empty({channels}, options), magnitudes = at::empty({channels}, options);
  double* out[] = {spatial.data_ptr<double>(), squares.data_ptr<double>(),
                   magnitudes.data_ptr<double>()};
  if (t.dtype() == at::kDouble) {
    channel_sums_run(t.data_ptr<double>(), out[0], out[1], out[2], samples, channels, size);
  } else {
    channel_sums_run(t.data_ptr<float>(), out[0], out[1], out[2], samples, channels, size);
  }
  return {spatial, squares, magnitudes};
}

// A layer norm row's P1 = Σ a, Σ a·|x| and Σ a·|x − mean| into out, a = |g·w| (|g| where w is
// null), in lanes (`channel_run`).
OVT_CLONES void layer_norm_row_sums(const double* __restrict__ g, const double* __restrict__ x,
                                    const double* __restrict__ w, double mean, int64_t n,
                                    double* __restrict__ out) {
  const Lanes zero = {0.0, 0.0, 0.0, 0.0};
  Lanes p = zero, q = zero, d = zero;
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    const Lanes gj = load_lanes(g + j), xj = load_lanes(x + j);
    const Lanes a = abs_lanes(w ? gj * load_lanes(w + j) : gj);
    p += a;
    q += a * abs_lanes(xj);
    d += a * abs_lanes(xj - mean);
  }
  double ps = sum_lanes(p), qs = sum_lanes(q), ds = sum_lanes(d);
  for (; j < n; ++j) {
    const double a = std::fabs(w ? g[j] * w[j] : g[j]);
    ps += a;
    qs += a * std::fabs(x[j]);
    ds += a * std::fabs(x[j] - mean);
  }
  out[0] = ps;
  out[1] = qs;
  out[2] = ds;
}

// A layer norm row's dx bases: a·lead + (|x − mean|·spread_dev + (|x| + mu)·spread_x) + constant.
OVT_CLONES void layer_norm_row_bases(const double* __restrict__ g, const double* __restrict__ x,
                                     const double* __restrict__ w, double mean, double mu,
                                     int64_t n, double spread_dev, double spread_x, double lead,
                                     double constant, double* __restrict__ out) {
  for (int64_t j = 0; j < n; ++j) {
    const double a = std::fabs(w ? g[j] * w[j] : g[j]);
    const double spread = std::fabs(x[j] - mean) * spread_dev + (std::fabs(x[j]) + mu) * spread_x;
    out[j] = a * lead + spread + constant;
  }
}

// One layer norm row's terms of dw's and db's column sums: (|x| + mu)·|g|·rho and |g|.
OVT_CLONES void layer_norm_column_terms(const double* __restrict__ g, const double* __restrict__ x,
                                        double mu, double rho, int64_t count,
                                        double* __restrict__ dw, double* __restrict__ db) {
  for (int64_t j = 0; j < count; ++j) {
    const double ag = std::fabs(g[j]);
    dw[j] += (std::fabs(x[j]) + mu) * ag * rho;
    db[j] += ag;
  }
}

// The source row (or column) that output row (or column) `p` of a 2-D convolution's windows
// reads at kernel offset `k`, -1 outside a source of `size` rows (`window_norms`): not
// transposed, p·stride − pad + k·dil; transposed, the position t / stride whose window reads
// p, t = p + pad − k·dil, where stride divides t.
int64_t window_source(int64_t p, int64_t k, int64_t stride, int64_t pad, int64_t dil,
                      int64_t size, bool transposed) {
  if (!transposed) {
    const int64_t at = p * stride - pad + k * dil;
    return at >= 0 && at < size ? at : -1;
  }
  const int64_t t = p + pad - k * dil;
  return t >= 0 && t % stride == 0 && t / stride < size ? t / stride : -1;
}

void check_window_shape(const char* op, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                        int64_t stride_w, int64_t dil_h, int64_t dil_w, int64_t out_h,
                        int64_t out_w) {
  TORCH_CHECK(kernel_h >= 1 && kernel_w >= 1 && stride_h >= 1 && stride_w >= 1 &&
                  dil_h >= 1 && dil_w >= 1 && out_h >= 0 && out_w >= 0,
              op, ": kernel, stride and dilation must be positive");
}

// A 2-D convolution's window norms (bounds.py `_window_norms`): from squares (N, H, W), the
// per-sample sums over channels of a tensor's squares, out[n, p, q] = the square root of the
// sum of those its window reads — not transposed, the positions (p·s_h − pad_h + i·d_h,
// q·s_w − pad_w + j·d_w) inside H x W for each kernel offset (i, j); transposed, the positions
// (a, b) whose window reads (p, q) — p = a·s_h − pad_h + i·d_h, likewise q — an out_h x out_w
// grid (`window_source`). Summed over i, then j, in order.
at::Tensor window_norms(const at::Tensor& squares, int64_t kernel_h, int64_t kernel_w,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                        int64_t dil_h, int64_t dil_w, bool transposed, int64_t out_h,
                        int64_t out_w) {
  TORCH_CHECK(squares.dtype() == at::kDouble && squares.is_contiguous() &&
                  squares.device().is_cpu() && squares.dim() == 3,
              "window_norms: squares must be a contiguous float64 CPU tensor (N, H, W)");
  check_window_shape("window_norms", kernel_h, kernel_w, stride_h, stride_w, dil_h, dil_w, out_h,
                     out_w);
  const int64_t samples = squares.size(0), h = squares.size(1), w = squares.size(2);
  at::Tensor out = at::empty({samples, out_h, out_w}, squares.options());
  const double* sp = squares.data_ptr<double>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, samples, 1, [&](int64_t n0, int64_t n1) {
    std::vector<int64_t> cols(static_cast<size_t>(out_w * kernel_w));
    for (int64_t q = 0; q < out_w; ++q) {
      for (int64_t j = 0; j < kernel_w; ++j) {
        cols[static_cast<size_t>(q * kernel_w + j)] =
            window_source(q, j, stride_w, pad_w, dil_w, w, transposed);
      }
    }
    for (int64_t n = n0; n < n1; ++n) {
      const double* plane = sp + n * h * w;
      for (int64_t p = 0; p < out_h; ++p) {
        double* row = op + (n * out_h + p) * out_w;
        for (int64_t q = 0; q < out_w; ++q) row[q] = 0.0;
        for (int64_t i = 0; i < kernel_h; ++i) {
          const int64_t src = window_source(p, i, stride_h, pad_h, dil_h, h, transposed);
          if (src < 0) continue;
          const double* line = plane + src * w;
          for (int64_t q = 0; q < out_w; ++q) {
            const int64_t* at = cols.data() + q * kernel_w;
            double total = row[q];
            for (int64_t j = 0; j < kernel_w; ++j) total += at[j] >= 0 ? line[at[j]] : 0.0;
            row[q] = total;
          }
        }
        for (int64_t q = 0; q < out_w; ++q) row[q] = std::sqrt(row[q]);
      }
    }
  });
  return out;
}

// `window_norms` (not transposed) where a replayer reads a convolution's bounds only (bounds.py
// `_window_norms_read`: at its log's entries), straight from the tensor t (N, C, H, W) whose
// squares it sums: (N, out_h, out_w), at the window position (n, p, q) of each of `positions`
// that falls in the convolution's result y (N, channels, out_h, out_w) — a hostile log's others
// are passed over here, and checked where they are read — the same bits as
// window_norms(Σ_c t², ...) there (each source position's Σ_c t² summed over c in order from
// 0.0, as `channel_sums` does it, then those of the window over i, then j, in order: a source
// outside adds nothing there, x + 0.0 being x for the sums' x >= 0), and 0 everywhere else,
// below every norm: a bound read there by mistake is too small, and can only reject an entry.
// One thread: a few hundred windows.
template <typename T>
void window_norms_at_run(const T* tp, const int64_t* positions, int64_t count, int64_t channels,
                         const int64_t* t_shape, const int64_t* window, double* out,
                         int64_t out_h, int64_t out_w) {
  const int64_t t_channels = t_shape[1], h = t_shape[2], w = t_shape[3], plane = h * w;
  const int64_t spatial = out_h * out_w, numel = t_shape[0] * channels * spatial;
  const int64_t kernel_h = window[0], kernel_w = window[1], stride_h = window[2],
                stride_w = window[3], pad_h = window[4], pad_w = window[5], dil_h = window[6],
                dil_w = window[7];
  std::vector<char> done(static_cast<size_t>(t_shape[0] * spatial), 0);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t at = positions[k];
    if (at < 0 || at >= numel) continue;
    const int64_t n = at / (channels * spatial), column = n * spatial + at % spatial;
    if (done[static_cast<size_t>(column)]) continue;  // (a position of another channel's)
    done[static_cast<size_t>(column)] = 1;
    const int64_t p = at % spatial / out_w, q = at % out_w;
    const T* sample = tp + n * t_channels * plane;
    double total = 0.0;
    for (int64_t i = 0; i < kernel_h; ++i) {
      const int64_t a = window_source(p, i, stride_h, pad_h, dil_h, h, false);
      if (a < 0) continue;
      for (int64_t j = 0; j < kernel_w; ++j) {
        const int64_t b = window_source(q, j, stride_w, pad_w, dil_w, w, false);
        if (b < 0) continue;
        double square = 0.0;
        for (int64_t c = 0; c < t_channels; ++c) {
          const double v = sample[c * plane + a * w + b];
          square += v * v;
        }
        total += square;
      }
    }
    out[column] = std::sqrt(total);
  }
}

at::Tensor window_norms_at(const at::Tensor& t, const at::Tensor& positions, int64_t channels,
                           int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                           int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dil_h,
                           int64_t dil_w, int64_t out_h, int64_t out_w) {
  TORCH_CHECK((t.dtype() == at::kDouble || t.dtype() == at::kFloat) && t.is_contiguous() &&
                  t.device().is_cpu() && t.dim() == 4,
              "window_norms_at: t must be a contiguous float64 or float32 CPU tensor "
              "(N, C, H, W)");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() &&
                  positions.device().is_cpu() && positions.dim() == 1,
              "window_norms_at: positions must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(channels >= 1, "window_norms_at: channels must be at least 1");
  check_window_shape("window_norms_at", kernel_h, kernel_w, stride_h, stride_w, dil_h, dil_w,
                     out_h, out_w);
  at::Tensor out = at::zeros({t.size(0), out_h, out_w}, t.options().dtype(at::kDouble));
  const int64_t t_shape[] = {t.size(0), t.size(1), t.size(2), t.size(3)};
  const int64_t window[] = {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w};
  if (t.dtype() == at::kDouble) {
    window_norms_at_run(t.data_ptr<double>(), positions.data_ptr<int64_t>(), positions.numel(),
                        channels, t_shape, window, out.data_ptr<double>(), out_h, out_w);
  } else {
    window_norms_at_run(t.data_ptr<float>(), positions.data_ptr<int64_t>(), positions.numel(),
                        channels, t_shape, window, out.data_ptr<double>(), out_h, out_w);
  }
  return out;
}

// The normalisation statistics (normops.py `norm_stats`, `norm_backward_stats`; SPEC §3.2.1):
// their own summation order, not torch's (the ops' rules hold for any order of their sums), on
// x viewed as (A, B, C), each of the B rows reduced over A and C — a layer norm's rows (A = 1)
// or a batch norm's channels (A samples of C positions). Each (a, b) run of C elements is summed
// in interleaved lanes (`channel_run`), then each row's A runs in order: the same bits whatever
// the thread count. Float64 operands, or float32 ones widened exactly as they are read: the
// same bits as on their float64 copies (the interceptor's narrow path, normops.py
// `narrow_statistics`).

// Σ x_j, and with `mean` given Σ (x_j − mean)², for j < n (each difference and square rounded
// on its own: -ffp-contract=off).
template <typename T>
OVT_CLONES double run_sum(const T* __restrict__ x, int64_t n) {
  return lane_sum(n, [x](int64_t j) { return load_lanes(x + j); },
                  [x](int64_t j) { return static_cast<double>(x[j]); });
}

template <typename T>
OVT_CLONES double run_deviation_squares(const T* __restrict__ x, double mean, int64_t n) {
  return lane_sum(n,
                  [x, mean](int64_t j) {
                    const Lanes d = load_lanes(x + j) - mean;
                    return d * d;
                  },
                  [x, mean](int64_t j) {
                    const double d = static_cast<double>(x[j]) - mean;
                    return d * d;
                  });
}

// Σ g_j and Σ (x_j − mean)·g_j for j < n, into out[0] and out[1].
template <typename T>
OVT_CLONES void run_backward_sums(const T* __restrict__ g, const T* __restrict__ x, double mean,
                                  int64_t n, double* __restrict__ out) {
  const Lanes zero = {0.0, 0.0, 0.0, 0.0};
  Lanes s0 = zero, s1 = zero, p0 = zero, p1 = zero;
  int64_t j = 0;
  for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
    const Lanes g0 = load_lanes(g + j), g1 = load_lanes(g + j + kWidth);
    s0 += g0;
    s1 += g1;
    p0 += (load_lanes(x + j) - mean) * g0;
    p1 += (load_lanes(x + j + kWidth) - mean) * g1;
  }
  double sg = sum_lanes(s0) + sum_lanes(s1), sp = sum_lanes(p0) + sum_lanes(p1);
  for (; j < n; ++j) {
    const double gj = g[j];
    sg += gj;
    sp += (static_cast<double>(x[j]) - mean) * gj;
  }
  out[0] = sg;
  out[1] = sp;
}

void check_stats_view(const at::Tensor& t, at::ScalarType dtype, int64_t a, int64_t b, int64_t c,
                      const char* name) {
  TORCH_CHECK((t.scalar_type() == at::kDouble || t.scalar_type() == at::kFloat) &&
                  t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
              name, ": the tensors must be contiguous CPU tensors, all float64 or all float32");
  TORCH_CHECK(a >= 0 && b >= 0 && c >= 0 && a * b * c == t.numel(), name,
              ": the view (A, B, C) does not hold the tensor's elements");
}

template <typename T>
void row_stats_run(const T* xp, double* mp, double* vp, int64_t a, int64_t b, int64_t c) {
  std::vector<double> cells(static_cast<size_t>(a * b));
  const double k = static_cast<double>(a * c);
  const int64_t grain = std::max<int64_t>(1, kGrain / c);
  auto rows = [&](double* out) {  // each row's cells added in order, divided by K
    for (int64_t row = 0; row < b; ++row) {
      double total = 0.0;
      for (int64_t i = 0; i < a; ++i) total += cells[static_cast<size_t>(i * b + row)];
      out[row] = total / k;
    }
  };
  at::parallel_for(0, a * b, grain, [&](int64_t first, int64_t last) {
    for (int64_t cell = first; cell < last; ++cell) {
      cells[static_cast<size_t>(cell)] = run_sum(xp + cell * c, c);
    }
  });
  rows(mp);
  at::parallel_for(0, a * b, grain, [&](int64_t first, int64_t last) {
    for (int64_t cell = first; cell < last; ++cell) {
      cells[static_cast<size_t>(cell)] = run_deviation_squares(xp + cell * c, mp[cell % b], c);
    }
  });
  rows(vp);
}

// Per row b of x viewed as (A, B, C): the mean Σ x / K and the biased variance
// Σ (x − mean)² / K, K = A·C, the deviations from the computed mean (two passes), in float64.
std::tuple<at::Tensor, at::Tensor> row_stats(const at::Tensor& x, int64_t a, int64_t b,
                                             int64_t c) {
  check_stats_view(x, x.scalar_type(), a, b, c, "row_stats");
  TORCH_CHECK(a * c > 0, "row_stats: empty rows have no statistics");
  const auto options = x.options().dtype(at::kDouble);
  at::Tensor mean = at::empty({b}, options), var = at::empty({b}, options);
  if (x.scalar_type() == at::kDouble) {
    row_stats_run(x.data_ptr<double>(), mean.data_ptr<double>(), var.data_ptr<double>(), a, b,
                  c);
  } else {
    row_stats_run(x.data_ptr<float>(), mean.data_ptr<double>(), var.data_ptr<double>(), a, b,
                  c);
  }
  return {mean, var};
}

template <typename T>
void row_backward_run(const T* gp, const T* xp, const T* mp, double* sg, double* sp, int64_t a,
                      int64_t b, int64_t c) {
  std::vector<double> cells(static_cast<size_t>(a * b * 2));
  at::parallel_for(0, a * b, std::max<int64_t>(1, kGrain / std::max<int64_t>(c, 1)),
                   [&](int64_t first, int64_t last) {
    for (int64_t cell = first; cell < last; ++cell) {
      run_backward_sums(gp + cell * c, xp + cell * c, static_cast<double>(mp[cell % b]), c,
                        cells.data() + cell * 2);
    }
  });
  for (int64_t row = 0; row < b; ++row) {
    double s = 0.0, p = 0.0;
    for (int64_t i = 0; i < a; ++i) {
      s += cells[static_cast<size_t>((i * b + row) * 2)];
      p += cells[static_cast<size_t>((i * b + row) * 2 + 1)];
    }
    sg[row] = s;
    sp[row] = p;
  }
}

// Per row b of g and x viewed as (A, B, C): Σ g and Σ (x − mean_b)·g, in float64.
std::tuple<at::Tensor, at::Tensor> row_backward_sums(const at::Tensor& g, const at::Tensor& x,
                                                     const at::Tensor& mean, int64_t a, int64_t b,
                                                     int64_t c) {
  check_stats_view(x, x.scalar_type(), a, b, c, "row_backward_sums");
  check_stats_view(g, x.scalar_type(), a, b, c, "row_backward_sums");
  check_stats_view(mean, x.scalar_type(), 1, b, 1, "row_backward_sums");
  const auto options = x.options().dtype(at::kDouble);
  at::Tensor sum_grad = at::empty({b}, options), sum_product = at::empty({b}, options);
  if (x.scalar_type() == at::kDouble) {
    row_backward_run(g.data_ptr<double>(), x.data_ptr<double>(), mean.data_ptr<double>(),
                     sum_grad.data_ptr<double>(), sum_product.data_ptr<double>(), a, b, c);
  } else {
    row_backward_run(g.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(),
                     sum_grad.data_ptr<double>(), sum_product.data_ptr<double>(), a, b, c);
  }
  return {sum_grad, sum_product};
}

// One (a, b) run of n elements for `row_extremes`: into out its max x, min x, whether a NaN is
// among them (1 or 0) and, where g is given, Σ |g| (`magnitude_sum`). The
// extremes are compared in x's own type (exact), a full vector of it at a time, in two chains.
template <typename T>
OVT_CLONES void extremes_run(const T* __restrict__ x, const T* __restrict__ g, int64_t n,
                             double* __restrict__ out) {
  typedef T Native __attribute__((vector_size(32)));
  constexpr int64_t width = 32 / sizeof(T);
  Native h0, l0;
  for (int64_t i = 0; i < width; ++i) {
    h0[i] = -INFINITY;
    l0[i] = INFINITY;
  }
  Native h1 = h0, l1 = l0;
  auto nan = h0 != h0;  // (all false: a mask of x's width)
  int64_t j = 0;
  for (; j + 2 * width <= n; j += 2 * width) {
    Native v0, v1;
    std::memcpy(&v0, x + j, sizeof v0);
    std::memcpy(&v1, x + j + width, sizeof v1);
    h0 = v0 > h0 ? v0 : h0;
    h1 = v1 > h1 ? v1 : h1;
    l0 = v0 < l0 ? v0 : l0;
    l1 = v1 < l1 ? v1 : l1;
    nan |= (v0 != v0) | (v1 != v1);
  }
  double top = -INFINITY, bottom = INFINITY;
  bool any_nan = false;
  for (int64_t i = 0; i < width; ++i) {
    top = std::max({top, static_cast<double>(h0[i]), static_cast<double>(h1[i])});
    bottom = std::min({bottom, static_cast<double>(l0[i]), static_cast<double>(l1[i])});
    any_nan = any_nan || nan[i] != 0;
  }
  for (; j < n; ++j) {
    const double v = x[j];
    top = v > top ? v : top;
    bottom = v < bottom ? v : bottom;
    any_nan = any_nan || v != v;
  }
  out[0] = top;
  out[1] = bottom;
  out[2] = any_nan ? 1.0 : 0.0;
  out[3] = g == nullptr ? 0.0 : magnitude_sum(g, n);
}

template <typename T>
void row_extremes_run(const T* xp, const T* gp, double* top, double* bottom, double* magnitudes,
                      int64_t a, int64_t b, int64_t c) {
  std::vector<double> cells(static_cast<size_t>(a * b * 4));
  at::parallel_for(0, a * b, std::max<int64_t>(1, kGrain / std::max<int64_t>(c, 1)),
                   [&](int64_t first, int64_t last) {
    for (int64_t cell = first; cell < last; ++cell) {
      extremes_run(xp + cell * c, gp == nullptr ? nullptr : gp + cell * c, c,
                   cells.data() + cell * 4);
    }
  });
  for (int64_t row = 0; row < b; ++row) {
    double h = -INFINITY, l = INFINITY, m = 0.0;
    bool any_nan = false;
    for (int64_t i = 0; i < a; ++i) {
      const double* cell = cells.data() + (i * b + row) * 4;
      h = cell[0] > h ? cell[0] : h;
      l = cell[1] < l ? cell[1] : l;
      any_nan = any_nan || cell[2] != 0.0;
      m += cell[3];
    }
    top[row] = any_nan ? NAN : h;
    bottom[row] = any_nan ? NAN : l;
    if (magnitudes != nullptr) magnitudes[row] = m;
  }
}

// Per row b of x viewed as (A, B, C) (`row_stats`): max x and min x (NaN where a NaN is among
// them, as torch's amax and amin), and where g (x's shape and dtype) is given Σ |g| in float64
// (else an empty tensor) — the statistics' rules' terms (bounds.py `_norm_stats_rule`,
// `_norm_backward_stats`), in one read. The extremes are exact in any order; the sum is in this
// kernel's fixed order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_extremes(const at::Tensor& x,
                                                            const c10::optional<at::Tensor>& g,
                                                            int64_t a, int64_t b, int64_t c) {
  check_stats_view(x, x.scalar_type(), a, b, c, "row_extremes");
  if (g.has_value()) check_stats_view(*g, x.scalar_type(), a, b, c, "row_extremes");
  TORCH_CHECK(a * c > 0, "row_extremes: empty rows have no extremes");
  const auto options = x.options().dtype(at::kDouble);
  at::Tensor top = at::empty({b}, options), bottom = at::empty({b}, options);
  at::Tensor magnitudes = at::empty({g.has_value() ? b : 0}, options);
  double* mp = g.has_value() ? magnitudes.data_ptr<double>() : nullptr;
  if (x.dtype() == at::kDouble) {
    row_extremes_run(x.data_ptr<double>(), g.has_value() ? g->data_ptr<double>() : nullptr,
                     top.data_ptr<double>(), bottom.data_ptr<double>(), mp, a, b, c);
  } else {
    row_extremes_run(x.data_ptr<float>(), g.has_value() ? g->data_ptr<float>() : nullptr,
                     top.data_ptr<double>(), bottom.data_ptr<double>(), mp, a, b, c);
  }
  return {top, bottom, magnitudes};
}

constexpr double kLog2e = 1.4426950408889634;  // log2(e), rounded: within u of it

// An upper bound on exp(y), within 6.2 % of it where it is a normal float64: exp(y) = 2^t,
// t = y·log2(e), computed here with at most 3u·|t| of error (log2(e) rounded, the product, this
// add) and raised by 16u·|t|; with n = floor(t) and f = t − n in [0, 1), 2^f <= 1 + f (2^f is
// convex), so 2^t <= (1 + f)·2^n, raised by 4u for 1 + f's rounding (where t is tiny, 1 + f
// rounds to 1, below 1 + t); below the normals 2^(n + 1), and below the subnormals the smallest
// one (exp(y) > 0). exp(−inf) = 0, +inf gives +inf, NaN NaN.
inline double exp_above(double y) {
  if (y == -INFINITY) return 0.0;
  const double t0 = y * kLog2e;
  const double t = t0 + std::fabs(t0) * 0x1p-49;
  if (!(t < 1024.0)) return t != t ? t : INFINITY;
  const double n = std::floor(t);
  if (n < -1021.0) return n < -1075.0 ? 0x1p-1074 : std::ldexp(1.0, static_cast<int>(n) + 1);
  const double power = as_double((static_cast<int64_t>(n) + 1023) << 52);  // 2^n, normal
  return (1.0 + (t - n)) * power * (1.0 + 0x1p-51);
}

// exp_above on four lanes whose t lies in [-1021, 1024) (the caller checks), the same values:
// floor by the 1.5·2^52 rounding trick (t is far below 2^51) and 2^n from n's bits.
__attribute__((always_inline)) inline Lanes exp_above_lanes(Lanes y) {
  constexpr double kRound = 0x1.8p52;
  const Lanes t0 = y * kLog2e;
  const Lanes t = t0 + abs_lanes(t0) * 0x1p-49;
  Lanes n = (t + kRound) - kRound;  // t rounded to an integer
  n -= reinterpret_cast<Lanes>(reinterpret_cast<LaneBits>(n > t) & reinterpret_cast<LaneBits>(
      Lanes{1.0, 1.0, 1.0, 1.0}));  // now floor(t)
  const LaneBits bits =
      reinterpret_cast<LaneBits>(n + kRound) - __builtin_bit_cast(int64_t, kRound);  // n
  return (1.0 + (t - n)) * reinterpret_cast<Lanes>((bits + 1023) << 52) * (1.0 + 0x1p-51);
}

// One row of `log_softmax_backward_bound`: four elements at a time where each one's t is in
// exp_above_lanes' range, else one at a time.
OVT_CLONES void log_softmax_backward_row(const double* __restrict__ g, const double* __restrict__ y,
                                         int64_t k, double coefficient, double extra,
                                         double total, double* __restrict__ out) {
  const auto one = [&](int64_t i) {
    out[i] = (exp_above(y[i]) * coefficient + extra) * total + std::fabs(g[i]);
  };
  int64_t j = 0;
  for (; j + kWidth <= k; j += kWidth) {
    const Lanes yj = load_lanes(y + j);
    const Lanes t = yj * kLog2e;
    const LaneBits inside = (t > -1020.0) & (t < 1023.0);  // (NaN and ±inf fail both)
    if (inside[0] && inside[1] && inside[2] && inside[3]) {
      store_lanes(out + j, (exp_above_lanes(yj) * coefficient + extra) * total +
                               abs_lanes(load_lanes(g + j)));
    } else {
      for (int64_t i = j; i < j + kWidth; ++i) one(i);
    }
  }
  for (; j < k; ++j) one(j);
}

// The bases of a softmax backward's rule for rows of k elements of g and y (contiguous float64,
// rows x k), each row's by `row(g_i, y_i, k, out_i)`, in parallel over rows.
template <typename Row>
at::Tensor row_bases(const char* op, const at::Tensor& g, const at::Tensor& y, Row row) {
  TORCH_CHECK(g.dtype() == at::kDouble && y.dtype() == at::kDouble && g.is_contiguous() &&
                  y.is_contiguous() && g.device().is_cpu() && y.device().is_cpu() &&
                  g.dim() == 2 && g.sizes() == y.sizes(),
              op, ": g and y must be contiguous float64 CPU tensors, rows x k");
  const int64_t rows = g.size(0), k = g.size(1);
  at::Tensor base = at::empty({rows, k}, g.options());
  const double* gp = g.data_ptr<double>();
  const double* yp = y.data_ptr<double>();
  double* bp = base.data_ptr<double>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(k, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) row(gp + i * k, yp + i * k, k, bp + i * k);
  });
  return base;
}

// The bases of bounds.py `_log_softmax_backward` (`row_bases`): exp_above(y_i)·coefficient +
// extra, times the row's G = Σ |g_j| (interleaved lanes), plus |g_i|.
at::Tensor log_softmax_backward_bound(const at::Tensor& g, const at::Tensor& y,
                                      double coefficient, double extra) {
  return row_bases("log_softmax_backward_bound", g, y,
                   [coefficient, extra](const double* gi, const double* yi, int64_t k,
                                        double* out) {
                     log_softmax_backward_row(gi, yi, k, coefficient, extra,
                                              magnitude_sum(gi, k), out);
                   });
}

// One row of `softmax_backward_bound`: P = Σ |g_j·y_j| (`lane_sum`), then each base.
OVT_CLONES void softmax_backward_row(const double* __restrict__ g, const double* __restrict__ y,
                                     int64_t k, double coefficient, double* __restrict__ out) {
  const double total =
      lane_sum(k, [g, y](int64_t j) { return abs_lanes(load_lanes(g + j) * load_lanes(y + j)); },
               [g, y](int64_t j) { return std::fabs(g[j] * y[j]); });
  const double factor = total * coefficient;
  for (int64_t i = 0; i < k; ++i) {
    out[i] = std::fabs(y[i]) * factor + 3.0 * std::fabs(g[i] * y[i]);
  }
}

// The bases of bounds.py `_softmax_backward` (`row_bases`): |y_i|·(P·coefficient) +
// 3·|g_i·y_i|, P = Σ_j |g_j·y_j| of the row.
at::Tensor softmax_backward_bound(const at::Tensor& g, const at::Tensor& y,
                                  double coefficient) {
  return row_bases("softmax_backward_bound", g, y,
                   [coefficient](const double* gi, const double* yi, int64_t k, double* out) {
                     softmax_backward_row(gi, yi, k, coefficient, out);
                   });
}

// The bases of bounds.py `_layer_norm_backward` (read its docstring for the terms), for rows of
// n elements of g and x (contiguous float64, rows x n), the rows' mean and rstd, the weight w
// (n values, or none) and u: dx's base per element, dw's and db's per column (each times its
// count: M + 5, M + 1). Each row's sums run left to right; each column's top to bottom.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_bound(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const c10::optional<at::Tensor>& w, double u) {
  for (const at::Tensor* t : {&g, &x, &mean, &rstd}) {
    TORCH_CHECK(t->dtype() == at::kDouble && t->is_contiguous() && t->device().is_cpu(),
                "layer_norm_backward_bound: operands must be contiguous float64 CPU tensors");
  }
  TORCH_CHECK(g.dim() == 2 && x.sizes() == g.sizes() && mean.numel() == g.size(0) &&
                  rstd.numel() == g.size(0),
              "layer_norm_backward_bound: g and x must be rows x n, mean and rstd one per row");
  const int64_t rows = g.size(0), n = g.size(1);
  const double* wp = nullptr;
  if (w.has_value()) {
    TORCH_CHECK(w->dtype() == at::kDouble && w->is_contiguous() && w->numel() == n,
                "layer_norm_backward_bound: w must be n contiguous float64 values");
    wp = w->data_ptr<double>();
  }
  const double* gp = g.data_ptr<double>();
  const double* xp = x.data_ptr<double>();
  const double* mp = mean.data_ptr<double>();
  const double* rp = rstd.data_ptr<double>();
  at::Tensor dx = at::empty({rows, n}, g.options());
  at::Tensor dw = at::empty({n}, g.options());
  at::Tensor db = at::empty({n}, g.options());
  double* dxp = dx.data_ptr<double>();
  const double count = static_cast<double>(n);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const double* gi = gp + i * n;
      const double* xi = xp + i * n;
      const double mu = std::fabs(mp[i]), rho = std::fabs(rp[i]), mean_i = mp[i];
      double sums[3];
      layer_norm_row_sums(gi, xi, wp, mean_i, n, sums);
      const double p1 = sums[0];
      double q = sums[1];
      const double q_dev = sums[2];
      q += mu * p1;
      const double cube = rho * rho * rho / count;
      const double b_hat = q_dev + q * ((count + 8.0) * u);
      const double spread_dev = cube * q * (count + 10.0), spread_x = cube * b_hat * 3.0;
      const double lead = rho * 7.0, constant = (rho * p1) * ((count + 6.0) / count);
      layer_norm_row_bases(gi, xi, wp, mean_i, mu, n, spread_dev, spread_x, lead, constant,
                           dxp + i * n);
    }
  });
  double* dwp = dw.data_ptr<double>();
  double* dbp = db.data_ptr<double>();
  const int64_t width = 64;
  at::parallel_for(0, (n + width - 1) / width, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t block = b0; block < b1; ++block) {
      const int64_t j0 = block * width, j1 = std::min(n, j0 + width);
      for (int64_t j = j0; j < j1; ++j) dwp[j] = dbp[j] = 0.0;
      for (int64_t i = 0; i < rows; ++i) {
        layer_norm_column_terms(gp + i * n + j0, xp + i * n + j0, std::fabs(mp[i]),
                                std::fabs(rp[i]), j1 - j0, dwp + j0, dbp + j0);
      }
      const double dw_count = static_cast<double>(rows) + 5.0;
      const double db_count = static_cast<double>(rows) + 1.0;
      for (int64_t j = j0; j < j1; ++j) {
        dwp[j] *= dw_count;
        dbp[j] *= db_count;
      }
    }
  });
  return {dx, dw, db};
}

// Philox4x32-10 (rng.py `philox4x32`, the same operations) into `out`: blocks first_block ..
// first_block + blocks - 1 of the stream keyed (k0, k1), block i's counter being
// (i mod 2**32, i >> 32, 0, 0) as `RandomStream.words` lays them out, four words each, in
// order. Pure 32-bit integer arithmetic: the same words on every machine.
void philox(uint32_t key0, uint32_t key1, uint64_t first_block, int64_t blocks, uint32_t* out) {
  constexpr uint64_t kM0 = 0xD2511F53, kM1 = 0xCD9E8D57;
  constexpr uint32_t kW0 = 0x9E3779B9, kW1 = 0xBB67AE85;
  // (grain: a draw of under 2**16 blocks, a dropout mask's, runs on the calling thread — a
  // parallel region costs more than it saves there, and stalls on a busy machine)
  at::parallel_for(0, blocks, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t block = first_block + static_cast<uint64_t>(i);
      uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32);
      uint32_t c2 = 0, c3 = 0, k0 = key0, k1 = key1;
      for (int round = 0; round < 10; ++round) {
        if (round) {
          k0 += kW0;  // (unsigned: wraps mod 2**32, as `& _MASK32` does)
          k1 += kW1;
        }
        const uint64_t p0 = kM0 * c0, p1 = kM1 * c2;
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(p1);
        c3 = static_cast<uint32_t>(p0);
        c0 = n0;
        c2 = n2;
      }
      uint32_t* w = out + 4 * i;
      w[0] = c0;
      w[1] = c1;
      w[2] = c2;
      w[3] = c3;
    }
  });
}

}  // namespace

TORCH_LIBRARY(ovt, lib) {
  lib.def(
      "round_band(Tensor(b!) y, Tensor(a!) r, int mode, Tensor? m, Tensor? col, Tensor? add, "
      "int inner, int rows, float scale, float floor, float weight, bool widen_back) "
      "-> (Tensor, Tensor, Tensor, bool)");
  lib.def("nearest(Tensor(b!) y, Tensor(a!) r, bool widen) -> ()");
  lib.def("decide(Tensor y, Tensor e, float overflow, float wide) -> Tensor");
  lib.def(
      "sum_bound(Tensor x, int a, int b, int c, bool keep_middle, float scale, "
      "float floor, float slack, float limit) -> Tensor");
  lib.def(
      "apply_entries(Tensor(b!) y, Tensor(a!) r, int offset, Tensor indices, Tensor up, "
      "Tensor value_indices, Tensor values, int mode, Tensor? m, Tensor? col, Tensor? add, "
      "int inner, int rows, float scale, float floor, float weight, float overflow, "
      "float wide, bool widen_back) -> bool");
  lib.def(
      "pointwise(int op, Tensor a, Tensor? b, Tensor? c, float v, Tensor(a!) out, int b_inner, "
      "int b_count) -> ()");
  lib.def("small_quotients(Tensor a, Tensor? b, float v) -> bool");
  lib.def(
      "pointwise_list_serves(int op, Tensor[] a, Tensor[] b, Tensor[] c, float[] v, "
      "bool in_place) -> int");
  lib.def(
      "pointwise_list(int op, Tensor[] a, Tensor[] b, Tensor[] c, float[] v, Tensor(a!)[] out) "
      "-> ()");
  lib.def(
      "norms(Tensor x, int outer, int reduced, int inner, int sa, int sk, int sc) -> Tensor");
  lib.def("matrix_norms(Tensor x, int batch, int rows, int cols, int sb, int sr) -> (Tensor, Tensor)");
  lib.def("channel_sums(Tensor t) -> (Tensor, Tensor, Tensor)");
  lib.def("softmax_backward_bound(Tensor g, Tensor y, float coefficient) -> Tensor");
  lib.def(
      "embedding_backward_bound(Tensor grad, Tensor indices, int num_weights, int padding_idx, "
      "float scale, float floor, float slack, float limit) -> Tensor");
  lib.def("row_stats(Tensor x, int a, int b, int c) -> (Tensor, Tensor)");
  lib.def("row_extremes(Tensor x, Tensor? g, int a, int b, int c) -> (Tensor, Tensor, Tensor)");
  lib.def(
      "row_backward_sums(Tensor g, Tensor x, Tensor mean, int a, int b, int c) "
      "-> (Tensor, Tensor)");
  lib.def(
      "log_softmax_backward_bound(Tensor g, Tensor y, float coefficient, float extra) -> Tensor");
  lib.def(
      "window_norms(Tensor squares, int kernel_h, int kernel_w, int stride_h, int stride_w, "
      "int pad_h, int pad_w, int dil_h, int dil_w, bool transposed, int out_h, int out_w) "
      "-> Tensor");
  lib.def(
      "window_norms_at(Tensor t, Tensor positions, int channels, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, "
      "int out_h, int out_w) -> Tensor");
  lib.def(
      "layer_norm_backward_bound(Tensor g, Tensor x, Tensor mean, Tensor rstd, Tensor? w, "
      "float u) -> (Tensor, Tensor, Tensor)");
  lib.def(
      "fused_normalize(Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, "
      "Tensor(a!) out, int outer, int channels, int inner, bool rows) -> ()");
  lib.def(
      "fused_normalize_backward(Tensor g, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, "
      "Tensor sum_grad, Tensor sum_product, Tensor(a!) out, int outer, int channels, int inner, "
      "int count) -> ()");
}

TORCH_LIBRARY_IMPL(ovt, CPU, lib) {
  lib.impl("round_band", &round_band);
  lib.impl("nearest", &nearest);
  lib.impl("decide", &decide);
  lib.impl("pointwise", &pointwise);
  lib.impl("small_quotients", &small_quotients);
  lib.impl("pointwise_list", &pointwise_list);
  lib.impl("sum_bound", &sum_bound);
  lib.impl("apply_entries", &apply_entries);
  lib.impl("norms", &norms);
  lib.impl("matrix_norms", &matrix_norms);
  lib.impl("layer_norm_backward_bound", &layer_norm_backward_bound);
  lib.impl("channel_sums", &channel_sums);
  lib.impl("softmax_backward_bound", &softmax_backward_bound);
  lib.impl("embedding_backward_bound", &embedding_backward_bound);
  lib.impl("row_stats", &row_stats);
  lib.impl("row_extremes", &row_extremes);
  lib.impl("row_backward_sums", &row_backward_sums);
  lib.impl("log_softmax_backward_bound", &log_softmax_backward_bound);
  lib.impl("window_norms", &window_norms);
  lib.impl("window_norms_at", &window_norms_at);
  lib.impl("fused_normalize", &normalize);
  lib.impl("fused_normalize_backward", &normalize_backward);
}

// Asked of lists on any device (a CUDA tensor among them makes the answer no, not a missing
// kernel): registered for every backend.
TORCH_LIBRARY_IMPL(ovt, CompositeExplicitAutograd, lib) {
  lib.impl("pointwise_list_serves", &pointwise_list_serves);
}

// `_fused.philox(key0, key1, first_block, blocks)`: a bytearray of the blocks' words (native
// byte order; rng.py reads it with numpy); fused.py checks the arguments' ranges ("K" wraps).
// A plain Python function, not a torch operator, so that no dispatch mode of a step (a step's
// randomness is drawn under one) sees it.
static PyObject* philox_words(PyObject*, PyObject* args) {
  unsigned long long key0 = 0, key1 = 0, first_block = 0;
  long long blocks = 0;
  if (!PyArg_ParseTuple(args, "KKKL", &key0, &key1, &first_block, &blocks)) return nullptr;
  if (key0 > 0xFFFFFFFFULL || key1 > 0xFFFFFFFFULL || blocks < 0 ||
      static_cast<unsigned long long>(blocks) > (PY_SSIZE_T_MAX >> 4)) {
    PyErr_SetString(PyExc_ValueError, "philox: 32-bit key words and 0 <= blocks < 2**59");
    return nullptr;
  }
  PyObject* out = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(blocks) * 16);
  if (out == nullptr) return nullptr;
  uint32_t* words = reinterpret_cast<uint32_t*>(PyByteArray_AS_STRING(out));
  Py_BEGIN_ALLOW_THREADS  // (no Python object is touched: `out` is this call's alone yet)
  philox(static_cast<uint32_t>(key0), static_cast<uint32_t>(key1), first_block, blocks, words);
  Py_END_ALLOW_THREADS
  return out;
}

static PyMethodDef fused_methods[] = {
    {"philox", philox_words, METH_VARARGS, "The words of Philox4x32-10 blocks (rng.py)."},
    {nullptr, nullptr, 0, nullptr}};

// An importable Python module: importing it loads this library, which registers
// torch.ops.ovt.* (and their CPU kernels); it holds `philox`, SOURCE and OWN_STANDARD_LIBRARY.
static PyModuleDef fused_module = {PyModuleDef_HEAD_INIT, "_fused", nullptr, -1, fused_methods};

PyMODINIT_FUNC PyInit__fused(void) { return ovt::describe_module(&fused_module); }
