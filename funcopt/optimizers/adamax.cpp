// Adamax in one pass per element: the foreach formula of adamax.py, op for op.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool maximize, bool decay>
void adamax_loop(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict u, int64_t n,
                 T w1, T beta2, T eps, T wd, T step_size) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    if (decay) gi = funcopt::add_alpha(gi, p[i], wd);
    const T mi = funcopt::lerp(m[i], gi, w1);
    m[i] = mi;
    const T ui = u[i] * beta2;
    const T ai = std::abs(gi) + eps;
    // torch.maximum: NaN where either side is NaN
    T ni = ui > ai ? ui : ai;
    ni = ai != ai ? ai : ni;
    ni = ui != ui ? ui : ni;
    u[i] = ni;
    p[i] = funcopt::addcdiv(p[i], mi, ni, step_size);
  }
}

void adamax(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // slots: step, exp_avg, exp_inf; hyper: lr, beta1, beta2, eps, weight_decay, maximize
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
  const bool maximize = h[5] != 0, decay = wd != 0;
  for (size_t j = 0; j < n; ++j) {  // every check first: nothing has changed yet
    const auto& p = params[j];
    TORCH_CHECK(state[j].numel() == 1, "funcopt::step_(adamax): step of parameter ", j, " must hold one value");
    for (size_t k = 1; k < 3; ++k)
      TORCH_CHECK(state[k * n + j].numel() == p.numel() && state[k * n + j].scalar_type() == p.scalar_type(),
                  "funcopt::step_(adamax): state ", k, " of parameter ", j, " must be shaped like it");
  }
  std::vector<double> step_size(n);
  for (size_t j = 0; j < n; ++j)  // the foreach formula's per-tensor scalar, in double from the (bumped) step
    step_size[j] = (lr / (1 - std::pow(beta1, funcopt::scalar_of(state[j])))) * -1;
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::adamax", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(decay, D, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        adamax_loop<T, M, D>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                           state[1 * n + j].data_ptr<T>() + lo, state[2 * n + j].data_ptr<T>() + lo, hi - lo,
                           T(1 - beta1), T(beta2), T(eps), T(wd), T(step_size[j]));
      });
    }); });
  });
}

}  // namespace

FUNCOPT_RULE("adamax", adamax, 3, 6);
