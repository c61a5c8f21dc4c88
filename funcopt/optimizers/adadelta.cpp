// Adadelta in one pass per element: the foreach formula of adadelta.py, op for op.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool maximize, bool decay>
void adadelta_loop(T* __restrict p, const T* __restrict g, T* __restrict v, T* __restrict u, int64_t n,
                   T neg_lr, T rho, T one_m_rho, T eps, T wd) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    if (decay) gi = funcopt::add_alpha(gi, p[i], wd);
    T vi = v[i] * rho;
    vi = funcopt::addcmul(vi, gi, gi, one_m_rho);
    v[i] = vi;
    const T sd = std::sqrt(vi + eps);
    T di = std::sqrt(u[i] + eps);
    di = di / sd;
    di = di * gi;
    T ui = u[i] * rho;
    ui = funcopt::addcmul(ui, di, di, one_m_rho);
    u[i] = ui;
    p[i] = funcopt::add_alpha(p[i], di, neg_lr);
  }
}

void adadelta(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // slots: step (bumped by the core, unused here), square_avg, acc_delta;
  // hyper: lr, rho, eps, weight_decay, maximize
  const double lr = h[0], rho = h[1], eps = h[2], wd = h[3];
  const bool maximize = h[4] != 0, decay = wd != 0;
  for (size_t j = 0; j < n; ++j) {  // every check first: nothing has changed yet
    const auto& p = params[j];
    for (size_t k = 1; k < 3; ++k)
      TORCH_CHECK(state[k * n + j].numel() == p.numel() && state[k * n + j].scalar_type() == p.scalar_type(),
                  "funcopt::step_(adadelta): state ", k, " of parameter ", j, " must be shaped like it");
  }
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::adadelta", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(decay, D, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        adadelta_loop<T, M, D>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                               state[1 * n + j].data_ptr<T>() + lo, state[2 * n + j].data_ptr<T>() + lo, hi - lo,
                               T(-lr), T(rho), T(1 - rho), T(eps), T(wd));
      });
    }); });
  });
}

}  // namespace

FUNCOPT_RULE("adadelta", adadelta, 3, 5);
