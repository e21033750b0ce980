// The state kernels (state_ops.cpp) as the native scan (scan.cpp) calls them; see state_ops.cpp for what each does.
#pragma once
#include <torch/extension.h>

#include <vector>

// A small operand given as blocks of rows: [B, m_j, K] tensors (any strides) stacked along the rows, M = Σ m_j
// rows in all. The backward pass's updates collect their rank-n terms from several tensors; reading them in place
// saves the concatenation (2% of a training step).
using RowBlocks = std::vector<torch::Tensor>;

// Whether this build has the AVX-512 state kernels (the build targets the compiling CPU: -march=native). Without
// them the module still holds the chunk loop, which then takes the ATen products (scan.cpp, `kernel_serves`).
#ifdef __AVX512F__
constexpr bool kStateKernels = true;
#else
constexpr bool kStateKernels = false;
#endif

// Below this many rows the zero-padded 16-row register blocks waste more than the kernels gain (scan.cpp's
// `kernel_serves`, the one rule for which products the kernels serve).
constexpr int64_t kMinRows = 8;

void xw(const torch::Tensor& X, const torch::Tensor& W, torch::Tensor out, bool accumulate);
void xwt(const torch::Tensor& G, const torch::Tensor& W, torch::Tensor out, bool accumulate);
std::vector<torch::Tensor> combine(torch::Tensor out, const torch::Tensor& W, const torch::Tensor& beta,
                                   const c10::optional<torch::Tensor>& S, const c10::optional<torch::Tensor>& c,
                                   const RowBlocks& A, const RowBlocks& G, double alpha,
                                   const c10::optional<torch::Tensor>& P, const c10::optional<torch::Tensor>& out2,
                                   const c10::optional<torch::Tensor>& e, const c10::optional<RowBlocks>& G2,
                                   const c10::optional<torch::Tensor>& x, const c10::optional<RowBlocks>& gt,
                                   const c10::optional<torch::Tensor>& Q);

// Adds the native scan's functions (scan.cpp) to the extension module.
void register_scan(pybind11::module_& m);
