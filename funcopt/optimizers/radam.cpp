// RAdam in one pass per element: the foreach formula of radam.py, op for op.
//
// The step-dependent scalars (rho_t, the rectification term, the two step
// sizes) are computed once per tensor in double from its step counter, as the
// Python formula does on the host.  The element loop is the same for both
// branches: buffer = 1 / ((sqrt(v) + eps) / rect_size) + unrect_size, where
// rect_size is -0.0 on an unrectified step (the buffer is then unrect_size,
// as in torch's foreach code, NaN/inf included).
//
// With funcopt's add_alpha / lerp / addcmul (torch's CPU rounding) the
// results are torch's to the bit except for sqrt: ATen's CPU sqrt is MKL's
// vsSqrt, not correctly rounded (1 ulp of sqrt(v) in ~1/6 of float32
// elements); this loop's sqrt is.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool maximize, bool coupled, bool decoupled>
void radam_loop(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, int64_t n,
                T wd, T decay, T w1, T beta2, T one_m_beta2, T eps, T rect, T unrect) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    T pi = p[i];
    if (coupled) gi = funcopt::add_alpha(gi, pi, wd);
    if (decoupled) pi = pi * decay;
    const T mi = funcopt::lerp(m[i], gi, w1);
    m[i] = mi;
    const T vi = funcopt::addcmul(v[i] * beta2, gi, gi, one_m_beta2);
    v[i] = vi;
    T buf = std::sqrt(vi) + eps;
    buf = buf / rect;
    buf = T(1) / buf;
    buf = buf + unrect;
    p[i] = funcopt::addcmul(pi, mi, buf, T(1));
  }
}

void radam(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize
  // state: step (0-d, bumped), exp_avg, exp_avg_sq
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
  const bool decoupled = h[5] != 0, maximize = h[6] != 0;
  const double rho_inf = 2 / (1 - beta2) - 1;
  std::vector<double> rects(n), unrects(n);
  for (size_t j = 0; j < n; ++j) {
    // radam.py: rho_t, r, bias_correction1, then the two step sizes (host doubles)
    const double t = funcopt::scalar_of(state[j]);
    const double rho = rho_inf - 2 * t * std::pow(beta2, t) / (1 - std::pow(beta2, t));
    double r = 0.0;
    if (rho > 5) r = std::pow((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho), 0.5);
    const double bc1 = 1 - std::pow(beta1, t);
    const double unrect = (lr * (r > 0 ? 0.0 : 1.0) / bc1) * -1;
    rects[j] = std::pow(1 - std::pow(beta2, t), 0.5) * (lr * r / bc1) * -1;
    unrects[j] = unrect;
  }
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::radam", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(wd != 0 && !decoupled, C, [&] {
    FUNCOPT_BOOL(wd != 0 && decoupled, D, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        radam_loop<T, M, C, D>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                               state[n + j].data_ptr<T>() + lo, state[2 * n + j].data_ptr<T>() + lo, hi - lo, T(wd),
                               T(1 - lr * wd), T(1 - beta1), T(beta2), T(1 - beta2), T(eps), T(rects[j]),
                               T(unrects[j]));
      });
    }); }); });
  });
}

}  // namespace

FUNCOPT_RULE("radam", radam, 3, 7);
