// Rprop in one pass per element: the foreach formula of rprop.py, op for op.
//
// torch's sign (0 < x) - (x < 0) (0 for zeros and NaN), its three masked
// fills in their order (> 0: etaplus, then < 0: etaminus, then == 0: 1),
// clamp as min(max(s, lo), hi), the masked gradient kept as next step's prev,
// and addcmul(params, sign(prev), step_size, value=-1); all in the tensor's
// dtype, written as selects so the loop vectorizes.  No step-dependent
// scalars: the step counter is not read.
#include "_native.h"
#include <cmath>

namespace {

template <typename T>
inline T sign(T x) {
  return T(T(0) < x) - T(x < T(0));
}

template <typename T, bool maximize>
void rprop_loop(T* __restrict p, const T* __restrict g, T* __restrict prev, T* __restrict ss, int64_t n,
                T lo, T hi, T etaminus, T etaplus) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i], pv = prev[i], si0 = ss[i], pi = p[i];
    T s = gi * pv;
    if (maximize) s = -s;
    T f = sign(s);
    f = f > T(0) ? etaplus : f;
    f = f < T(0) ? etaminus : f;
    f = f == T(0) ? T(1) : f;
    T si = si0 * f;
    si = si < lo ? lo : si;  // std::max(s, lo)
    si = hi < si ? hi : si;  // std::min(s, hi)
    T gm = maximize ? -gi : gi;
    gm = f == etaminus ? T(0) : gm;
    ss[i] = si;
    prev[i] = gm;
    p[i] = funcopt::addcmul(pi, sign(gm), si, T(-1));
  }
}

void rprop(at::TensorList params, at::TensorList grads, at::TensorList state, at::ArrayRef<double> h) {
  const size_t n = params.size();
  // hyper: step_size_min, step_size_max, etaminus, etaplus, maximize
  // state: step (unused), prev, step_size
  const bool maximize = h[4] != 0;
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "funcopt::rprop", [&] {
    using T = scalar_t;
    FUNCOPT_BOOL(maximize, M, [&] {
      funcopt::for_each_chunk(funcopt::numels(params), [&](int64_t j, int64_t lo, int64_t hi) {
        rprop_loop<T, M>(params[j].data_ptr<T>() + lo, grads[j].data_ptr<T>() + lo, state[n + j].data_ptr<T>() + lo,
                         state[2 * n + j].data_ptr<T>() + lo, hi - lo, T(h[0]), T(h[1]), T(h[2]), T(h[3]));
      });
    });
  });
}

}  // namespace

FUNCOPT_RULE("rprop", rprop, 3, 5);
