#include "core/checkpoint/hf_checkpoint.h"

#include <ATen/ATen.h>

#include <cctype>
#include <map>
#include <memory>
#include <set>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "core/json_limits.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

// How one Fulcrum tensor is made from HF tensors (import) and back (export). Layouts:
// /work/notes/hf-spec.md.
enum class Convert {
  kCopy,
  kConv1D,          // GPT-2's Conv1D stores [in, out]: transposed.
  kGpt2QkvWeight,   // c_attn [h, 3h]: columns [q all heads | k | v] → rows (head, {q,k,v}, d).
  kGpt2QkvBias,     // c_attn bias [3h], same reorder.
  kGroupedQkv,      // q_proj, k_proj, v_proj → rows (group, {q of its heads, k, v}, d).
  kSwiGlu,          // gate, up → rows interleaved: 2j = gate_j, 2j+1 = up_j.
  kFusedGateUp,     // transformers v5 experts.gate_up_proj [E, 2F, h] (gate rows, then up).
  kFusedDown,       // transformers v5 experts.down_proj [E, h, F].
};

using Shape = std::vector<int64_t>;

struct Mapping {
  std::string fulcrum;
  Shape fulcrum_shape;
  std::vector<std::string> hf;
  std::vector<Shape> hf_shapes;
  Convert convert = Convert::kCopy;
  int64_t expert = -1;  // kFused*: which expert of the fused tensor.
  int64_t unit = 0;     // Output group on import: 0 embedding, 1 + layer, num_layers + 1 head.
};

// Spellings that differ between checkpoints of the same architecture.
struct HfNaming {
  std::string gpt2_prefix = "transformer.";  // save_pretrained; hub's gpt2 has none.
  bool fused_experts = false;                // transformers v5 in-memory Mixtral layout.
};

class MappingBuilder {
 public:
  explicit MappingBuilder(std::vector<Mapping>* out) : out_(out) {}
  void Add(int64_t unit, const std::string& fulcrum, Shape fulcrum_shape,
           std::vector<std::string> hf, std::vector<Shape> hf_shapes,
           Convert convert = Convert::kCopy, int64_t expert = -1) {
    out_->push_back({fulcrum, std::move(fulcrum_shape), std::move(hf), std::move(hf_shapes),
                     convert, expert, unit});
  }
  // Same name suffix and shape on both sides.
  void Same(int64_t unit, const std::string& fulcrum, const std::string& hf, Shape shape) {
    Add(unit, fulcrum, shape, {hf}, {shape});
  }

 private:
  std::vector<Mapping>* out_;
};

std::vector<Mapping> BuildMappings(const HfModelConfig& m, const HfNaming& naming) {
  std::vector<Mapping> out;
  MappingBuilder b(&out);
  const int64_t h = m.hidden_size, heads = m.num_attention_heads, g = m.num_query_groups;
  const int64_t d = m.head_dim(), f = m.ffn_hidden_size, v = m.vocab_size;
  const int64_t head_unit = m.num_layers + 1;
  if (m.architecture == HfArchitecture::kGpt2) {
    const std::string& p = naming.gpt2_prefix;
    b.Same(0, "embedding.word_embeddings.weight", p + "wte.weight", {v, h});
    b.Same(0, "embedding.position_embeddings.weight", p + "wpe.weight", {m.max_positions, h});
    for (int64_t i = 0; i < m.num_layers; ++i) {
      const std::string ours = absl::StrCat("layers.", i, ".");
      const std::string theirs = absl::StrCat(p, "h.", i, ".");
      const int64_t u = i + 1;
      b.Same(u, ours + "input_layernorm.weight", theirs + "ln_1.weight", {h});
      b.Same(u, ours + "input_layernorm.bias", theirs + "ln_1.bias", {h});
      b.Add(u, ours + "self_attention.linear_qkv.weight", {3 * h, h},
            {theirs + "attn.c_attn.weight"}, {{h, 3 * h}}, Convert::kGpt2QkvWeight);
      b.Add(u, ours + "self_attention.linear_qkv.bias", {3 * h}, {theirs + "attn.c_attn.bias"},
            {{3 * h}}, Convert::kGpt2QkvBias);
      b.Add(u, ours + "self_attention.linear_proj.weight", {h, h},
            {theirs + "attn.c_proj.weight"}, {{h, h}}, Convert::kConv1D);
      b.Same(u, ours + "self_attention.linear_proj.bias", theirs + "attn.c_proj.bias", {h});
      b.Same(u, ours + "pre_mlp_layernorm.weight", theirs + "ln_2.weight", {h});
      b.Same(u, ours + "pre_mlp_layernorm.bias", theirs + "ln_2.bias", {h});
      b.Add(u, ours + "mlp.linear_fc1.weight", {f, h}, {theirs + "mlp.c_fc.weight"}, {{h, f}},
            Convert::kConv1D);
      b.Same(u, ours + "mlp.linear_fc1.bias", theirs + "mlp.c_fc.bias", {f});
      b.Add(u, ours + "mlp.linear_fc2.weight", {h, f}, {theirs + "mlp.c_proj.weight"}, {{f, h}},
            Convert::kConv1D);
      b.Same(u, ours + "mlp.linear_fc2.bias", theirs + "mlp.c_proj.bias", {h});
    }
    b.Same(head_unit, "head.final_layernorm.weight", p + "ln_f.weight", {h});
    b.Same(head_unit, "head.final_layernorm.bias", p + "ln_f.bias", {h});
    return out;
  }
  b.Same(0, "embedding.word_embeddings.weight", "model.embed_tokens.weight", {v, h});
  for (int64_t i = 0; i < m.num_layers; ++i) {
    const std::string ours = absl::StrCat("layers.", i, ".");
    const std::string theirs = absl::StrCat("model.layers.", i, ".");
    const int64_t u = i + 1;
    b.Same(u, ours + "input_layernorm.weight", theirs + "input_layernorm.weight", {h});
    b.Add(u, ours + "self_attention.linear_qkv.weight", {(heads + 2 * g) * d, h},
          {theirs + "self_attn.q_proj.weight", theirs + "self_attn.k_proj.weight",
           theirs + "self_attn.v_proj.weight"},
          {{heads * d, h}, {g * d, h}, {g * d, h}}, Convert::kGroupedQkv);
    b.Same(u, ours + "self_attention.linear_proj.weight", theirs + "self_attn.o_proj.weight",
           {h, heads * d});
    b.Same(u, ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight", {h});
    if (m.architecture == HfArchitecture::kLlama) {
      b.Add(u, ours + "mlp.linear_fc1.weight", {2 * f, h},
            {theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"}, {{f, h}, {f, h}},
            Convert::kSwiGlu);
      b.Same(u, ours + "mlp.linear_fc2.weight", theirs + "mlp.down_proj.weight", {h, f});
      continue;
    }
    const int64_t e_count = m.num_experts;
    if (naming.fused_experts) {
      b.Same(u, ours + "mlp.router.weight", theirs + "mlp.gate.weight", {e_count, h});
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string expert = absl::StrCat(ours, "mlp.experts.", e, ".");
        b.Add(u, expert + "linear_fc1.weight", {2 * f, h}, {theirs + "mlp.experts.gate_up_proj"},
              {{e_count, 2 * f, h}}, Convert::kFusedGateUp, e);
        b.Add(u, expert + "linear_fc2.weight", {h, f}, {theirs + "mlp.experts.down_proj"},
              {{e_count, h, f}}, Convert::kFusedDown, e);
      }
      continue;
    }
    b.Same(u, ours + "mlp.router.weight", theirs + "block_sparse_moe.gate.weight", {e_count, h});
    for (int64_t e = 0; e < e_count; ++e) {
      const std::string expert = absl::StrCat(ours, "mlp.experts.", e, ".");
      const std::string hf_expert = absl::StrCat(theirs, "block_sparse_moe.experts.", e, ".");
      b.Add(u, expert + "linear_fc1.weight", {2 * f, h},
            {hf_expert + "w1.weight", hf_expert + "w3.weight"}, {{f, h}, {f, h}},
            Convert::kSwiGlu);
      b.Same(u, expert + "linear_fc2.weight", hf_expert + "w2.weight", {h, f});
    }
  }
  b.Same(head_unit, "head.final_layernorm.weight", "model.norm.weight", {h});
  if (!m.tie_embeddings) b.Same(head_unit, "head.output_layer.weight", "lm_head.weight", {v, h});
  return out;
}

// HF tensors that are not parameters, or duplicates of one, and are skipped on import.
bool IgnoredOnImport(const HfModelConfig& m, const std::string& name) {
  if (m.architecture == HfArchitecture::kGpt2) {
    // Causal-mask buffers that older transformers saved; the tied lm_head.
    return absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias") ||
           name == "lm_head.weight";
  }
  return absl::EndsWith(name, ".rotary_emb.inv_freq") ||
         (m.tie_embeddings && name == "lm_head.weight");
}

// ---------------------------------------------------------------------------------------
// The conversions. `m` gives the head counts; shapes were checked before.

at::Tensor ToFulcrum(const Mapping& map, const HfModelConfig& m,
                     const std::vector<at::Tensor>& in) {
  const int64_t h = m.hidden_size, heads = m.num_attention_heads, g = m.num_query_groups;
  const int64_t d = m.head_dim();
  at::Tensor out;
  switch (map.convert) {
    case Convert::kCopy: out = in[0].clone(); break;
    case Convert::kConv1D: out = in[0].t(); break;
    case Convert::kGpt2QkvWeight:
      out = in[0].t().reshape({3, heads, d, h}).permute({1, 0, 2, 3});
      break;
    case Convert::kGpt2QkvBias: out = in[0].reshape({3, heads, d}).permute({1, 0, 2}); break;
    case Convert::kGroupedQkv: {
      const int64_t per_group = heads / g;
      out = at::cat({in[0].reshape({g, per_group * d, -1}), in[1].reshape({g, d, -1}),
                     in[2].reshape({g, d, -1})},
                    1);
      break;
    }
    case Convert::kSwiGlu: out = at::stack({in[0], in[1]}, 1); break;
    case Convert::kFusedGateUp: {
      const at::Tensor both = in[0].select(0, map.expert);
      const int64_t f = both.size(0) / 2;
      out = at::stack({both.narrow(0, 0, f), both.narrow(0, f, f)}, 1);
      break;
    }
    case Convert::kFusedDown: out = in[0].select(0, map.expert); break;
  }
  return out.reshape(map.fulcrum_shape).contiguous().clone();
}

std::vector<at::Tensor> FromFulcrum(const Mapping& map, const HfModelConfig& m,
                                    const at::Tensor& in) {
  const int64_t h = m.hidden_size, heads = m.num_attention_heads, g = m.num_query_groups;
  const int64_t d = m.head_dim();
  std::vector<at::Tensor> out;
  switch (map.convert) {
    case Convert::kCopy: out = {in}; break;
    case Convert::kConv1D: out = {in.t()}; break;
    case Convert::kGpt2QkvWeight:
      out = {in.reshape({heads, 3, d, h}).permute({1, 0, 2, 3}).reshape({3 * h, h}).t()};
      break;
    case Convert::kGpt2QkvBias:
      out = {in.reshape({heads, 3, d}).permute({1, 0, 2})};
      break;
    case Convert::kGroupedQkv: {
      const int64_t per_group = heads / g;
      const at::Tensor r = in.reshape({g, (per_group + 2) * d, -1});
      out = {r.narrow(1, 0, per_group * d), r.narrow(1, per_group * d, d),
             r.narrow(1, (per_group + 1) * d, d)};
      break;
    }
    case Convert::kSwiGlu: {
      const at::Tensor r = in.reshape({in.size(0) / 2, 2, -1});
      out = {r.select(1, 0), r.select(1, 1)};
      break;
    }
    case Convert::kFusedGateUp:
    case Convert::kFusedDown:
      TORCH_INTERNAL_ASSERT(false, "export writes unfused experts");
  }
  for (size_t i = 0; i < out.size(); ++i) out[i] = out[i].reshape(map.hf_shapes[i]).contiguous();
  return out;
}

// ---------------------------------------------------------------------------------------

std::string ShapeText(const Shape& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

bool IsFloating(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

const char* TorchDtypeName(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: return "float32";
  }
}

absl::StatusOr<nlohmann::json> ReadJsonFile(FileSystem* fs, const std::string& path) {
  FULCRUM_ASSIGN_OR_RETURN(const std::string text, fs->ReadFile(path));
  FULCRUM_RETURN_IF_ERROR(CheckJsonDepth(text, path));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON: ", e.what()));
  }
}

// The output directory must be new (or empty): a conversion never mixes with, or
// replaces, something already there.
absl::Status CheckOutputDir(FileSystem* fs, const std::string& out) {
  if (!fs->FileExists(out)) return absl::OkStatus();
  if (!fs->IsDirectory(out)) {
    return absl::FailedPreconditionError(absl::StrCat("output ", out, " exists and is not a directory"));
  }
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> entries, fs->ListDir(out));
  if (!entries.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("output directory ", out, " is not empty; give a new directory"));
  }
  return absl::OkStatus();
}

// A fresh sibling of `out` to write into before renaming it to `out`.
absl::StatusOr<std::string> MakeStagingDir(FileSystem* fs, const std::string& out,
                                           const char* what) {
  std::string trimmed = out;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string staging = absl::StrCat(trimmed, ".", what, "_tmp_", ::getpid());
  FULCRUM_RETURN_IF_ERROR(fs->DeleteRecursively(staging));
  FULCRUM_RETURN_IF_ERROR(fs->CreateDir(staging));
  return staging;
}

absl::Status MoveIntoPlace(FileSystem* fs, const std::string& staging, const std::string& out) {
  FULCRUM_RETURN_IF_ERROR(fs->RenameFile(staging, out));
  return fs->SyncDir(DirName(out).empty() ? "." : DirName(out));
}

// The tensors of an HF model directory: every name, its file's reader and its header entry.
class HfTensors {
 public:
  static absl::StatusOr<HfTensors> Open(FileSystem* fs, const std::string& dir) {
    HfTensors t;
    const std::string index_path = JoinPath(dir, "model.safetensors.index.json");
    const std::string single_path = JoinPath(dir, "model.safetensors");
    if (fs->FileExists(index_path)) {
      FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json index, ReadJsonFile(fs, index_path));
      if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map is missing or not an object"));
      }
      for (const auto& [name, file] : index["weight_map"].items()) {
        if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat(
              index_path, ": weight_map[\"", name, "\"]=", file.dump(), " is not a file name"));
        }
        const std::string file_name = file.get<std::string>();
        auto it = t.readers_.find(file_name);
        if (it == t.readers_.end()) {
          const std::string path = JoinPath(dir, file_name);
          if (!fs->FileExists(path)) {
            return absl::NotFoundError(absl::StrCat("shard file ", path, " (named by ", index_path,
                                                    " for tensor ", name, ") does not exist"));
          }
          FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                                   SafetensorsReader::Open(fs, path));
          it = t.readers_.emplace(file_name, std::move(reader)).first;
        }
        if (!it->second->Has(name)) {
          return absl::InvalidArgumentError(absl::StrCat(index_path, " puts tensor ", name, " in ",
                                                         file_name, ", which does not hold it"));
        }
        t.where_[name] = it->second.get();
      }
    } else if (fs->FileExists(single_path)) {
      FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                               SafetensorsReader::Open(fs, single_path));
      for (const std::string& name : reader->names()) t.where_[name] = reader.get();
      t.readers_.emplace("model.safetensors", std::move(reader));
    } else {
      return absl::NotFoundError(absl::StrCat(
          dir, " has neither model.safetensors nor model.safetensors.index.json (only "
               "safetensors weights are read; convert pytorch_model.bin with transformers first)"));
    }
    return t;
  }

  const std::map<std::string, const SafetensorsReader*>& names() const { return where_; }
  bool Has(const std::string& name) const { return where_.count(name) > 0; }
  const SafetensorsTensorInfo& Info(const std::string& name) const {
    const SafetensorsReader* reader = where_.at(name);
    return *reader->info(name);
  }
  std::string FileOf(const std::string& name) const { return where_.at(name)->path(); }

  // A read-only view of the mapped bytes when they are aligned for the dtype (the common
  // case), else a copy; the caller makes its own tensor from it.
  at::Tensor View(const std::string& name) const {
    const SafetensorsReader* reader = where_.at(name);
    const SafetensorsTensorInfo& info = *reader->info(name);
    const std::string_view bytes = *reader->RawBytes(name);
    const size_t itemsize = c10::elementSize(info.dtype);
    if (reinterpret_cast<uintptr_t>(bytes.data()) % itemsize == 0 && !bytes.empty()) {
      return at::from_blob(const_cast<char*>(bytes.data()), info.shape,
                           at::TensorOptions().dtype(info.dtype));
    }
    return *reader->Read(name);
  }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;  // By file name.
  std::map<std::string, const SafetensorsReader*> where_;              // By tensor name.
};

std::string ListSome(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(kShown, names.size()));
  std::string text = absl::StrJoin(shown, ", ");
  if (names.size() > kShown) absl::StrAppend(&text, " and ", names.size() - kShown, " more");
  return text;
}

std::string ShapeFieldsHint(const HfModelConfig& m) {
  return m.architecture == HfArchitecture::kGpt2
             ? "config.json's n_embd, n_head, n_inner, n_positions, vocab_size"
             : "config.json's hidden_size, num_attention_heads, num_key_value_heads, "
               "intermediate_size, vocab_size, num_local_experts";
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  uint64_t scale = 0;
  const std::pair<const char*, uint64_t> kUnits[] = {
      {"", 1},          {"B", 1},           {"KB", 1000},       {"MB", 1000'000},
      {"GB", 1000'000'000}, {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}};
  for (const auto& [name, value] : kUnits) {
    if (unit == name) scale = value;
  }
  if (digits == 0 || digits > 12 || scale == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_shard_size='", text, "' is not a size such as 5GB, 500MB, 2GiB or 123456 (bytes)"));
  }
  return std::stoull(text.substr(0, digits)) * scale;
}

absl::StatusOr<HfImportResult> ImportHuggingFace(FileSystem* fs, const std::string& hf_dir,
                                                 const std::string& out) {
  const std::string config_path = JoinPath(hf_dir, "config.json");
  if (!fs->FileExists(config_path)) {
    return absl::NotFoundError(absl::StrCat(config_path, " does not exist (not a transformers "
                                            "model directory?)"));
  }
  FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json config, ReadJsonFile(fs, config_path));
  FULCRUM_ASSIGN_OR_RETURN(const HfModelConfig m, ParseHfConfig(config, config_path));
  FULCRUM_ASSIGN_OR_RETURN(const HfTensors tensors, HfTensors::Open(fs, hf_dir));

  HfNaming naming;
  if (m.architecture == HfArchitecture::kGpt2 && !tensors.Has("transformer.wte.weight") &&
      tensors.Has("wte.weight")) {
    naming.gpt2_prefix = "";  // The hub's original gpt2 files.
  }
  naming.fused_experts = m.architecture == HfArchitecture::kMixtral &&
                         tensors.Has("model.layers.0.mlp.experts.gate_up_proj");
  const std::vector<Mapping> mappings = BuildMappings(m, naming);

  // Everything is checked from the headers before anything is written.
  std::set<std::string> used;
  for (const Mapping& map : mappings) {
    for (size_t i = 0; i < map.hf.size(); ++i) {
      const std::string& name = map.hf[i];
      if (!tensors.Has(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            hf_dir, " has no tensor ", name, ", which a ", HfArchitectureName(m.architecture),
            " with this config.json needs (for Fulcrum's ", map.fulcrum, ")"));
      }
      const SafetensorsTensorInfo& info = tensors.Info(name);
      if (info.shape != map.hf_shapes[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", name, " in ", tensors.FileOf(name), " has shape ", ShapeText(info.shape),
            " but ", ShapeFieldsHint(m), " give ", ShapeText(map.hf_shapes[i])));
      }
      if (!IsFloating(info.dtype)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " in ", tensors.FileOf(name),
                                                       " has dtype ", c10::toString(info.dtype),
                                                       "; expected F32, BF16, F16 or F64"));
      }
      used.insert(name);
    }
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, reader] : tensors.names()) {
    if (!used.count(name) && !IgnoredOnImport(m, name)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        hf_dir, " holds ", unexpected.size(), " tensor(s) that a ",
        HfArchitectureName(m.architecture), " with this config.json does not have: ",
        ListSome(unexpected), " (config.json does not describe these weights)"));
  }
  FULCRUM_RETURN_IF_ERROR(CheckOutputDir(fs, out));

  FULCRUM_ASSIGN_OR_RETURN(const std::string staging, MakeStagingDir(fs, out, "import"));
  HfImportResult result;
  result.model = m;
  result.flags = FulcrumFlags(m);
  absl::Status status = [&]() -> absl::Status {
    FULCRUM_ASSIGN_OR_RETURN(CheckpointWriter writer, CheckpointWriter::Begin(fs, staging, 0));
    // One shard per unit keeps memory to one layer's tensors.
    size_t next = 0;
    for (int64_t unit = 0; unit <= m.num_layers + 1; ++unit) {
      std::vector<std::pair<std::string, at::Tensor>> shard;
      for (; next < mappings.size() && mappings[next].unit == unit; ++next) {
        const Mapping& map = mappings[next];
        std::vector<at::Tensor> in;
        for (const std::string& name : map.hf) in.push_back(tensors.View(name));
        at::Tensor t = ToFulcrum(map, m, in);
        result.parameters += t.numel();
        shard.emplace_back(map.fulcrum, std::move(t));
      }
      const std::string shard_name =
          unit == 0 ? "embedding"
                    : unit > m.num_layers ? "head" : absl::StrFormat("layer_%05d", unit - 1);
      result.tensors += static_cast<int64_t>(shard.size());
      FULCRUM_RETURN_IF_ERROR(writer.WriteShard(shard_name, shard));
    }
    nlohmann::json fields;
    fields["iteration"] = 0;
    fields[kImportedFromField] = {{"format", "huggingface"},
                                  {"architecture", HfArchitectureName(m.architecture)},
                                  {"source", hf_dir},
                                  {"config", config}};
    fields["config"] = {{"model", FulcrumModelJson(m)},
                        {"feed_forward", FulcrumFeedForwardJson(m)}};
    fields["fulcrum_flags"] = result.flags;
    return writer.Commit(fields);
  }();
  if (status.ok()) status = MoveIntoPlace(fs, staging, out);
  if (!status.ok()) {
    (void)fs->DeleteRecursively(staging);
    return status;
  }
  result.checkpoint_dir = JoinPath(out, "iter_0000000");
  return result;
}

absl::StatusOr<HfExportResult> ExportHuggingFace(FileSystem* fs, const std::string& checkpoint,
                                                 const std::string& out,
                                                 const HfExportOptions& options) {
  FULCRUM_ASSIGN_OR_RETURN(const CheckpointReader reader, CheckpointReader::Open(fs, checkpoint));
  const nlohmann::json& manifest = reader.manifest();
  const std::string source = JoinPath(reader.dir(), kManifestFileName);
  if (!manifest.contains("config") || !manifest["config"].is_object() ||
      !manifest["config"].contains("model")) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, " has no config.model (not a checkpoint of fulcrum_train?)"));
  }
  const nlohmann::json& config = manifest["config"];
  const nlohmann::json feed_forward = config.value("feed_forward", nlohmann::json::object());
  nlohmann::json imported_config;
  if (manifest.contains(kImportedFromField) && manifest[kImportedFromField].is_object()) {
    imported_config = manifest[kImportedFromField].value("config", nlohmann::json());
  }
  FULCRUM_ASSIGN_OR_RETURN(
      const HfModelConfig m,
      HfConfigFromFulcrum(config["model"], feed_forward, options.num_experts_per_tok,
                          imported_config));
  const std::vector<Mapping> mappings = BuildMappings(m, HfNaming());

  std::set<std::string> used;
  at::ScalarType dtype = at::kFloat;
  // Tensors by whole name: stored whole or as pieces (NOTE [sharded checkpoints]).
  std::map<std::string, uint64_t> bytes_of;
  for (const Mapping& map : mappings) {
    const auto described = reader.Describe(map.fulcrum);
    if (!described.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          reader.dir(), " has no tensor ", map.fulcrum, ", which its config.model says a ",
          HfArchitectureName(m.architecture), " of this shape has"));
    }
    const auto& [tensor_dtype, shape] = *described;
    if (shape != map.fulcrum_shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", map.fulcrum, " in ", reader.dir(), " has shape ",
                       ShapeText(shape), " but its config.model gives ",
                       ShapeText(map.fulcrum_shape)));
    }
    if (!IsFloating(tensor_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", map.fulcrum, " has dtype ",
                                                     c10::toString(tensor_dtype)));
    }
    if (map.fulcrum == "embedding.word_embeddings.weight") dtype = tensor_dtype;
    used.insert(map.fulcrum);
    int64_t numel = 1;
    for (const int64_t d : shape) numel *= d;
    bytes_of[map.fulcrum] = static_cast<uint64_t>(numel) * c10::elementSize(tensor_dtype);
  }
  std::vector<std::string> unexpected;
  for (const std::string& name : reader.names()) {
    if (used.count(name) || absl::StartsWith(name, "optimizer.") || absl::StartsWith(name, "rng.")) {
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        reader.dir(), " holds model state that ", HfArchitectureName(m.architecture),
        " has no place for: ", ListSome(unexpected)));
  }
  FULCRUM_RETURN_IF_ERROR(CheckOutputDir(fs, out));

  // Output files: mappings in order, a new file when the next tensor would overflow one.
  std::vector<std::vector<size_t>> files(1);
  uint64_t file_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < mappings.size(); ++i) {
    const uint64_t bytes = bytes_of.at(mappings[i].fulcrum);
    if (options.max_shard_bytes > 0 && !files.back().empty() &&
        file_bytes + bytes > options.max_shard_bytes) {
      files.emplace_back();
      file_bytes = 0;
    }
    files.back().push_back(i);
    file_bytes += bytes;
    total_bytes += bytes;
  }

  FULCRUM_ASSIGN_OR_RETURN(const std::string staging, MakeStagingDir(fs, out, "export"));
  HfExportResult result;
  result.model = m;
  absl::Status status = [&]() -> absl::Status {
    result.files.push_back("config.json");
    FULCRUM_RETURN_IF_ERROR(WriteStringToFile(fs, JoinPath(staging, "config.json"),
                                              HfConfigJson(m, TorchDtypeName(dtype)).dump(2) + "\n"));
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t k = 0; k < files.size(); ++k) {
      const std::string file_name =
          files.size() == 1 ? "model.safetensors"
                            : absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, files.size());
      std::vector<std::pair<std::string, at::Tensor>> out_tensors;
      for (const size_t i : files[k]) {
        const Mapping& map = mappings[i];
        FULCRUM_ASSIGN_OR_RETURN(const at::Tensor t, reader.Read(map.fulcrum));
        std::vector<at::Tensor> hf = FromFulcrum(map, m, t);
        for (size_t j = 0; j < hf.size(); ++j) {
          out_tensors.emplace_back(map.hf[j], std::move(hf[j]));
          weight_map[map.hf[j]] = file_name;
        }
      }
      result.tensors += static_cast<int64_t>(out_tensors.size());
      FULCRUM_RETURN_IF_ERROR(WriteSafetensors(fs, JoinPath(staging, file_name), out_tensors,
                                               {{"format", "pt"}}));
      result.files.push_back(file_name);
    }
    if (files.size() > 1) {
      const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                                    {"weight_map", weight_map}};
      FULCRUM_RETURN_IF_ERROR(WriteStringToFile(
          fs, JoinPath(staging, "model.safetensors.index.json"), index.dump(2) + "\n"));
      result.files.push_back("model.safetensors.index.json");
    }
    return fs->SyncDir(staging);
  }();
  if (status.ok()) status = MoveIntoPlace(fs, staging, out);
  if (!status.ok()) {
    (void)fs->DeleteRecursively(staging);
    return status;
  }
  return result;
}

}  // namespace fulcrum::ckpt
