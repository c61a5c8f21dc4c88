// funcopt's native optimizer steps: the one operator and the table of rules.
//
// torch.ops.funcopt.step_(rule, params, grads, state, hyper, grad_scale, found_inf)
// checks every tensor before it changes anything, then runs the rule registered
// under `rule` (each rule lives beside its Python formula, funcopt/optimizers/<name>.cpp).
#include <atomic>

#include "_native.h"
#include <ATen/ATen.h>
#include <torch/library.h>
#include <map>
namespace funcopt {
static std::map<std::string, RuleInfo>& table() { static std::map<std::string, RuleInfo> t; return t; }
bool register_rule(const std::string& name, RuleInfo info) { table()[name] = info; return true; }

void step_(c10::string_view rule, at::TensorList params, at::TensorList grads, at::TensorList state,
           at::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_scale,
           const std::optional<at::Tensor>& found_inf) {
  auto it = table().find(std::string(rule));
  TORCH_CHECK(it != table().end(), "funcopt::step_: unknown rule '", rule, "'");
  const RuleInfo& info = it->second;
  const int64_t n = params.size();
  TORCH_CHECK((int64_t)grads.size() == n, "funcopt::step_(", rule, "): ", n, " params, ", grads.size(), " grads");
  TORCH_CHECK((int64_t)state.size() == n * info.num_slots, "funcopt::step_(", rule, "): state holds ", state.size(),
              " tensors, expected ", n * info.num_slots);
  TORCH_CHECK((int64_t)hyper.size() == info.num_hyper, "funcopt::step_(", rule, "): ", hyper.size(),
              " hyperparameters, expected ", info.num_hyper);
  if (n == 0) return;
  const auto dt = params[0].scalar_type();
  for (int64_t j = 0; j < n; ++j) {
    const auto& p = params[j];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == dt && p.is_contiguous(),
                "funcopt::step_(", rule, "): parameter ", j, " must be a contiguous CPU tensor of the list's dtype");
    TORCH_CHECK(grads[j].scalar_type() == dt && grads[j].is_contiguous() && grads[j].numel() == p.numel() && grads[j].device().is_cpu(),
                "funcopt::step_(", rule, "): gradient ", j, " must be contiguous, of its parameter's dtype and size");
    for (int64_t k = 0; k < info.num_slots; ++k) {
      const auto& s = state[k * n + j];
      TORCH_CHECK(s.device().is_cpu() && s.is_contiguous(), "funcopt::step_(", rule, "): state ", k, " of parameter ", j,
                  " must be a contiguous CPU tensor");
      TORCH_CHECK(s.numel() == 0 || s.numel() == p.numel() || s.dim() == 0,
                  "funcopt::step_(", rule, "): state ", k, " of parameter ", j, " has ", s.numel(), " elements");
      TORCH_CHECK(s.numel() == 0 || s.dim() == 0 || s.scalar_type() == dt,
                  "funcopt::step_(", rule, "): state ", k, " of parameter ", j, " has dtype ", s.scalar_type());
    }
  }
  if (found_inf.has_value() && found_inf->item<double>() != 0.0) return;
  std::vector<at::Tensor> scaled;  // unscaled gradients (new tensors), only with grad_scale
  if (grad_scale.has_value()) {
    scaled.reserve(n);
    for (const auto& g : grads) scaled.push_back(g / *grad_scale);
  }
  RECORD_FUNCTION(std::string("funcopt::") + std::string(rule), std::vector<c10::IValue>());
  info.fn(params, grad_scale.has_value() ? at::TensorList(scaled) : grads, state, hyper);
  // in-place writes are visible to autograd's saved-tensor checks, as for ATen's in-place ops
  for (const auto& t : params) t.unsafeGetTensorImpl()->bump_version();
  for (const auto& t : state)
    if (t.numel() > 0) t.unsafeGetTensorImpl()->bump_version();
}

// How many threads one at::parallel_for of `parts` parts ran on (the highest
// thread number seen, plus one): 1 where the library was built without OpenMP,
// whose header-inline parallel region then silently runs on the calling thread.
int64_t parallel_width(int64_t parts) {
  std::atomic<int64_t> width{1};
  at::parallel_for(0, parts, 1, [&](int64_t, int64_t) {
    const int64_t w = static_cast<int64_t>(at::get_thread_num()) + 1;
    int64_t cur = width.load();
    while (w > cur && !width.compare_exchange_weak(cur, w)) {
    }
  });
  return width.load();
}

}  // namespace funcopt

TORCH_LIBRARY(funcopt, m) {
  m.def("parallel_width(int parts) -> int", &funcopt::parallel_width);
  m.def("step_(str rule, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state, float[] hyper, "
        "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
}
TORCH_LIBRARY_IMPL(funcopt, CPU, m) { m.impl("step_", &funcopt::step_); }
