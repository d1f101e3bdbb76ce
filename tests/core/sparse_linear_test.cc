// The sparse linear layer against the dense product on the masked weight: forward, input,
// weight and bias gradients over odd shapes, empty rows and columns, 0% and 100% density and
// 3-D inputs; RefreshValues; the B/W split; thread-count independence.
#include <torch/torch.h>

#include <map>
#include <memory>
#include <vector>

#include "core/linear.h"
#include "core/sparse_linear.h"
#include "gtest/gtest.h"

namespace fulcrum {
namespace {

// Max |a − b| relative to the reference's scale; fp32 sums of up to a few hundred products.
double RelativeError(const at::Tensor& a, const at::Tensor& ref) {
  const double scale = ref.abs().max().item<double>() + 1.0;
  return (a - ref).abs().max().item<double>() / scale;
}

constexpr double kFloatTol = 2e-6;
constexpr double kDoubleTol = 1e-13;

// Restores the intra-op thread count on scope exit.
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int n) : previous_(at::get_num_threads()) { at::set_num_threads(n); }
  ~ThreadCountScope() { at::set_num_threads(previous_); }

 private:
  int previous_;
};

struct Case {
  std::vector<int64_t> x_sizes;  // [..., in]
  int64_t out;
  double density;
  bool empty_lines = false;  // Also prune whole rows and columns.
  bool bias = true;
};

at::Tensor MakeMask(int64_t out, int64_t in, double density, bool empty_lines, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor mask = at::rand({out, in}, gen) < density;
  if (empty_lines) {
    for (int64_t o = 1; o < out; o += 3) mask[o].fill_(false);
    for (int64_t j = 0; j < in; j += 4) mask.select(1, j).fill_(false);
  }
  return mask;
}

// Gradients of one forward/backward.
struct Grads {
  at::Tensor y, x, weight, bias;
};

// The dense reference: autograd through x·(W ⊙ mask)ᵀ + b.
Grads DenseReference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mask,
                     const at::Tensor& bias, const at::Tensor& grad_y) {
  at::Tensor xr = x.detach().clone().requires_grad_();
  at::Tensor wr = weight.detach().clone().requires_grad_();
  at::Tensor br = bias.defined() ? bias.detach().clone().requires_grad_() : at::Tensor();
  at::Tensor y = at::matmul(xr, (wr * mask.to(wr.scalar_type())).t());
  if (br.defined()) y = y + br;
  y.backward(grad_y);
  return {y.detach(), xr.grad(), wr.grad(), br.defined() ? br.grad() : at::Tensor()};
}

// SparseLinearForward with fresh leaves and the given store (may be null).
Grads Sparse(const at::Tensor& x, std::shared_ptr<const SparseWeight> w, const at::Tensor& weight,
             const at::Tensor& bias, const at::Tensor& grad_y, WeightGradStore* store = nullptr) {
  at::Tensor xs = x.detach().clone().requires_grad_();
  at::Tensor ws = weight.detach().clone().requires_grad_();
  at::Tensor bs = bias.defined() ? bias.detach().clone().requires_grad_() : at::Tensor();
  at::Tensor y = SparseLinearForward(xs, std::move(w), ws, bs);
  {
    WeightGradStore::Scope scope(store);
    y.backward(grad_y);
  }
  if (store != nullptr) store->Flush();
  return {y.detach(), xs.grad(), ws.grad(), bs.defined() ? bs.grad() : at::Tensor()};
}

void ExpectMatchesDense(const Case& c, at::ScalarType dtype, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "x " << at::IntArrayRef(c.x_sizes) << " out " << c.out
                                    << " density " << c.density << " dtype " << dtype);
  const double tol = dtype == at::kDouble ? kDoubleTol : kFloatTol;
  const int64_t in = c.x_sizes.back();
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor x = at::randn(c.x_sizes, gen, opts);
  const at::Tensor weight = at::randn({c.out, in}, gen, opts);
  const at::Tensor bias = c.bias ? at::randn({c.out}, gen, opts) : at::Tensor();
  std::vector<int64_t> y_sizes = c.x_sizes;
  y_sizes.back() = c.out;
  const at::Tensor grad_y = at::randn(y_sizes, gen, opts);
  const at::Tensor mask = MakeMask(c.out, in, c.density, c.empty_lines, seed + 1);
  auto w = std::make_shared<const SparseWeight>(weight, mask);
  ASSERT_EQ(w->nnz(), mask.sum().item<int64_t>());

  const Grads ref = DenseReference(x, weight, mask, bias, grad_y);
  const Grads got = Sparse(x, w, weight, bias, grad_y);
  ASSERT_EQ(got.y.sizes(), ref.y.sizes());
  EXPECT_LE(RelativeError(got.y, ref.y), tol);
  EXPECT_LE(RelativeError(got.x, ref.x), tol);
  ASSERT_TRUE(got.weight.defined());
  EXPECT_LE(RelativeError(got.weight, ref.weight), tol);
  // Exactly zero at the pruned entries.
  EXPECT_EQ(got.weight.masked_select(mask.logical_not()).abs().sum().item<double>(), 0.0);
  if (c.bias) {
    EXPECT_LE(RelativeError(got.bias, ref.bias), tol);
  }

  // The kernels without autograd agree with the autograd function.
  EXPECT_LE(RelativeError(SparseLinearOutput(x, *w, bias), ref.y), tol);
  EXPECT_LE(RelativeError(SparseLinearInputGrad(grad_y, *w), ref.x), tol);
  EXPECT_LE(RelativeError(w->ScatterToDense(SparseLinearWeightGrad(grad_y, x, *w)), ref.weight),
            tol);
}

TEST(SparseWeightTest, StructureOfASmallMask) {
  const at::Tensor weight = at::arange(1, 13, at::kFloat).view({3, 4});
  const at::Tensor mask = at::tensor({1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1}).view({3, 4});
  const SparseWeight w(weight, mask);
  EXPECT_EQ(w.rows(), 3);
  EXPECT_EQ(w.cols(), 4);
  EXPECT_EQ(w.nnz(), 5);
  EXPECT_DOUBLE_EQ(w.density(), 5.0 / 12.0);
  EXPECT_EQ(w.csr_row_ptr(), (std::vector<int64_t>{0, 2, 2, 5}));
  EXPECT_EQ(w.csr_col(), (std::vector<int32_t>{0, 2, 0, 1, 3}));
  EXPECT_EQ(w.csr_flat_index(), (std::vector<int64_t>{0, 2, 8, 9, 11}));
  EXPECT_TRUE(at::equal(w.csr_values(), at::tensor({1.0f, 3.0f, 9.0f, 10.0f, 12.0f})));
  EXPECT_EQ(w.csc_col_ptr(), (std::vector<int64_t>{0, 2, 3, 4, 5}));
  EXPECT_EQ(w.csc_row(), (std::vector<int32_t>{0, 2, 2, 0, 2}));
  EXPECT_TRUE(at::equal(w.csc_values(), at::tensor({1.0f, 9.0f, 10.0f, 3.0f, 12.0f})));
  EXPECT_TRUE(at::equal(w.ScatterToDense(w.csr_values()), weight * mask));
  at::Tensor dense = at::ones({3, 4});
  w.AccumulateInto(dense, w.csr_values());
  EXPECT_TRUE(at::equal(dense, weight * mask + 1));
}

TEST(SparseWeightTest, RejectsBadInputs) {
  const at::Tensor weight = at::randn({4, 6});
  EXPECT_THROW(SparseWeight(weight, at::ones({4, 5})), c10::Error);
  EXPECT_THROW(SparseWeight(weight.to(at::kHalf), at::ones({4, 6})), c10::Error);
  auto w = std::make_shared<const SparseWeight>(weight, at::ones({4, 6}));
  EXPECT_THROW(SparseLinearForward(at::randn({3, 5}), w, weight, at::Tensor()), c10::Error);
  EXPECT_THROW(SparseLinearForward(at::randn({3, 6}), w, at::randn({6, 4}), at::Tensor()),
               c10::Error);
  EXPECT_THROW(SparseLinearForward(at::randn({3, 6}, at::kDouble), w, weight, at::Tensor()),
               c10::Error);
}

TEST(SparseLinearTest, MatchesDenseOnTheMaskedWeight) {
  const std::vector<Case> cases = {
      {{5, 7}, 3, 0.5},                    // Smaller than one vector.
      {{70, 13}, 9, 0.3},                  // Tokens past one tile, odd features.
      {{33, 4, 24}, 40, 0.2},              // 3-D [s, b, in], 132 tokens.
      {{130, 37}, 29, 0.6, true},          // Empty rows and columns.
      {{64, 16}, 24, 0.0},                 // 0% density: y = b, no weight gradient.
      {{64, 16}, 24, 0.0, false, false},   // ... and without bias.
      {{100, 48}, 56, 1.0},                // 100% density: the dense layer.
      {{257, 96}, 80, 0.1, false, false},  // 90% sparse, no bias.
  };
  uint64_t seed = 10;
  for (const Case& c : cases) ExpectMatchesDense(c, at::kFloat, seed += 7);
}

TEST(SparseLinearTest, MatchesDenseInDouble) {
  ExpectMatchesDense({{70, 3, 21}, 19, 0.4, true}, at::kDouble, 3);
  ExpectMatchesDense({{65, 8}, 12, 1.0}, at::kDouble, 4);
}

TEST(SparseLinearTest, RefreshValuesReadsTheUpdatedWeight) {
  at::Tensor weight = at::randn({12, 20});
  const at::Tensor mask = MakeMask(12, 20, 0.4, false, 5);
  auto w = std::make_shared<SparseWeight>(weight, mask);
  const at::Tensor x = at::randn({9, 20});
  const at::Tensor bias = at::randn({12});
  EXPECT_LE(RelativeError(SparseLinearOutput(x, *w, bias),
                          at::matmul(x, (weight * mask).t()) + bias),
            kFloatTol);

  weight.mul_(-2.0).add_(0.5);  // An "optimizer step" on the dense weight.
  // Until refreshed, the sparse weight keeps the old values.
  EXPECT_GT(RelativeError(SparseLinearOutput(x, *w, bias),
                          at::matmul(x, (weight * mask).t()) + bias),
            0.1);
  w->RefreshValues(weight);
  const at::Tensor expected = at::matmul(x, (weight * mask).t()) + bias;
  EXPECT_LE(RelativeError(SparseLinearOutput(x, *w, bias), expected), kFloatTol);
  // Both orders (the input gradient reads the CSC copy).
  const at::Tensor g = at::randn({9, 12});
  EXPECT_LE(RelativeError(SparseLinearInputGrad(g, *w), at::matmul(g, weight * mask)), kFloatTol);
  EXPECT_THROW(w->RefreshValues(at::randn({12, 21})), c10::Error);
}

TEST(SparseLinearTest, DeferredWeightGradientEqualsFusedBitForBit) {
  at::Generator gen = at::detail::createCPUGenerator(21);
  const at::Tensor x = at::randn({40, 3, 48}, gen);
  const at::Tensor weight = at::randn({72, 48}, gen);
  const at::Tensor bias = at::randn({72}, gen);
  const at::Tensor grad_y = at::randn({40, 3, 72}, gen);
  auto w = std::make_shared<const SparseWeight>(weight, MakeMask(72, 48, 0.2, false, 22));
  const Grads fused = Sparse(x, w, weight, bias, grad_y);

  at::Tensor xs = x.clone().requires_grad_();
  at::Tensor ws = weight.clone().requires_grad_();
  at::Tensor bs = bias.clone().requires_grad_();
  WeightGradStore store;
  at::Tensor y;
  {
    WeightGradStore::TagScope tag(7);
    y = SparseLinearForward(xs, w, ws, bs);
  }
  {
    WeightGradStore::Scope scope(&store);
    y.backward(grad_y);
  }
  // B done: input and bias gradients now, the weight gradient queued under the forward's tag.
  ASSERT_TRUE(xs.grad().defined());
  ASSERT_TRUE(bs.grad().defined());
  EXPECT_FALSE(ws.grad().defined());
  ASSERT_EQ(store.size(), 1u);
  EXPECT_GT(store.held_bytes(), 0);
  std::map<int64_t, double> ms_by_tag;
  store.FlushTag(7, &ms_by_tag);
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(ms_by_tag.count(7), 1u);
  ASSERT_TRUE(ws.grad().defined());
  EXPECT_TRUE(at::equal(ws.grad(), fused.weight));
  EXPECT_TRUE(at::equal(xs.grad(), fused.x));
  EXPECT_TRUE(at::equal(bs.grad(), fused.bias));

  // A second micro-batch accumulates at the nonzeros the same way autograd would.
  const at::Tensor first = ws.grad().clone();
  y = SparseLinearForward(xs, w, ws, bs);
  {
    WeightGradStore::Scope scope(&store);
    y.backward(grad_y);
  }
  store.Flush();
  EXPECT_TRUE(at::equal(ws.grad(), first + fused.weight));
}

// NOTE [sparse mixed precision]: bf16 activations over an fp32 sparse weight are computed
// in fp32 — exactly the fp32 products of the widened values, narrowed to bf16 at the
// output — with a bf16 input gradient and fp32 masked weight and bias gradients, deferred
// bit-exactly under the B/W split. (Without the widening the kernels refuse bf16 input.)
TEST(SparseLinearTest, Bf16ActivationsComputeInFp32OverTheFp32Weight) {
  at::Generator gen = at::detail::createCPUGenerator(31);
  const at::Tensor x = at::randn({40, 3, 48}, gen).to(at::kBFloat16);
  const at::Tensor weight = at::randn({72, 48}, gen);
  const at::Tensor bias = at::randn({72}, gen);
  const at::Tensor grad_y = at::randn({40, 3, 72}, gen).to(at::kBFloat16);
  const at::Tensor mask = MakeMask(72, 48, 0.2, false, 32);
  auto w = std::make_shared<const SparseWeight>(weight, mask);
  const Grads got = Sparse(x, w, weight, bias, grad_y);
  const Grads wide = Sparse(x.to(at::kFloat), w, weight, bias, grad_y.to(at::kFloat));
  EXPECT_EQ(got.y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.x.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.weight.scalar_type(), at::kFloat);
  EXPECT_EQ(got.bias.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(got.y, wide.y.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(got.x, wide.x.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(got.weight, wide.weight)) << "fp32 SDDMM of the widened values";
  EXPECT_TRUE(at::equal(got.bias, wide.bias));
  EXPECT_EQ(got.weight.masked_select(mask.logical_not()).abs().sum().item<double>(), 0.0);
  WeightGradStore store;
  const Grads deferred = Sparse(x, w, weight, bias, grad_y, &store);
  EXPECT_TRUE(at::equal(deferred.weight, got.weight));
  EXPECT_TRUE(at::equal(deferred.x, got.x));
}

TEST(SparseLinearTest, FrozenWeightAndInputWithoutGradient) {
  const at::Tensor weight = at::randn({16, 24});
  const at::Tensor mask = MakeMask(16, 24, 0.3, false, 8);
  auto w = std::make_shared<const SparseWeight>(weight, mask);
  const at::Tensor x = at::randn({10, 24});
  const at::Tensor grad_y = at::randn({10, 16});

  // Frozen weight: the input gradient only, nothing queued.
  at::Tensor xs = x.clone().requires_grad_();
  at::Tensor frozen = weight.clone();
  WeightGradStore store;
  at::Tensor y = SparseLinearForward(xs, w, frozen, at::Tensor());
  {
    WeightGradStore::Scope scope(&store);
    y.backward(grad_y);
  }
  EXPECT_TRUE(store.empty());
  EXPECT_LE(RelativeError(xs.grad(), at::matmul(grad_y, weight * mask)), kFloatTol);

  // An input that needs no gradient (the first layer after a frozen prefix).
  at::Tensor ws = weight.clone().requires_grad_();
  y = SparseLinearForward(x, w, ws, at::Tensor());
  y.backward(grad_y);
  EXPECT_LE(RelativeError(ws.grad(), at::matmul(grad_y.t(), x) * mask), kFloatTol);
}

TEST(SparseLinearTest, ResultsDoNotDependOnTheThreadCount) {
  at::Generator gen = at::detail::createCPUGenerator(31);
  const at::Tensor x = at::randn({300, 96}, gen);  // 5 token tiles.
  const at::Tensor weight = at::randn({128, 96}, gen);
  const at::Tensor bias = at::randn({128}, gen);
  const at::Tensor grad_y = at::randn({300, 128}, gen);
  const at::Tensor mask = MakeMask(128, 96, 0.15, true, 32);
  auto w = std::make_shared<const SparseWeight>(weight, mask);
  Grads one, two;
  {
    ThreadCountScope threads(1);
    one = Sparse(x, w, weight, bias, grad_y);
  }
  {
    ThreadCountScope threads(2);
    ASSERT_EQ(at::get_num_threads(), 2);
    two = Sparse(x, w, weight, bias, grad_y);
  }
  EXPECT_TRUE(at::equal(one.y, two.y));
  EXPECT_TRUE(at::equal(one.x, two.x));
  EXPECT_TRUE(at::equal(one.weight, two.weight));
  EXPECT_TRUE(at::equal(one.bias, two.bias));
  const Grads ref = DenseReference(x, weight, mask, bias, grad_y);
  EXPECT_LE(RelativeError(two.weight, ref.weight), kFloatTol);
}

TEST(SparseLinearTest, SparseIsFasterOnlyWhenSparseEnough) {
  EXPECT_TRUE(SparseIsFaster(1536, 512, 0.1));
  EXPECT_TRUE(SparseIsFaster(512, 2048, 0.1));
  EXPECT_FALSE(SparseIsFaster(1536, 512, 0.5));
  EXPECT_FALSE(SparseIsFaster(2048, 512, 1.0));
  // The measured break-even (NOTE [sparse crossover]) lies between 55% and 60% sparsity.
  EXPECT_TRUE(SparseIsFaster(512, 2048, 0.3));
  EXPECT_FALSE(SparseIsFaster(512, 2048, 0.45));
}

}  // namespace
}  // namespace fulcrum
