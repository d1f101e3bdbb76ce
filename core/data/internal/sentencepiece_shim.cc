// The sentencepiece shim: the only code that links libsentencepiece, built as the loadable
// module libfulcrum_sentencepiece.so and opened by core/data/tokenizer.cc. See
// NOTE [sentencepiece isolation] in sentencepiece_api.h. Compiled without the project's
// precompiled header (no LibTorch, no abseil) and with hidden visibility: it exports one
// symbol, FulcrumSentencePieceApiV1. It runs in a link-map namespace of its own, so it must
// not call back into Fulcrum except through the sinks it is handed.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/data/internal/sentencepiece_api.h"

namespace {

namespace spm = ::sentencepiece;

// The message behind the last error of this thread (see FulcrumSentencePieceApi).
thread_local std::string last_error;

int Report(const spm::util::Status& status, const char** error) {
  if (status.ok()) return 0;
  last_error = status.ToString();
  *error = last_error.c_str();
  return static_cast<int>(status.code());
}

// Feeds the non-empty lines of a list of files to the trainer. Reading the files here
// (instead of the trainer's comma-separated --input) keeps paths with commas working and
// lets an error name the file.
class FileLineIterator final : public spm::SentenceIterator {
 public:
  explicit FileLineIterator(std::vector<std::string> files) : files_(std::move(files)) { Next(); }

  bool done() const override { return done_; }
  const std::string& value() const override { return line_; }
  spm::util::Status status() const override { return status_; }

  void Next() override {
    while (!done_) {
      if (stream_.is_open()) {
        if (std::getline(stream_, line_)) {
          if (!line_.empty()) return;
          continue;
        }
        if (stream_.bad()) return Fail("error reading " + files_[next_file_ - 1]);
        stream_.close();
      }
      if (next_file_ == files_.size()) {
        done_ = true;
        return;
      }
      stream_.open(files_[next_file_++], std::ios::binary);
      if (!stream_.is_open()) return Fail("cannot open " + files_[next_file_ - 1]);
    }
  }

 private:
  void Fail(const std::string& message) {
    status_ = spm::util::Status(spm::util::StatusCode::kNotFound, message);
    done_ = true;
  }

  std::vector<std::string> files_;
  size_t next_file_ = 0;
  std::ifstream stream_;
  std::string line_;
  bool done_ = false;
  spm::util::Status status_;
};

// Runs `body` (returning a status code) and turns an exception into kInternal: unwinding
// must not leave the shim's link-map namespace.
template <typename Body>
int Guarded(const char** error, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    last_error = std::string("sentencepiece threw: ") + e.what();
  } catch (...) {
    last_error = "sentencepiece threw an unknown exception";
  }
  *error = last_error.c_str();
  return static_cast<int>(spm::util::StatusCode::kInternal);
}

int Train(const char* const* keys, const char* const* values, size_t num_args,
          const char* const* files, size_t num_files, const char** error) {
  return Guarded(error, [&] {
    std::unordered_map<std::string, std::string> args;
    for (size_t i = 0; i < num_args; ++i) args[keys[i]] = values[i];
    FileLineIterator lines(std::vector<std::string>(files, files + num_files));
    return Report(spm::SentencePieceTrainer::Train(args, &lines), error);
  });
}

int Load(const char* model_path, void** model, const char** error) {
  return Guarded(error, [&] {
    auto processor = std::make_unique<spm::SentencePieceProcessor>();
    const int code = Report(processor->Load(model_path), error);
    if (code == 0) *model = processor.release();
    return code;
  });
}

const spm::SentencePieceProcessor& Processor(const void* model) {
  return *static_cast<const spm::SentencePieceProcessor*>(model);
}

void FreeModel(void* model) { delete static_cast<spm::SentencePieceProcessor*>(model); }

int32_t PieceSize(const void* model) { return Processor(model).GetPieceSize(); }

int32_t EosId(const void* model) { return Processor(model).eos_id(); }

int Encode(const void* model, const char* text, size_t size, void* context, FulcrumSpmIdSink sink,
           const char** error) {
  static_assert(sizeof(int) == sizeof(int32_t), "sentencepiece ids are int");
  return Guarded(error, [&] {
    std::vector<int> ids;
    const int code = Report(Processor(model).Encode(std::string_view(text, size), &ids), error);
    if (code == 0) sink(context, reinterpret_cast<const int32_t*>(ids.data()), ids.size());
    return code;
  });
}

int Decode(const void* model, const int32_t* ids, size_t count, void* context,
           FulcrumSpmTextSink sink, const char** error) {
  return Guarded(error, [&] {
    const std::vector<int> id_vector(ids, ids + count);
    std::string text;
    const int code = Report(Processor(model).Decode(id_vector, &text), error);
    if (code == 0) sink(context, text.data(), text.size());
    return code;
  });
}

constexpr FulcrumSentencePieceApi kApi = {
    FULCRUM_SENTENCEPIECE_API_VERSION,
    &Train,
    &Load,
    &FreeModel,
    &PieceSize,
    &EosId,
    &Encode,
    &Decode,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const FulcrumSentencePieceApi*
FulcrumSentencePieceApiV1() {
  return &kApi;
}
