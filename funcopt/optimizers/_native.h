// funcopt native one-pass optimizer steps: shared declarations.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace funcopt {

// One update rule over aligned lists (one device, one dtype): params[j],
// grads[j], state[k * n + j] (slot k of parameter j; absent slots hold empty
// tensors), hyper (the rule's hyperparameters, in its Python spec's order).
// Every tensor has been checked (CPU, contiguous, the list's dtype) by the op.
// (Lists are views of the op's arguments: no copies, no reference-count traffic per tensor.)
using Rule = void (*)(at::TensorList params, at::TensorList grads, at::TensorList state,
                      at::ArrayRef<double> hyper);

struct RuleInfo {
  Rule fn;
  int64_t num_slots;
  int64_t num_hyper;
};

bool register_rule(const std::string& name, RuleInfo info);

// A 0-d state tensor (step counters, NAdam's mu_product, ASGD's eta and mu: any
// dtype), read once per tensor as Python's float(t.item()), and written back.
inline double scalar_of(const at::Tensor& t) {
  double v = 0;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, t.scalar_type(), "funcopt::scalar_of",
                             [&] { v = static_cast<double>(*t.data_ptr<scalar_t>()); });
  return v;
}
inline void set_scalar(const at::Tensor& t, double v) {
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, t.scalar_type(), "funcopt::set_scalar",
                             [&] { *t.data_ptr<scalar_t>() = static_cast<scalar_t>(v); });
}

// Every element of every tensor of the list in one at::parallel_for: one
// fork/join per step, not one per tensor.  The tensors' elements are one flat
// range cut into one contiguous part per intra-op thread (equal element counts;
// a cut inside a tensor falls on a multiple of 64 elements: whole cache lines
// and vectors for float32 and float64), and each part runs f(j, begin, end) on
// the pieces of the tensors it covers, in order: many small tensors are batched,
// a large one is split.  Below `grain` elements in all (or one thread, or
// inside a parallel region) the caller's thread runs f(j, 0, numel) for every
// tensor.  The split changes no number (the rules are elementwise).
// sizes[j]: tensor j's element count; f never sees an empty range.
template <typename F>
inline void for_each_chunk(const std::vector<int64_t>& sizes, const F& f, int64_t grain = int64_t(1) << 15) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t j = 0; j < n; ++j) start[j + 1] = start[j] + sizes[j];
  const int64_t total = start[n];
  int64_t parts = at::in_parallel_region() ? 1 : at::get_num_threads();
  parts = std::min(parts, (total + grain - 1) / grain);
  if (parts <= 1) {
    for (int64_t j = 0; j < n; ++j)
      if (sizes[j] > 0) f(j, int64_t(0), sizes[j]);
    return;
  }
  // the flat position where part t starts, moved down to a multiple of 64
  // elements of the tensor it falls in (both neighbours compute the same cut)
  auto cut = [&](int64_t t) -> int64_t {
    if (t >= parts) return total;
    const int64_t x = total / parts * t + (total % parts) * t / parts;
    const int64_t j = std::upper_bound(start.begin(), start.end(), x) - start.begin() - 1;
    return start[j] + (x - start[j]) / 64 * 64;
  };
  at::parallel_for(0, parts, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      int64_t lo = cut(t);
      const int64_t hi = cut(t + 1);
      int64_t j = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
      while (lo < hi) {
        const int64_t e = std::min(hi, start[j + 1]);
        if (e > lo) f(j, lo - start[j], e - start[j]);
        lo = e;
        ++j;
      }
    }
  });
}
inline std::vector<int64_t> numels(at::TensorList ts) {
  std::vector<int64_t> out(ts.size());
  for (size_t j = 0; j < ts.size(); ++j) out[j] = ts[j].numel();
  return out;
}

// torch's CPU kernels (its AVX2/AVX512 builds: at::vec fmadd is one rounding),
// element by element, so a rule written with these rounds as the foreach
// formula does.  Scalars are computed in double (as Python does) and cast to T
// once, outside the loop: pass them in, never compute (1 - beta) in T.
//   torch.add(a, b, alpha=s) / torch.sub(a, b, alpha=s): add_alpha(a, b, s) / add_alpha(a, b, -s)
// A CPU without FMA (and torch's own lowest CPU level) rounds twice: so do we there.
template <typename T>
inline T fma(T a, T b, T c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
template <typename T>
inline T add_alpha(T a, T b, T alpha) {
  return funcopt::fma(b, alpha, a);
}
//   torch.lerp(a, b, w)
template <typename T>
inline T lerp(T a, T b, T w) {
  return std::abs(w) < T(0.5) ? funcopt::fma(w, b - a, a) : funcopt::fma(w - T(1), b - a, b);
}
//   torch.addcmul(a, b, c, value=v)
template <typename T>
inline T addcmul(T a, T b, T c, T v) {
  return funcopt::fma(v * b, c, a);
}
//   torch.addcdiv(a, b, c, value=v)
template <typename T>
inline T addcdiv(T a, T b, T c, T v) {
  return a + (v * b) / c;
}
// mul, div, maximum, neg, abs: plain C++ (one rounding each, as torch).  sqrt:
// std::sqrt is correctly rounded; torch's CPU sqrt (MKL's vsSqrt) is not always,
// so a rule with a sqrt is within 1 ulp per step of the foreach formula.

}  // namespace funcopt

#define FUNCOPT_RULE(name, fn, slots, hyper) \
  static bool funcopt_rule_##fn = ::funcopt::register_rule(name, ::funcopt::RuleInfo{&fn, slots, hyper})

// Compile-time flags, so each variant's inner loop has no branches and vectorizes.
#define FUNCOPT_BOOL(cond, NAME, ...) \
  [&] {                               \
    if (cond) {                       \
      constexpr bool NAME = true;     \
      return __VA_ARGS__();           \
    } else {                          \
      constexpr bool NAME = false;    \
      return __VA_ARGS__();           \
    }                                 \
  }()
