// funcopt native one-pass optimizer steps: shared declarations.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <string>
#include <vector>

namespace funcopt {

// One update rule over aligned lists (one device, one dtype): params[j],
// grads[j], state[k * n + j] (slot k of parameter j; absent slots hold empty
// tensors), hyper (the rule's hyperparameters, in its Python spec's order).
// Every tensor has been checked (CPU, contiguous, the list's dtype) by the op.
using Rule = void (*)(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& state, const std::vector<double>& hyper);

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

// Elementwise loop over [0, n), split across intra-op threads in chunks that
// stay in cache; f(begin, end) runs the rule's inner loop.
template <typename F>
inline void chunks(int64_t n, const F& f) {
  at::parallel_for(0, n, 1 << 15, f);
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
