// Lion in one pass per element: the foreach formula of lion.py, op for op.
// add_alpha is funcopt's (torch's CPU rounding: one fma), so the update's
// sign agrees with the foreach formula (and LionReference) to the bit even
// where beta1 * m + (1 - beta1) * g is within a rounding of zero.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool maximize, bool decay>
void lion_loop(T* __restrict p, const T* __restrict g, T* __restrict m, int64_t n, T neg_lr, T shrink,
               T beta1, T one_m_beta1, T beta2, T one_m_beta2) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = maximize ? -g[i] : g[i];
    const T mi = m[i];
    T u = funcopt::add_alpha(mi * beta1, gi, one_m_beta1);
    u = T(T(0) < u) - T(u < T(0));  // torch's sign
    T pi = p[i];
    if (decay) pi = pi * shrink;
    p[i] = funcopt::add_alpha(pi, u, neg_lr);
    m[i] = funcopt::add_alpha(mi * beta2, gi, one_m_beta2);
  }
}

void lion(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: lr, beta1, beta2, weight_decay, maximize
  // state: exp_avg
  const double lr = h[0], beta1 = h[1], beta2 = h[2], wd = h[3];
  const bool maximize = h[4] != 0;
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::lion", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(wd != 0, D, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        lion_loop<T, M, D>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo, state[j].data_ptr<T>() + lo,
                           hi - lo, T(-lr), T(1 - lr * wd), T(beta1), T(1 - beta1), T(beta2), T(1 - beta2));
      });
    }); });
  });
}

}  // namespace

FUNCOPT_RULE("lion", lion, 1, 5);
