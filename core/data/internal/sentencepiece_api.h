// The C interface between core/data/tokenizer.cc and the sentencepiece shim library
// (core/data/internal/sentencepiece_shim.cc, built as libfulcrum_sentencepiece.so).
//
// NOTE [sentencepiece isolation]
// Debian's libsentencepiece.so carries its own copy of protobuf-lite 3.14 and exports its
// symbols; LibTorch loads the system libprotobuf 3.21. In one symbol scope the two copies
// bind to each other's functions: libprotobuf's static initialisers crash at start-up, or
// sentencepiece aborts with "compiled against version 3.14.0 ... installed version
// (3.21.12)". dlopen(RTLD_DEEPBIND) is not enough either: sentencepiece then binds
// std::cerr to libstdc++'s own, never-constructed copy (executables copy-relocate it) and
// crashes on its first log line. So nothing Fulcrum links depends on sentencepiece. This
// shim does, and tokenizer.cc loads it on first use with dlmopen(LM_ID_NEWLM): a link-map
// namespace of its own, with its own libstdc++, libc state and protobuf. Hence the rules for
// this interface: plain C types only; memory is freed on the side that allocated it (output
// is copied out through sink callbacks); no exception crosses it.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

/// Bumped whenever the struct below changes; the loader refuses a shim of another version.
#define FULCRUM_SENTENCEPIECE_API_VERSION 1

/// Receives the whole output (token ids or text) of a call, once, before the call returns.
typedef void (*FulcrumSpmIdSink)(void* context, const int32_t* ids, size_t count);
typedef void (*FulcrumSpmTextSink)(void* context, const char* text, size_t size);

/// Every function returning int returns a sentencepiece/absl status code (0 = OK) and, on
/// error, points `*error` at a message valid until the calling thread's next shim call.
struct FulcrumSentencePieceApi {
  int version;
  /// Trains a model with trainer arguments `keys[i]=values[i]` on the non-empty lines of
  /// `files` (read by the shim; the trainer's own --input is not used).
  int (*train)(const char* const* keys, const char* const* values, size_t num_args,
               const char* const* files, size_t num_files, const char** error);
  /// Loads a .model file into `*model` (freed with free_model).
  int (*load)(const char* model_path, void** model, const char** error);
  void (*free_model)(void* model);
  int32_t (*piece_size)(const void* model);
  int32_t (*eos_id)(const void* model);
  int (*encode)(const void* model, const char* text, size_t size, void* context,
                FulcrumSpmIdSink sink, const char** error);
  int (*decode)(const void* model, const int32_t* ids, size_t count, void* context,
                FulcrumSpmTextSink sink, const char** error);
};

/// The shim's one exported symbol.
typedef const FulcrumSentencePieceApi* (*FulcrumSentencePieceApiFn)();
#define FULCRUM_SENTENCEPIECE_API_SYMBOL "FulcrumSentencePieceApiV1"

}  // extern "C"
