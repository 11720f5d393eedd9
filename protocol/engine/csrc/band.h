// One element's band arithmetic, shared by the CPU passes (fused.cpp) and the CUDA kernels
// (fused_cuda.cu): its bound (bounds.py `Affine`), whether it may lie within 2e of a float32
// rounding boundary (precision.py `band_candidates`), its distance from that boundary, and a
// logged entry's check and rounding (rounding.py `SiteReplayer`). One copy of each rule, so
// that both devices decide alike, bit for bit: every function here is IEEE operations on one
// element, with no fused multiply-add (both builds forbid contraction: -ffp-contract=off,
// --fmad=false).

#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OVT_ELEMENT __host__ __device__ __forceinline__
#else
#define OVT_ELEMENT __attribute__((always_inline)) inline
#endif

namespace ovt {

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
constexpr double kZeroBand54 = 0x1p-97;  // kZeroBand · 2**54
// A zero's `far` in `may_be_in_band`: below kZeroBand54, from where `in_band` keeps a zero. Its
// own `far`, 0, would put every block holding a zero through `in_band` (a masked softmax's
// results are half zeros: 2.4x the time of a block without).
constexpr double kZeroFar54 = 0x1p-98;
constexpr int64_t kTwo52Bits = 0x4330000000000000LL;  // the bits of 2**52
constexpr int64_t kInfBits = 0x7FF0000000000000LL;   // the bits of +inf
constexpr int32_t kAbsMask32 = 0x7FFFFFFF;
constexpr int32_t kInfBits32 = 0x7F800000;           // the bits of float32's +inf

// How an element's `base` is found (bounds.py `Affine`, in the same order).
enum Mode : int64_t {
  kRelative = 0,  // base = |y_i|
  kRows = 1,      // base = m[i / inner]  (m holds one value per run of `inner` elements),
                  //        + weight * |y_i| where weight is not 0
  kOuter = 2,     // base = m[i / inner] * col[(i / (rows * inner)) * inner + i % inner]
                  //        (+ add[i % inner] or + add[i], where `add` is given)
  kPlus = 3,      // base = |y_i| + weight * |add[i]|  (`add` one value per element)
};

// A result's bound (bandpass.py `_FlatBound`); its factors live on the result's device.
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
  double weight;  // kPlus's, and kRows's where not 0
};

// Bit patterns: the CUDA intrinsics on the device; on the host the compiler's builtin, or
// memcpy in nvcc's host pass, which need not know the builtin (`host_bit_cast`).
template <typename To, typename From>
OVT_ELEMENT To host_bit_cast(From v) {
#if defined(__CUDACC__)
  To out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  return __builtin_bit_cast(To, v);
#endif
}

OVT_ELEMENT int64_t bits_of(double v) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(__double_as_longlong(v));
#else
  return host_bit_cast<int64_t>(v);
#endif
}

OVT_ELEMENT double as_double(int64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  return host_bit_cast<double>(bits);
#endif
}

OVT_ELEMENT int32_t bits_of(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(v);
#else
  return host_bit_cast<int32_t>(v);
#endif
}

OVT_ELEMENT float as_float(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  return host_bit_cast<float>(bits);
#endif
}

// |v| (clearing the sign bit, as fabs does).
OVT_ELEMENT double magnitude(double v) { return as_double(bits_of(v) & kAbsMask); }

OVT_ELEMENT bool finite(double v) { return (bits_of(v) & kAbsMask) < kInfBits; }

OVT_ELEMENT bool infinite(float v) { return (bits_of(v) & kAbsMask32) == kInfBits32; }

OVT_ELEMENT bool not_a_number(float v) { return (bits_of(v) & kAbsMask32) > kInfBits32; }

// The one float32 NaN a rounding writes (bandpass.py `CANONICAL_NAN`): quiet, sign clear.
constexpr int32_t kQuietNaN32 = 0x7FC00000;

// A float64 value rounded to float32 as every rounding writes it (bandpass.py `to_target`):
// nearest-even, and a NaN as kQuietNaN32. The conversion itself keeps a NaN's sign and payload
// on a CPU, and writes 0x7FFFFFFF on a GPU, while the NaNs a float64 kernel makes differ by
// machine (a vectorised log1p or sum against the scalar one): honest parties would differ in
// a NaN's bits, and states are compared by hash. A blend of bits on the float32 value (a
// select there, or on the float64 test, kept the band pass from vectorising: 5x slower).
OVT_ELEMENT float narrow(double v) {
  const float r = static_cast<float>(v);
  const int32_t nan = -static_cast<int32_t>(r != r);  // all ones for a NaN
  return as_float((bits_of(r) & ~nan) | (kQuietNaN32 & nan));
}

// Element i's base (bounds.py `Affine`; bandpass.py `_FlatBound.at`, the same operations in the
// same order). The CPU band pass finds it row by row instead (fused.cpp `scan`), alike.
OVT_ELEMENT double base_at(const Spec& s, const double* y, int64_t i) {
  if (s.mode == kRelative) return magnitude(y[i]);
  if (s.mode == kPlus) return magnitude(y[i]) + s.weight * magnitude(s.add[i]);
  const int64_t row = i / s.inner;
  if (s.mode == kRows) return s.weight != 0 ? s.m[row] + s.weight * magnitude(y[i]) : s.m[row];
  const int64_t j = i % s.inner;
  double base = s.m[row] * s.col[(row / s.rows) * s.inner + j];
  if (s.add != nullptr) base = base + s.add[s.add_per_column ? j : i];
  return base;
}

// Element i's bound e at a candidate or a logged entry (bandpass.py `_FlatBound.at`: NaN as +inf).
OVT_ELEMENT double bound_at(const Spec& s, const double* y, int64_t i) {
  const double e = base_at(s, y, i) * s.scale + s.floor;
  if (e != e) return as_double(kInfBits);
  return e == -as_double(kInfBits) ? -DBL_MAX : e;  // (torch.nan_to_num's other replacement)
}

// 2**52 times the distance of y (of float64 bit pattern `bits`) from the midpoint of its float32
// ULP, exact where y is of float32's normal range: y's position inside that ULP in compute ULPs,
// the low 29 bits as a number (exact: (2**52 + low) - 2**52), less half the ULP, times 2**E of
// y's binade (0 below float64's normals).
OVT_ELEMENT double midpoint_distance(int64_t bits) {
  const double low = as_double(kTwo52Bits | (bits & kLowMask)) - 0x1p52;
  const double power = as_double(bits & kExpMask);
  return magnitude(low - static_cast<double>(kHalf)) * power;
}

// Whether y may lie within 2e of a rounding boundary, given e54 = e·2**54: precision.py
// `band_candidates`, the same decisions (below). Branch-free, so that the loops calling it
// vectorise; its comparisons are negated so that a NaN bound (which certifies nothing) lands in
// the band; a NaN or infinite y never does (no rounding choice).
OVT_ELEMENT int64_t in_band(double y, double e54) {
  const int64_t bits = bits_of(y);
  const double far = midpoint_distance(bits);
  const int64_t size = bits & kAbsMask;
  // below float32's smallest normal the ULP differs: a candidate, except a zero under e < 2^-151
  const int64_t small = size < kMinNormalBits;
  const int64_t small_keep =
      static_cast<int64_t>(size != 0) | static_cast<int64_t>(!(e54 < kZeroBand54));
  const int64_t normal_keep =
      static_cast<int64_t>(!(far > e54)) & static_cast<int64_t>(size < kExpMask);
  // e = 0: a correctly rounded result, never in the band
  return static_cast<int64_t>(!(e54 <= 0)) & ((small & small_keep) | ((1 - small) & normal_keep));
}

// A cheaper test that `in_band` implies (so a false here is a false there, for the same y and
// e54): y is nonzero and below float32's smallest normal, infinite or a NaN (in_band then
// decides by cases), or `far` <= e54 (every other y, above float32's largest value too), a
// zero's `far` taken as kZeroFar54. The CPU band pass runs it over each block first and
// `in_band` only over the blocks where it holds somewhere, with about half the instructions an
// element (fused.cpp `scan_range`).
OVT_ELEMENT int64_t may_be_in_band(double y, double e54) {
  const int64_t bits = bits_of(y);
  const int64_t size = bits & kAbsMask;
  // size - kMinNormalBits, unsigned, is below kExpMask - kMinNormalBits exactly for a size in
  // [kMinNormalBits, kExpMask): one compare for both ends of the range
  const uint64_t above_normal = static_cast<uint64_t>(size - kMinNormalBits);
  const int64_t other = static_cast<int64_t>(size != 0) &
      static_cast<int64_t>(above_normal >= static_cast<uint64_t>(kExpMask - kMinNormalBits));
  const double far = size == 0 ? kZeroFar54 : midpoint_distance(bits);
  return other | static_cast<int64_t>(!(far > e54));
}

// e·2**54 for e = t + floor, t = scale·base (two roundings, as in torch), given
// floor54 = floor·2**54: t·2**54 + floor54, so that no operand is subnormal where t is normal.
// A rule's floor is a few compute-dtype subnormals, and adding one to every element cost a
// microcode assist each (10x the pass's time). The band test decides alike: where t + floor is
// normal, scaling by 2**54 is exact on both sides of the sum (the same bits, times 2**54); where
// it is subnormal, e54 is zero exactly when e is (t and floor are both non-negative), and
// otherwise both lie below 2**-968 and 2**-97, where `far` is either 0 or at least 2**-155.
OVT_ELEMENT double scaled_bound(double t, double floor54) { return t * kBandScale + floor54; }

// float32's ULP just above |r| (precision.py `target_ulp`): 2**E of r's binade, the subnormal
// ULP for zero and subnormals, as float64.
OVT_ELEMENT double target_ulp(float r) {
  const int64_t field = (bits_of(r) & kAbsMask32) >> 23;
  return as_double(((field > 1 ? field : 1) - (127 + 23) + 1023) << 52);
}

// δ, the exact distance of y from its nearest rounding boundary, r = RNE(y) (precision.py
// `boundary_distance` and `_boundaries`, the same operations): half r's ULP above |r|, half the
// gap below it beneath (a quarter ULP at a power of two), the overflow threshold below an
// infinite r.
OVT_ELEMENT double boundary_distance(double y, float r, double overflow) {
  const double a = magnitude(y), b = magnitude(static_cast<double>(r));
  const double ulp = target_ulp(r), half = ulp * 0.5;
  const int32_t size = bits_of(r) & kAbsMask32;
  const bool power_of_two = (size & 0x7FFFFF) == 0 && (size >> 23) > 1;
  const double above = b + half;
  const double below = infinite(r) ? overflow : b - (power_of_two ? ulp * 0.25 : half);
  const double gap_above = magnitude(above - a), gap_below = magnitude(a - below);
  // torch.minimum; NaN only for a non-finite y, which no entry may have (checked by callers)
  return gap_above < gap_below ? gap_above : gap_below;
}

// Whether a direction entry at element i of y (rv = RNE(y_i)) is one an honest machine may log
// (rounding.py `_apply_directions`): e > 0, δ <= 4e and a finite y.
OVT_ELEMENT bool direction_valid(const Spec& s, const double* y, int64_t i, float rv,
                                 double overflow) {
  const double yv = y[i], ev = bound_at(s, y, i);
  return ev > 0 && boundary_distance(yv, rv, overflow) <= 4 * ev && finite(yv);
}

// The rounding a valid direction entry gives (rounding.py `step_toward`): rv where RNE went the
// logged way, else one ULP the other way (away from zero is +1 on the bit pattern, toward it -1).
OVT_ELEMENT float directed(float rv, double yv, bool up) {
  const bool away = magnitude(static_cast<double>(rv)) > magnitude(yv);
  return away == up ? rv : as_float(bits_of(rv) + (up ? 1 : -1));
}

// Whether a value entry of float32 bit pattern `bits` at element i of y is one an honest machine
// may log (rounding.py `_apply_values`): bits that fit float32, e > 0, y within 4e of a boundary,
// 2·wide·e >= ULP(v), v not NaN and near y (within ULP(v)/2 + 4e; for an infinite v, y of its
// sign within 4e of the overflow threshold), and a finite y.
OVT_ELEMENT bool value_valid(const Spec& s, const double* y, int64_t i, int64_t bits,
                             double overflow, double wide) {
  if (bits < 0 || bits > 0xFFFFFFFFLL) return false;
  const float v = as_float(static_cast<int32_t>(static_cast<uint32_t>(bits)));
  const double yv = y[i], ev = bound_at(s, y, i);
  const double ulp = target_ulp(v);
  const bool banded = boundary_distance(yv, static_cast<float>(yv), overflow) <= 4 * ev;
  const bool near = infinite(v) ? magnitude(yv) + 4 * ev >= overflow &&
                                      (bits_of(v) < 0) == (bits_of(yv) < 0)
                                : magnitude(static_cast<double>(v) - yv) <= ulp / 2 + 4 * ev;
  return ev > 0 && banded && 2 * wide * ev >= ulp && near && !not_a_number(v) && finite(yv);
}

}  // namespace ovt
