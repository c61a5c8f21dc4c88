// RMSprop in one pass per element: the foreach formula of rmsprop.py, op for op.
#include "_native.h"
#include <cmath>

namespace {

template <typename T, bool centered, bool maximize, bool decay, bool momentum>
void rmsprop_loop(T* __restrict p, const T* __restrict g, T* __restrict v, T* __restrict a,
                  T* __restrict b, int64_t n, T lr, T alpha, T one_m_alpha, T eps, T wd, T mom) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = maximize ? -g[i] : g[i];
    if (decay) gi = funcopt::add_alpha(gi, p[i], wd);
    T vi = v[i] * alpha;
    vi = funcopt::addcmul(vi, gi, gi, one_m_alpha);
    v[i] = vi;
    T d;
    if (centered) {
      T ai = funcopt::lerp(a[i], gi, one_m_alpha);
      a[i] = ai;
      d = std::sqrt(funcopt::addcmul(vi, ai, ai, T(-1))) + eps;
    } else {
      d = std::sqrt(vi) + eps;
    }
    if (momentum) {
      T bi = funcopt::addcdiv(b[i] * mom, gi, d, T(1));
      b[i] = bi;
      p[i] = funcopt::add_alpha(p[i], bi, -lr);
    } else {
      p[i] = funcopt::addcdiv(p[i], gi, d, -lr);
    }
  }
}

void rmsprop(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: lr, alpha, eps, weight_decay, momentum, centered, maximize
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::rmsprop", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(h[5] != 0, C, [&] { FUNCOPT_BOOL(h[6] != 0, M, [&] { FUNCOPT_BOOL(h[3] != 0, D, [&] {
    FUNCOPT_BOOL(h[4] > 0, B, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        rmsprop_loop<T, C, M, D, B>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo,
                                    state[1 * n + j].data_ptr<T>() + lo,
                                    C ? state[3 * n + j].data_ptr<T>() + lo : nullptr,
                                    B ? state[2 * n + j].data_ptr<T>() + lo : nullptr, hi - lo, T(h[0]), T(h[1]),
                                    T(1.0 - h[1]), T(h[2]), T(h[3]), T(h[4]));
      });
    }); }); }); });
  });
}

}  // namespace

FUNCOPT_RULE("rmsprop", rmsprop, 4, 7);
