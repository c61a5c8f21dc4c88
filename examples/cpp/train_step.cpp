// Keep training a TorchScript train step saved from Python -- model, loss,
// gradients and a funcopt optimizer step in one module -- from C++ with
// libtorch only: no Python, no funcopt.
//
//   train_step MODULE.pt DATA.pt STEPS OUT.pt
//
// DATA.pt holds the inputs and targets (a module with two tensor attributes
// `x` and `y`, saved by the caller); OUT.pt receives the parameters after
// STEPS calls of `train_step(x, y)` (a module with attribute `params`).
// Build (the compiler funcopt's native kernels already need):
//   g++ -std=c++17 train_step.cpp -I$TORCH/include -I$TORCH/include/torch/csrc/api/include \
//       -L$TORCH/lib -ltorch -ltorch_cpu -lc10 -Wl,-rpath,$TORCH/lib -o train_step
#include <torch/script.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: train_step MODULE.pt DATA.pt STEPS OUT.pt\n";
    return 2;
  }
  torch::jit::Module step = torch::jit::load(argv[1]);
  torch::jit::Module data = torch::jit::load(argv[2]);
  at::Tensor x = data.attr("x").toTensor();
  at::Tensor y = data.attr("y").toTensor();
  const int steps = std::atoi(argv[3]);
  double loss = 0;
  for (int i = 0; i < steps; ++i) {
    loss = step.get_method("train_step")({x, y}).toTensor().item<double>();
  }
  // the parameters, in module order, saved as one tensor list
  std::vector<at::Tensor> params;
  for (const auto& p : step.parameters()) params.push_back(p.detach().clone());
  auto bytes = torch::jit::pickle_save(c10::IValue(c10::List<at::Tensor>(params)));
  std::ofstream(argv[4], std::ios::binary).write(bytes.data(), bytes.size());
  std::cout << "trained " << steps << " steps, last loss " << loss << "\n";
  return 0;
}
