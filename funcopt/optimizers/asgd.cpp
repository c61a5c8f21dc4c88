// ASGD in one pass per element: the foreach formula of asgd.py, op for op.
//
// eta, mu and step are 0-d per-parameter tensors (float32 where asgd.py's
// init puts them; any dtype is read and written here, through data_ptr):
// each element loop reads its tensor's eta and mu once, and the new eta_t and
// mu_t of every tensor are written after the loops.  eta_t is computed as
// asgd.py computes it, with torch's tensor ops in the step counter's dtype
// (float32): lr * (1 / (1 + step * (lambd * lr))^alpha), with torch's pow
// (exponent 0.5 is its sqrt; -0.5, -1, 2, 3, -2 its other special cases;
// otherwise std::pow in double, rounded); mu_t = 1 / max(1, t - t0) in
// double, stored as float32 (torch.full), as asgd.py does on the host.
// add_alpha / addcmul: funcopt's, torch's CPU rounding; the results are
// torch.optim.ASGD(foreach=True)'s to the bit.
#include "_native.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/sqrt.h>
#include <cmath>

namespace {

// torch's pow(tensor, scalar exponent) on CPU for float/double, except 0.5
// (sqrt: see new_etas)
template <typename S>
inline S pow_scalar(S x, double e) {
  if (e == -0.5) return S(1) / std::sqrt(x);
  if (e == -1.0) return S(1) / x;
  if (e == 2.0) return x * x;
  if (e == 3.0) return x * x * x;
  if (e == -2.0) return static_cast<S>(1.0 / (x * x));
  return static_cast<S>(std::pow(x, e));
}

// asgd.py: new_etas = steps * (lambd * lr); += 1; pow_(alpha); reciprocal_(); *= lr;
// copy_ into etas.  Computed in the step counters' dtype S (float32 as asgd.py's
// init makes them).  pow_(0.5) is torch's sqrt, which ATen computes with MKL's
// vsSqrt (not correctly rounded; its per-element result depends on the value
// only): one at::sqrt over all of them gives torch's numbers to the bit.
template <typename S>
void new_etas(at::TensorList state, size_t n, double lr, double lambd, double alpha,
              at::ScalarType st) {
  std::vector<S> x(n);
  for (size_t j = 0; j < n; ++j) {
    S v = static_cast<S>(funcopt::scalar_of(state[j])) * static_cast<S>(lambd * lr);
    x[j] = v + S(1);
  }
  if (alpha == 0.5) {
    at::Tensor xs = at::empty({(int64_t)n}, at::TensorOptions().dtype(st));
    std::copy(x.begin(), x.end(), xs.data_ptr<S>());
    at::Tensor ys = at::sqrt(xs);
    const S* y = ys.data_ptr<S>();
    for (size_t j = 0; j < n; ++j) x[j] = y[j];
  } else {
    for (size_t j = 0; j < n; ++j) x[j] = pow_scalar<S>(x[j], alpha);
  }
  for (size_t j = 0; j < n; ++j) {
    S v = S(1) / x[j];
    v = v * static_cast<S>(lr);
    funcopt::set_scalar(state[n + j], static_cast<double>(v));
  }
}

template <typename T, bool maximize, bool decay>
void asgd_loop(T* __restrict p, const T* __restrict g, T* __restrict ax, int64_t n, T wd, T lambd, T eta,
               T mu) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = maximize ? -g[i] : g[i];
    const T pi = p[i];
    T inter = decay ? funcopt::add_alpha(gi, pi, wd) : gi;
    inter = funcopt::add_alpha(inter, pi, lambd);
    const T pn = funcopt::addcmul(pi, inter, eta, T(-1));
    p[i] = pn;
    const T ai = ax[i];
    ax[i] = funcopt::addcmul(ai, pn - ai, mu, T(1));
  }
}

void asgd(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: lr, lambd, alpha, t0, weight_decay, maximize
  // state: step (0-d, bumped), eta (0-d), mu (0-d), ax
  const double lr = h[0], lambd = h[1], alpha = h[2], t0 = h[3], wd = h[4];
  const bool maximize = h[5] != 0;
  std::vector<double> etas(n), mus(n);
  for (size_t j = 0; j < n; ++j) {
    etas[j] = funcopt::scalar_of(state[n + j]);
    mus[j] = funcopt::scalar_of(state[2 * n + j]);
  }
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::asgd", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(wd != 0, D, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        asgd_loop<T, M, D>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                           state[3 * n + j].data_ptr<T>() + lo, hi - lo, T(wd), T(lambd), T(etas[j]), T(mus[j]));
      });
    }); });
  });
  // then the new eta_t and mu_t of every parameter (each element loop read the old ones)
  if (state[0].scalar_type() == at::kDouble) {
    new_etas<double>(state, n, lr, lambd, alpha, at::kDouble);
  } else {
    new_etas<float>(state, n, lr, lambd, alpha, at::kFloat);
  }
  for (size_t j = 0; j < n; ++j) {
    // 1 / max(1, t - t0) on the host in double, a float32 tensor (torch.full), copied
    const double m = funcopt::scalar_of(state[j]) - t0;
    funcopt::set_scalar(state[2 * n + j], static_cast<double>(static_cast<float>(1.0 / (m > 1.0 ? m : 1.0))));
  }
}

}  // namespace

FUNCOPT_RULE("asgd", asgd, 4, 6);
