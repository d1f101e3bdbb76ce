// The `sparse_attention` plugin: hash-based sparse causal attention (Pagliardini et al.,
// NeurIPS 2023, "Faster Causal Attention Over Large Sequences Through Sparse Flash
// Attention", §3.2 — the method DynMo §4.2 uses): queries and keys are hashed into buckets,
// a query attends only to the earlier keys of its own bucket, and only the blocks of the
// bucket-sorted score matrix that can hold such a pair are computed. The buckets fill
// unevenly and change with the weights, so each layer has its own, changing cost — the
// layer's load (AttentionCore::Load) reports it to the balancer.
//
// NOTE [sparse attention hashing]
// Random-rotation LSH (Andoni et al. 2015; Reformer, Kitaev et al. 2020, §2): for layer l
// and global head g a fixed Gaussian matrix R [d, c] drawn from (--sparse_attention_seed or
// the model's --seed, l, g) only — not from the tensor-parallel rank or the number of heads
// a rank holds — so every layout hashes a head alike. With an even number of buckets n,
// c = n/2 and bucket(x) = argmax([xR, −xR]); with an odd n > 1, c = n and bucket(x) =
// argmax(xR); with n = 1 every position is in bucket 0 (dense causal attention). Queries
// and keys are hashed with the same R (after the rotary embedding). The matrices of all the
// model's heads are a buffer of the layer ("sparse_attention.rotations", [heads, d, c],
// the same on every tensor-parallel rank), so they are checkpointed and migrate with it.
//
// NOTE [sparse attention mask]
// Query i attends key j iff j ≤ i and (bucket_q(i) = bucket_k(j), or i − j <
// --sparse_attention_window), and always to itself (j = i): queries and keys are hashed
// separately, so without that a query whose bucket holds no earlier key would have an empty
// row (Pagliardini et al. attend to the first key for the same reason; the diagonal keeps
// the result independent of the bucket sizes).
//
// NOTE [sparse attention blocks]
// Per (batch, head), queries and keys are sorted by (bucket, position) and cut into blocks
// of --sparse_attention_block rows. A (query block, key block) pair is computed iff some
// bucket c has a key in the key block no later than some query of c in the query block
// (per block and bucket: the latest query, the earliest key) — exactly the pairs that hold
// at least one allowed same-bucket pair. Those pairs are gathered ([pairs, block, d]),
// their scores computed by one bmm and masked inside the block (bucket equal, causal); the
// window and the diagonal, where the buckets differ, are a band of max(window, 1) keys per
// query in the original order. Every score's row is one query: the softmax is combined
// across the blocks and the band flash-style — a per-query maximum (a constant shift, so
// it takes no gradient), exp, and the numerators and denominators summed per query with
// index_add — so the result and its gradients (autograd through gather, bmm, masked_fill,
// exp and index_add) are those of the dense masked softmax, and memory is proportional to
// the computed blocks (plus the band), never s².
//
// NOTE [sparse attention counts]
// Load() is the number of score entries the last forward computed (blocks × block² plus
// the band's), on this rank's heads; the metrics record counts every layer's blocks, score
// entries and the dense attention's entries over the iteration's training forwards and the
// whole model (every stage and tensor-parallel shard; this data-parallel replica's micro-
// batches): sparse_attention_blocks and sparse_attention_layer_density per layer (score
// entries computed over the dense attention's), sparse_attention_density over the model. The counts are a small fp64 buffer of the layer ("sparse_attention.counts"), so
// a layer that migrates after its forward, before the metrics, brings them along (they are
// checkpointed too, harmlessly). Attention dropout is not supported (refused).
#include <ATen/ATen.h>
#include <gflags/gflags.h>

#include <cmath>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/gpt_model.h"
#include "core/random.h"
#include "core/status.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_int64(sparse_attention_buckets, 4,
             "sparse_attention: number of hash buckets per head (1 = dense causal attention).");
DEFINE_int64(sparse_attention_window, 0,
             "sparse_attention: each query also attends to the keys j with i − j < this many "
             "(a local window, regardless of bucket); 0 = off (a query always attends to "
             "itself).");
DEFINE_int64(sparse_attention_block, 32,
             "sparse_attention: rows of a block of the bucket-sorted queries and keys; only "
             "block pairs that share a bucket (causally) are computed.");
DEFINE_int64(sparse_attention_seed, -1,
             "sparse_attention: seed of the hash rotations (-1 = the model's --seed).");

namespace fulcrum::plugins {
namespace {

constexpr char kRotationsBuffer[] = "sparse_attention.rotations";
constexpr char kCountsBuffer[] = "sparse_attention.counts";
constexpr int64_t kMaxBuckets = 4096;

// scatter_reduce warns once that it is in beta; the warning is not the user's business.
// Drops warnings while alive.
class QuietWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

at::Tensor ScatterReduce(const at::Tensor& self, const at::Tensor& index, const at::Tensor& src,
                         const char* reduce) {
  QuietWarnings quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  return self.scatter_reduce(0, index, src, reduce);
}

struct SparseAttentionOptions {
  int64_t buckets = 4;
  int64_t window = 0;
  int64_t block = 32;
  uint64_t seed = 1234;
};

absl::StatusOr<SparseAttentionOptions> OptionsFromFlags(const ModelOptions& model) {
  SparseAttentionOptions o;
  o.buckets = FLAGS_sparse_attention_buckets;
  o.window = FLAGS_sparse_attention_window;
  o.block = FLAGS_sparse_attention_block;
  o.seed = FLAGS_sparse_attention_seed < 0 ? model.seed
                                           : static_cast<uint64_t>(FLAGS_sparse_attention_seed);
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.buckets < 1 || o.buckets > kMaxBuckets) {
    return bad(absl::StrCat("--sparse_attention_buckets=", o.buckets, " must be in [1, ",
                            kMaxBuckets, "]"));
  }
  if (o.window < 0)
    return bad(absl::StrCat("--sparse_attention_window=", o.window, " must be ≥ 0"));
  if (o.block < 1) return bad(absl::StrCat("--sparse_attention_block=", o.block, " must be ≥ 1"));
  if (model.attention_dropout > 0) {
    return bad(absl::StrCat("--plugins=sparse_attention does not support --attention_dropout=",
                            model.attention_dropout, " (use 0)"));
  }
  return o;
}

// Columns of a head's rotation (NOTE [sparse attention hashing]).
int64_t RotationColumns(int64_t buckets) {
  if (buckets == 1) return 1;  // unused: one bucket needs no hash
  return buckets % 2 == 0 ? buckets / 2 : buckets;
}

// The rotations of every global head of `layer`: [heads, d, c], fp32.
at::Tensor MakeRotations(const SparseAttentionOptions& o, const ModelOptions& model,
                         int64_t layer) {
  std::vector<at::Tensor> heads;
  for (int64_t g = 0; g < model.num_attention_heads; ++g) {
    heads.push_back(
        NormalInit(o.seed, absl::StrCat("sparse_attention.rotation.layers.", layer, ".head.", g),
                   {model.head_dim(), RotationColumns(o.buckets)}, 1.0));
  }
  return at::stack(heads, 0).contiguous();
}

// The counts of a core's work (NOTE [sparse attention counts]), as slots of its buffer.
enum CountSlot : int64_t { kIteration, kBlocks, kEntries, kDenseEntries, kLastEntries, kNumCounts };

class SparseAttentionCore final : public AttentionCore {
 public:
  SparseAttentionCore(const SparseAttentionOptions& options, at::Tensor rotations,
                      at::Tensor counts, int64_t first_head)
      : options_(options),
        rotations_(std::move(rotations)),
        counts_(std::move(counts)),
        first_head_(first_head) {}

  at::Tensor Forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const ForwardContext& ctx) override;
  double Load() const override { return Count(kLastEntries); }

  // What the training forwards of `iteration` computed here (0 when none ran).
  double Count(int64_t iteration, CountSlot slot) const {
    return Count(kIteration) == static_cast<double>(iteration) ? Count(slot) : 0.0;
  }

 private:
  double Count(CountSlot slot) const { return counts_.data_ptr<double>()[slot]; }
  // Buckets of x [b, heads, s, d] → [b, heads, s] int64 (NOTE [sparse attention hashing]).
  at::Tensor Buckets(const at::Tensor& x) const;
  // The rotations on x's device in x's dtype. The buffer itself stays on the host (the
  // checkpoint and a layer move carry it; a load overwrites it in place, which bumps its
  // version): the copy is remade only when the device, the dtype or the version changes.
  const at::Tensor& RotationsOn(const at::Tensor& x) const {
    if (!rotations_on_.defined() || rotations_on_.device() != x.device() ||
        rotations_on_.scalar_type() != x.scalar_type() ||
        rotations_version_ != rotations_._version()) {
      rotations_on_ = rotations_.to(x.device(), x.scalar_type());
      rotations_version_ = rotations_._version();
    }
    return rotations_on_;
  }

  SparseAttentionOptions options_;
  at::Tensor rotations_;  // The layer's buffer (a handle): [global heads, d, c].
  at::Tensor counts_;     // The layer's buffer (a handle): fp64 [kNumCounts].
  int64_t first_head_;
  mutable at::Tensor rotations_on_;  // RotationsOn's copy.
  mutable int64_t rotations_version_ = -1;
};

at::Tensor SparseAttentionCore::Buckets(const at::Tensor& x) const {
  const int64_t heads = x.size(1);
  if (options_.buckets == 1)
    return at::zeros({x.size(0), heads, x.size(2)}, x.options().dtype(at::kLong));
  TORCH_INTERNAL_ASSERT(first_head_ + heads <= rotations_.size(0), "more heads than the model has");
  const at::Tensor r = RotationsOn(x).narrow(0, first_head_, heads);
  at::Tensor projected = at::matmul(x, r.unsqueeze(0));  // [b, heads, s, c]
  if (options_.buckets % 2 == 0) projected = at::cat({projected, -projected}, -1);
  return projected.argmax(-1);
}

at::Tensor SparseAttentionCore::Forward(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const ForwardContext& ctx) {
  // NOTE [sparse attention mixed precision]
  // Under --bf16 the queries, keys and values arrive in bf16 and the core computes on them
  // widened to fp32, handing back bf16: the hash is an
  // argmax over projections, where bf16 products (8 bits of mantissa) tie and flip buckets
  // that the same bf16 values hashed in fp32 keep apart, and the softmax's running maximum,
  // exponentials and the scattered sums of numerator and denominator are accumulators,
  // which a flash-attention kernel also keeps in fp32. With fp32 or fp64 activations
  // nothing is cast.
  if (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) {
    return Forward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), ctx).to(q.scalar_type());
  }
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), d = q.size(3);
  const int64_t n = b * heads;  // independent sequences
  const int64_t block = std::min(options_.block, s);
  const int64_t nblk = (s + block - 1) / block;
  const int64_t padded = nblk * block;
  const int64_t nb = options_.buckets;
  const bool band = nb > 1;  // with one bucket the window and diagonal are in the blocks
  const int64_t width = std::max<int64_t>(options_.window, 1);
  const auto long_options = q.options().dtype(at::kLong);
  const double inf = std::numeric_limits<double>::infinity();

  // Hashing, sorting and the block schedule: integer work, no gradient.
  at::Tensor q_rows, k_rows, q_bucket, q_pos, k_bucket, k_pos, pairs, bq, bk;
  {
    at::NoGradGuard no_grad;
    bq = Buckets(q.detach()).reshape({n, s});
    bk = Buckets(k.detach()).reshape({n, s});
    const at::Tensor positions = at::arange(s, long_options);
    const at::Tensor seq_base = (at::arange(n, long_options) * s).unsqueeze(1);  // [n, 1]
    // Sorted by (bucket, position): key bucket·s + position is unique per sequence.
    auto sorted = [&](const at::Tensor& buckets, at::Tensor* bucket, at::Tensor* pos,
                      at::Tensor* rows, int64_t pad_bucket, int64_t pad_pos) {
      const at::Tensor key = std::get<0>((buckets * s + positions).sort(-1));
      *bucket = at::full({n, padded}, pad_bucket, long_options);
      *pos = at::full({n, padded}, pad_pos, long_options);
      bucket->narrow(1, 0, s).copy_(key.div(s, "floor"));
      pos->narrow(1, 0, s).copy_(key.remainder(s));
      // Row of each sorted entry in the flattened [n·s (+1 zero row), d] tensors.
      *rows = at::full({n, padded}, n * s, long_options);
      rows->narrow(1, 0, s).copy_(pos->narrow(1, 0, s) + seq_base);
    };
    sorted(bq, &q_bucket, &q_pos, &q_rows, /*pad_bucket=*/-1, /*pad_pos=*/-1);
    sorted(bk, &k_bucket, &k_pos, &k_rows, /*pad_bucket=*/-2, /*pad_pos=*/s);
    // Per (sequence, block, bucket): the latest query and the earliest key.
    const at::Tensor block_of = (positions.div(block, "floor")).unsqueeze(0);  // sorted row → block
    auto slot = [&](const at::Tensor& bucket) {
      return ((at::arange(n, long_options).unsqueeze(1) * nblk + block_of) * nb +
              bucket.narrow(1, 0, s))
          .reshape(-1);
    };
    const at::Tensor latest_query =
        ScatterReduce(at::full({n * nblk * nb}, -1, long_options), slot(q_bucket),
                      q_pos.narrow(1, 0, s).reshape(-1), "amax");
    const at::Tensor earliest_key =
        ScatterReduce(at::full({n * nblk * nb}, s, long_options), slot(k_bucket),
                      k_pos.narrow(1, 0, s).reshape(-1), "amin");
    // NOTE [sparse attention blocks]: [n, query block, key block].
    const at::Tensor needed =
        (earliest_key.view({n, 1, nblk, nb}) <= latest_query.view({n, nblk, 1, nb})).any(-1);
    pairs = needed.nonzero();  // [P, 3]: sequence, query block, key block
  }
  const int64_t num_pairs = pairs.size(0);
  const at::Tensor seq = pairs.select(1, 0);
  const at::Tensor q_block = seq * nblk + pairs.select(1, 1);
  const at::Tensor k_block = seq * nblk + pairs.select(1, 2);

  // Flattened rows with one zero row at n·s for the padding.
  const at::Tensor scaled_q = q * (1.0 / std::sqrt(static_cast<double>(d)));
  auto rows_of = [&](const at::Tensor& x) {
    return at::cat({x.reshape({n * s, d}), at::zeros({1, d}, x.options())}, 0);
  };
  auto blocks_of = [&](const at::Tensor& x, const at::Tensor& rows, const at::Tensor& which) {
    return rows_of(x)
        .index_select(0, rows.reshape(-1))
        .view({n * nblk, block, d})
        .index_select(0, which);
  };
  const at::Tensor qb = blocks_of(scaled_q, q_rows, q_block);  // [P, block, d]
  const at::Tensor kb = blocks_of(k, k_rows, k_block);
  const at::Tensor vb = blocks_of(v, k_rows, k_block);
  at::Tensor allowed, rows;
  {
    at::NoGradGuard no_grad;
    auto per_block = [&](const at::Tensor& t, const at::Tensor& which) {
      return t.view({n * nblk, block}).index_select(0, which);
    };
    allowed =
        per_block(q_bucket, q_block)
            .unsqueeze(2)
            .eq(per_block(k_bucket, k_block).unsqueeze(1))
            .logical_and_(
                per_block(k_pos, k_block).unsqueeze(1).le(per_block(q_pos, q_block).unsqueeze(2)));
    rows = per_block(q_rows, q_block).reshape(-1);  // [P·block]: each score row's query
  }
  const at::Tensor scores =
      at::bmm(qb, kb.transpose(1, 2)).masked_fill(allowed.logical_not(), -inf);

  // The band (window and diagonal, buckets differing) in the original order: [n, s, width].
  at::Tensor band_scores, band_v;
  if (band) {
    auto windows = [&](const at::Tensor& x) {  // [n, s, d] → [n, s, d, width]: keys i−width+1..i
      return at::cat({at::zeros({n, width - 1, d}, x.options()), x.reshape({n, s, d})}, 1)
          .unfold(1, width, 1);
    };
    at::Tensor band_allowed;
    {
      at::NoGradGuard no_grad;
      const at::Tensor key_pos =
          at::arange(s, long_options).unsqueeze(1) + at::arange(width, long_options) - (width - 1);
      const at::Tensor key_bucket = at::cat({at::full({n, width - 1}, -1, long_options), bk}, 1)
                                        .unfold(1, width, 1);  // [n, s, width]
      band_allowed = key_pos.ge(0).unsqueeze(0).logical_and(key_bucket.ne(bq.unsqueeze(2)));
    }
    band_scores = at::matmul(scaled_q.reshape({n, s, 1, d}), windows(k))
                      .squeeze(2)
                      .masked_fill(band_allowed.logical_not(), -inf);
    band_v = windows(v);
  }

  // One softmax per query over the blocks and the band (NOTE [sparse attention blocks]).
  at::Tensor shift;
  {
    at::NoGradGuard no_grad;
    shift = ScatterReduce(at::full({n * s + 1}, -inf, q.options()), rows,
                          scores.amax(-1).reshape(-1), "amax");
    if (band) {
      shift.narrow(0, 0, n * s)
          .copy_(at::maximum(shift.narrow(0, 0, n * s), band_scores.amax(-1).reshape(-1)));
    }
    shift.masked_fill_(shift.isinf(), 0.0);  // the padding row only: every query sees itself
  }
  const at::Tensor p = (scores - shift.index_select(0, rows).view({num_pairs, block, 1})).exp();
  at::Tensor numerator = at::zeros({n * s + 1, d}, q.options())
                             .index_add(0, rows, at::bmm(p, vb).reshape({num_pairs * block, d}))
                             .narrow(0, 0, n * s)
                             .view({n, s, d});
  at::Tensor denominator = at::zeros({n * s + 1}, q.options())
                               .index_add(0, rows, p.sum(-1).reshape(-1))
                               .narrow(0, 0, n * s)
                               .view({n, s});
  if (band) {
    const at::Tensor pb = (band_scores - shift.narrow(0, 0, n * s).view({n, s, 1})).exp();
    numerator = numerator + at::matmul(band_v, pb.unsqueeze(-1)).squeeze(-1);
    denominator = denominator + pb.sum(-1);
  }
  const at::Tensor context = (numerator / denominator.unsqueeze(-1)).view({b, heads, s, d});

  // NOTE [activation recomputation]: a recomputed forward computed these blocks before.
  if (ctx.recomputing) return context;
  double* counts = counts_.data_ptr<double>();
  counts[kLastEntries] =
      static_cast<double>(num_pairs * block * block + (band ? n * s * width : 0));
  if (ctx.training) {
    if (counts[kIteration] != static_cast<double>(ctx.iteration)) {
      counts[kIteration] = static_cast<double>(ctx.iteration);
      counts[kBlocks] = counts[kEntries] = counts[kDenseEntries] = 0;
    }
    counts[kBlocks] += static_cast<double>(num_pairs);
    counts[kEntries] += counts[kLastEntries];
    counts[kDenseEntries] += static_cast<double>(n * s * s);
  }
  return context;
}

class SparseAttentionPlugin final : public Plugin {
 public:
  SparseAttentionPlugin(SparseAttentionOptions options, ModelOptions model)
      : options_(options), model_(std::move(model)) {}
  const char* name() const override { return "sparse_attention"; }
  // Its core counts once: not while its layer is recomputed (the same blocks again).
  bool SupportsRecompute() const override { return true; }
  // The attention core runs inside the tensor-parallel region: q, k, v hold the whole
  // sequence (this rank's heads).
  bool SupportsSequenceParallel() const override { return true; }

  std::unique_ptr<AttentionCore> MakeAttentionCore(int64_t layer, Unit& unit,
                                                   bool initialize) override {
    // A shell gets the same (deterministic) rotations; a load overwrites them anyway.
    at::Tensor rotations = unit.AddBuffer(kRotationsBuffer, MakeRotations(options_, model_, layer));
    at::Tensor counts = at::zeros({kNumCounts}, at::kDouble);
    counts[kIteration] = -1;
    counts = unit.AddBuffer(kCountsBuffer, counts);
    const int64_t first_head = unit.tp_rank() * (model_.num_attention_heads / unit.tp_size());
    return std::make_unique<SparseAttentionCore>(options_, rotations, counts, first_head);
  }

  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) override {
    // Per layer: blocks, score entries, dense entries; every stage and shard adds its own.
    const int64_t layers = model_.num_layers;
    std::vector<double> counts(3 * layers, 0.0);
    for (const auto& [index, layer] : ctx.model().layers()) {
      const auto* core = dynamic_cast<const SparseAttentionCore*>(layer->attention_core());
      if (core == nullptr) continue;
      counts[index] = core->Count(ctx.iteration(), kBlocks);
      counts[layers + index] = core->Count(ctx.iteration(), kEntries);
      counts[2 * layers + index] = core->Count(ctx.iteration(), kDenseEntries);
    }
    ctx.SumOverModel(counts);
    nlohmann::json blocks = nlohmann::json::object();
    nlohmann::json layer_density = nlohmann::json::object();
    double entries = 0, dense = 0;
    for (int64_t l = 0; l < layers; ++l) {
      const std::string key = absl::StrCat("layers.", l);
      blocks[key] = static_cast<int64_t>(counts[l]);
      const double layer_dense = counts[2 * layers + l];
      layer_density[key] = layer_dense > 0 ? counts[layers + l] / layer_dense : 0.0;
      entries += counts[layers + l];
      dense += layer_dense;
    }
    (*record)["sparse_attention_blocks"] = blocks;
    (*record)["sparse_attention_layer_density"] = std::move(layer_density);
    const double density = dense > 0 ? entries / dense : 0.0;
    (*record)["sparse_attention_density"] = density;
    absl::StrAppend(log_line, absl::StrFormat(" | attn density %.3f", density));
    return absl::OkStatus();
  }

  std::vector<std::pair<std::string, std::string>> CheckpointShape() const override {
    return {{"sparse_attention_buckets", absl::StrCat(options_.buckets)}};
  }

 private:
  SparseAttentionOptions options_;
  ModelOptions model_;
};

absl::Status Validate(const PluginSetup& setup) { return OptionsFromFlags(setup.model).status(); }

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup& setup) {
  FULCRUM_ASSIGN_OR_RETURN(SparseAttentionOptions options, OptionsFromFlags(setup.model));
  return std::unique_ptr<Plugin>(new SparseAttentionPlugin(options, setup.model));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(sparse_attention,
                        "hash-based sparse causal attention (Pagliardini et al. 2023, DynMo): LSH "
                        "buckets per head, only block pairs sharing a bucket are computed",
                        (PluginEntry{nullptr, Validate, Create,
                                    /*uses_expert_parallel_group=*/false, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
