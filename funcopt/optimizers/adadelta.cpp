// Adadelta in one pass per element: the foreach formula of adadelta.py, op for op.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool maximize, bool decay>
void adadelta_tensor(T* __restrict p, const T* __restrict g, T* __restrict v, T* __restrict u, int64_t n,
                     T neg_lr, T rho, T one_m_rho, T eps, T wd) {
  funcopt::chunks(n, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
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
  });
}

void adadelta(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& state, const std::vector<double>& h) {
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
  for (size_t j = 0; j < n; ++j) {
    AT_DISPATCH_FLOATING_TYPES(params[j].scalar_type(), "funcopt::adadelta", [&] {
      FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(decay, D, [&] {
      adadelta_tensor<scalar_t, M, D>(params[j].data_ptr<scalar_t>(), grads[j].data_ptr<scalar_t>(),
                                      state[1 * n + j].data_ptr<scalar_t>(), state[2 * n + j].data_ptr<scalar_t>(),
                                      params[j].numel(), scalar_t(-lr), scalar_t(rho), scalar_t(1 - rho),
                                      scalar_t(eps), scalar_t(wd));
      }); });
    });
  }
}

}  // namespace

FUNCOPT_RULE("adadelta", adadelta, 3, 5);
