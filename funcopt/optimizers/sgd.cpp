// SGD in one pass per element: the foreach formula of sgd.py, op for op.
//
// g = -g (maximize); g = add_alpha(g, p, weight_decay); with momentum, the
// buffer is the gradient on a parameter's first step (torch.optim clones it;
// the core calls first steps apart, hyper `first`), else
// add_alpha(buf * momentum, g, 1 - dampening); the direction is
// add_alpha(g, buf, momentum) (Nesterov), buf, or g (no momentum); then
// p = add_alpha(p, d, -lr).  funcopt's add_alpha is torch's CPU rounding (one
// fma), so the results are torch.optim.SGD(foreach=True)'s to the bit.
#include "_native.h"

namespace {

template <typename T, bool maximize, bool decay, bool momentum, bool first, bool nesterov>
void sgd_loop(T* __restrict p, const T* __restrict g, T* __restrict b, int64_t n, T neg_lr, T wd, T mom,
              T one_m_damp) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    const T pi = p[i];
    if (decay) gi = funcopt::add_alpha(gi, pi, wd);
    T d = gi;
    if (momentum) {
      T bi = first ? gi : funcopt::add_alpha(b[i] * mom, gi, one_m_damp);
      b[i] = bi;
      d = nesterov ? funcopt::add_alpha(gi, bi, mom) : bi;
    }
    p[i] = funcopt::add_alpha(pi, d, neg_lr);
  }
}

void sgd(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: lr, momentum, dampening, weight_decay, nesterov, maximize, first (this call's
  // parameters are on their first step); state: momentum_buffer (empty without momentum)
  const double lr = h[0], mom = h[1], damp = h[2], wd = h[3];
  const bool nesterov = h[4] != 0, maximize = h[5] != 0, first = h[6] != 0, momentum = mom != 0;
  if (momentum) {
    for (size_t j = 0; j < n; ++j)  // every check first: nothing has changed yet
      TORCH_CHECK(state[j].numel() == params[j].numel() && state[j].scalar_type() == params[j].scalar_type(),
                  "funcopt::step_(sgd): the momentum buffer of parameter ", j, " must be shaped like it");
  }
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::sgd", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(wd != 0, D, [&] { FUNCOPT_BOOL(momentum, B, [&] {
    FUNCOPT_BOOL(first && momentum, F, [&] { FUNCOPT_BOOL(nesterov && momentum, N, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        sgd_loop<T, M, D, B, F, N>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                                   B ? state[j].data_ptr<T>() + lo : nullptr, hi - lo, T(-lr), T(wd), T(mom),
                                   T(1 - damp));
      });
    }); }); }); }); });
  });
}

}  // namespace

FUNCOPT_RULE("sgd", sgd, 1, 7);
