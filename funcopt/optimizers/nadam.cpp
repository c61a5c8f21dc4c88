// NAdam in one pass per element: the foreach formula of nadam.py, op for op.
#include "_native.h"
#include <cmath>

namespace {

// mu_product *= mu in the tensor's own dtype (float32 as torch.optim keeps it;
// the parameter's dtype after a loaded state dict), as _foreach_mul_ does;
// returns the new value
inline double scale_product(const at::Tensor& t, double mu) {
  switch (t.scalar_type()) {
    case at::kFloat: { float* x = t.data_ptr<float>(); *x = *x * float(mu); return double(*x); }
    case at::kDouble: { double* x = t.data_ptr<double>(); *x = *x * mu; return *x; }
    default: t.mul_(mu); return t.item<double>();
  }
}

template <typename T, bool maximize, bool coupled, bool decoupled>
void nadam_loop(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, int64_t n,
                T w1, T beta2, T one_m_beta2, T eps, T wd, T shrink, T bc2_sqrt, T size_g, T size_m) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    T pi = p[i];
    if (coupled) gi = funcopt::add_alpha(gi, pi, wd);
    if (decoupled) pi = pi * shrink;
    const T mi = funcopt::lerp(m[i], gi, w1);
    m[i] = mi;
    T vi = v[i] * beta2;
    vi = funcopt::addcmul(vi, gi, gi, one_m_beta2);
    v[i] = vi;
    T d = std::sqrt(vi);
    d = d / bc2_sqrt;
    d = d + eps;
    pi = funcopt::addcdiv(pi, gi, d, size_g);
    pi = funcopt::addcdiv(pi, mi, d, size_m);
    p[i] = pi;
  }
}

void nadam(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // slots: step, mu_product (0-d), exp_avg, exp_avg_sq;
  // hyper: lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4], psi = h[5];
  const bool decoupled = h[6] != 0, maximize = h[7] != 0;
  for (size_t j = 0; j < n; ++j) {  // every check first: nothing has changed yet
    const auto& p = params[j];
    TORCH_CHECK(state[j].numel() == 1, "funcopt::step_(nadam): step of parameter ", j, " must hold one value");
    TORCH_CHECK(state[n + j].numel() == 1, "funcopt::step_(nadam): mu_product of parameter ", j,
                " must hold one value");
    for (size_t k = 2; k < 4; ++k)
      TORCH_CHECK(state[k * n + j].numel() == p.numel() && state[k * n + j].scalar_type() == p.scalar_type(),
                "funcopt::step_(nadam): state ", k, " of parameter ", j, " must be shaped like it");
  }
  std::vector<double> bc2s(n), sizes_g(n), sizes_m(n);
  for (size_t j = 0; j < n; ++j) {
    // the foreach formula's per-tensor scalars, in double from the (bumped) step
    const double t = funcopt::scalar_of(state[j]);
    const double bc2_sqrt = std::pow(1 - std::pow(beta2, t), 0.5);
    const double mu = beta1 * (1.0 - 0.5 * std::pow(0.96, t * psi));
    const double mu_next = beta1 * (1.0 - 0.5 * std::pow(0.96, (t + 1) * psi));
    const double prod = scale_product(state[n + j], mu);
    const double size_g = (lr * (1.0 - mu) / (1.0 - prod)) * -1;
    const double size_m = (lr * mu_next / (1.0 - prod * mu_next)) * -1;
    bc2s[j] = bc2_sqrt;
    sizes_g[j] = size_g;
    sizes_m[j] = size_m;
  }
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::nadam", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] { FUNCOPT_BOOL(wd != 0 && !decoupled, C, [&] {
    FUNCOPT_BOOL(wd != 0 && decoupled, W, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        nadam_loop<T, M, C, W>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                               state[2 * n + j].data_ptr<T>() + lo, state[3 * n + j].data_ptr<T>() + lo, hi - lo,
                               T(1 - beta1), T(beta2), T(1 - beta2), T(eps), T(wd), T(1 - lr * wd), T(bc2s[j]),
                               T(sizes_g[j]), T(sizes_m[j]));
      });
    }); }); });
  });
}

}  // namespace

FUNCOPT_RULE("nadam", nadam, 4, 8);
