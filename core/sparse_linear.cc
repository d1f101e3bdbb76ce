#include "core/sparse_linear.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "core/linear.h"

// The kernels are compiled for AVX-512, AVX2+FMA and baseline x86-64 and the best one is
// picked at load time (the project builds without -march).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FULCRUM_SPARSE_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FULCRUM_SPARSE_CLONES
#endif
#define FULCRUM_ALWAYS_INLINE inline __attribute__((always_inline))

namespace fulcrum {
namespace {

// NOTE [token tiles]: one tile of one feature.
constexpr int64_t kTileBytes = 256;
constexpr int64_t kVecBytes = 32;
constexpr int kVecsPerTile = static_cast<int>(kTileBytes / kVecBytes);
template <typename T>
constexpr int64_t kTile = kTileBytes / static_cast<int64_t>(sizeof(T));

template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(kVecBytes)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(kVecBytes)));
};

// Vectors pass by reference: by value they would change the baseline clone's ABI (GCC's
// -Wpsabi).
FULCRUM_ALWAYS_INLINE void Broadcast(float s, VecOf<float>::type& out) {
  out = VecOf<float>::type{s, s, s, s, s, s, s, s};
}

FULCRUM_ALWAYS_INLINE void Broadcast(double s, VecOf<double>::type& out) {
  out = VecOf<double>::type{s, s, s, s};
}

FULCRUM_ALWAYS_INLINE float Hsum(const VecOf<float>::type& x) {
  typedef int32_t I __attribute__((vector_size(kVecBytes)));
  VecOf<float>::type v = x;
  v += __builtin_shuffle(v, I{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, I{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, I{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

FULCRUM_ALWAYS_INLINE double Hsum(const VecOf<double>::type& x) {
  typedef int64_t I __attribute__((vector_size(kVecBytes)));
  VecOf<double>::type v = x;
  v += __builtin_shuffle(v, I{2, 3, 0, 1});
  v += __builtin_shuffle(v, I{1, 0, 3, 2});
  return v[0];
}

// ---- Kernels on tiled operands (NOTE [token tiles]). ----------------------------------------

// dst[r, :] = Σ_{k in row r} val[k] · src[idx[k], :] for rows [r0, r1) of one token tile:
// src is [src_rows, kTile], dst [dst_rows, kTile]. The row's tile accumulates in registers.
template <typename T>
FULCRUM_ALWAYS_INLINE void SpmmTile(const int64_t* ptr, const int32_t* idx, const T* val,
                                    const T* src, T* dst, int64_t r0, int64_t r1) {
  using V = typename VecOf<T>::type;
  for (int64_t r = r0; r < r1; ++r) {
    V acc[kVecsPerTile] = {};
    const int64_t end = ptr[r + 1];
    for (int64_t k = ptr[r]; k < end; ++k) {
      V w;
      Broadcast(val[k], w);
      const V* s = reinterpret_cast<const V*>(src + int64_t{idx[k]} * kTile<T>);
#pragma GCC unroll 8
      for (int i = 0; i < kVecsPerTile; ++i) acc[i] += w * s[i];
    }
    V* d = reinterpret_cast<V*>(dst + r * kTile<T>);
#pragma GCC unroll 8
    for (int i = 0; i < kVecsPerTile; ++i) d[i] = acc[i];
  }
}

// vals[k] += Σ_t g[r, t] · x[idx[k], t] for the nonzeros k of rows [r0, r1), one token tile:
// g is [g_rows, kTile], x [x_rows, kTile]. Row r's tile of g stays in registers.
template <typename T>
FULCRUM_ALWAYS_INLINE void SddmmTile(const int64_t* ptr, const int32_t* idx, const T* g,
                                     const T* x, T* vals, int64_t r0, int64_t r1) {
  using V = typename VecOf<T>::type;
  for (int64_t r = r0; r < r1; ++r) {
    const V* gr = reinterpret_cast<const V*>(g + r * kTile<T>);
    V gv[kVecsPerTile];
#pragma GCC unroll 8
    for (int i = 0; i < kVecsPerTile; ++i) gv[i] = gr[i];
    const int64_t end = ptr[r + 1];
    for (int64_t k = ptr[r]; k < end; ++k) {
      const V* s = reinterpret_cast<const V*>(x + int64_t{idx[k]} * kTile<T>);
      V a = gv[0] * s[0];
      V b = gv[1] * s[1];
#pragma GCC unroll 8
      for (int i = 2; i < kVecsPerTile; i += 2) {
        a += gv[i] * s[i];
        b += gv[i + 1] * s[i + 1];
      }
      vals[k] += Hsum(a + b);
    }
  }
}

// Rows [r0, r1) of the SpMM over all token tiles, tile by tile (the tile of src stays in
// L2): src is [tiles, src_rows, kTile], dst [tiles, dst_rows, kTile].
template <typename T>
FULCRUM_ALWAYS_INLINE void SpmmImpl(const int64_t* ptr, const int32_t* idx, const T* val,
                                    const T* src, int64_t src_rows, T* dst, int64_t dst_rows,
                                    int64_t tiles, int64_t r0, int64_t r1) {
  for (int64_t b = 0; b < tiles; ++b) {
    SpmmTile<T>(ptr, idx, val, src + b * src_rows * kTile<T>, dst + b * dst_rows * kTile<T>, r0,
                r1);
  }
}

// Rows [r0, r1) of the SDDMM: vals [nnz] = Σ over tiles, g [tiles, g_rows, kTile] and x
// [tiles, x_rows, kTile].
template <typename T>
FULCRUM_ALWAYS_INLINE void SddmmImpl(const int64_t* ptr, const int32_t* idx, const T* g,
                                     int64_t g_rows, const T* x, int64_t x_rows, T* vals,
                                     int64_t tiles, int64_t r0, int64_t r1) {
  std::fill(vals + ptr[r0], vals + ptr[r1], T{0});
  for (int64_t b = 0; b < tiles; ++b) {
    SddmmTile<T>(ptr, idx, g + b * g_rows * kTile<T>, x + b * x_rows * kTile<T>, vals, r0, r1);
  }
}

// In-register transpose of an L×L block (L = lanes of V): r[i] holds row i; afterwards
// r[j] holds column j.
FULCRUM_ALWAYS_INLINE void TransposeBlock(VecOf<float>::type (&r)[8]) {
  typedef int32_t I __attribute__((vector_size(kVecBytes)));
  using V = VecOf<float>::type;
  V t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], I{0, 8, 1, 9, 4, 12, 5, 13});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], I{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = __builtin_shuffle(t[i], t[i + 2], I{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 1] = __builtin_shuffle(t[i], t[i + 2], I{2, 3, 10, 11, 6, 7, 14, 15});
    u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], I{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], I{2, 3, 10, 11, 6, 7, 14, 15});
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = __builtin_shuffle(u[j], u[j + 4], I{0, 1, 2, 3, 8, 9, 10, 11});
    r[j + 4] = __builtin_shuffle(u[j], u[j + 4], I{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

FULCRUM_ALWAYS_INLINE void TransposeBlock(VecOf<double>::type (&r)[4]) {
  typedef int64_t I __attribute__((vector_size(kVecBytes)));
  using V = VecOf<double>::type;
  const V t0 = __builtin_shuffle(r[0], r[1], I{0, 4, 2, 6});
  const V t1 = __builtin_shuffle(r[0], r[1], I{1, 5, 3, 7});
  const V t2 = __builtin_shuffle(r[2], r[3], I{0, 4, 2, 6});
  const V t3 = __builtin_shuffle(r[2], r[3], I{1, 5, 3, 7});
  r[0] = __builtin_shuffle(t0, t2, I{0, 1, 4, 5});
  r[1] = __builtin_shuffle(t1, t3, I{0, 1, 4, 5});
  r[2] = __builtin_shuffle(t0, t2, I{2, 3, 6, 7});
  r[3] = __builtin_shuffle(t1, t3, I{2, 3, 6, 7});
}

template <typename T>
FULCRUM_ALWAYS_INLINE void LoadUnaligned(const T* p, typename VecOf<T>::type& out) {
  std::memcpy(&out, p, sizeof(out));
}

template <typename T>
FULCRUM_ALWAYS_INLINE void StoreUnaligned(T* p, const typename VecOf<T>::type& v) {
  std::memcpy(p, &v, sizeof(v));
}

// Features per block of the transposes: 1 KiB runs of each token row, a 64 KiB block of
// tiles.
constexpr int64_t kTransposeBlock = 256;

// dst[b, f, t'] = src[b·kTile + t', f] (zero past `tokens`) for tiles [b0, b1); src is
// [tokens, features] row-major. `zeros` holds `features` zeros (read for padding rows).
template <typename T>
FULCRUM_ALWAYS_INLINE void ToTilesImpl(const T* src, int64_t tokens, int64_t features,
                                       const T* zeros, T* dst, int64_t b0, int64_t b1) {
  using V = typename VecOf<T>::type;
  constexpr int kLanes = static_cast<int>(kVecBytes / sizeof(T));
  for (int64_t b = b0; b < b1; ++b) {
    T* d = dst + b * features * kTile<T>;
    for (int64_t f0 = 0; f0 < features; f0 += kTransposeBlock) {
      const int64_t f1 = std::min(features, f0 + kTransposeBlock);
      for (int64_t tb = 0; tb < kTile<T>; tb += kLanes) {
        const T* rows[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const int64_t t = b * kTile<T> + tb + i;
          rows[i] = t < tokens ? src + t * features : zeros;
        }
        int64_t f = f0;
        for (; f + kLanes <= f1; f += kLanes) {
          V r[kLanes];
          for (int i = 0; i < kLanes; ++i) LoadUnaligned(rows[i] + f, r[i]);
          TransposeBlock(r);
          for (int j = 0; j < kLanes; ++j) {
            *reinterpret_cast<V*>(d + (f + j) * kTile<T> + tb) = r[j];
          }
        }
        for (; f < f1; ++f) {
          for (int i = 0; i < kLanes; ++i) d[f * kTile<T> + tb + i] = rows[i][f];
        }
      }
    }
  }
}

// dst[b·kTile + t', f] = src[b, f, t'] (+ bias[f]) for tiles [b0, b1), tokens < `tokens`.
template <typename T>
FULCRUM_ALWAYS_INLINE void FromTilesImpl(const T* src, int64_t tokens, int64_t features,
                                         const T* bias, T* dst, int64_t b0, int64_t b1) {
  using V = typename VecOf<T>::type;
  constexpr int kLanes = static_cast<int>(kVecBytes / sizeof(T));
  for (int64_t b = b0; b < b1; ++b) {
    const T* s = src + b * features * kTile<T>;
    const int64_t valid = std::min(kTile<T>, tokens - b * kTile<T>);
    for (int64_t f0 = 0; f0 < features; f0 += kTransposeBlock) {
      const int64_t f1 = std::min(features, f0 + kTransposeBlock);
      for (int64_t tb = 0; tb < valid; tb += kLanes) {
        const int rows = static_cast<int>(std::min<int64_t>(kLanes, valid - tb));
        T* d = dst + (b * kTile<T> + tb) * features;
        int64_t f = f0;
        for (; f + kLanes <= f1; f += kLanes) {
          V r[kLanes];
          for (int j = 0; j < kLanes; ++j) {
            r[j] = *reinterpret_cast<const V*>(s + (f + j) * kTile<T> + tb);
          }
          TransposeBlock(r);
          V add = {};
          if (bias != nullptr) LoadUnaligned(bias + f, add);
          for (int i = 0; i < rows; ++i) StoreUnaligned(d + i * features + f, r[i] + add);
        }
        for (; f < f1; ++f) {
          const T add = bias != nullptr ? bias[f] : T{0};
          for (int i = 0; i < rows; ++i) d[i * features + f] = s[f * kTile<T> + tb + i] + add;
        }
      }
    }
  }
}

// The instantiations, each compiled for every target of FULCRUM_SPARSE_CLONES.
#define FULCRUM_SPARSE_INSTANTIATE(T, suffix)                                                 \
  FULCRUM_SPARSE_CLONES void Spmm##suffix(const int64_t* ptr, const int32_t* idx,          \
                                          const T* val, const T* src, int64_t src_rows,    \
                                          T* dst, int64_t dst_rows, int64_t tiles,         \
                                          int64_t r0, int64_t r1) {                        \
    SpmmImpl<T>(ptr, idx, val, src, src_rows, dst, dst_rows, tiles, r0, r1);               \
  }                                                                                        \
  FULCRUM_SPARSE_CLONES void Sddmm##suffix(const int64_t* ptr, const int32_t* idx,         \
                                           const T* g, int64_t g_rows, const T* x,         \
                                           int64_t x_rows, T* vals, int64_t tiles,         \
                                           int64_t r0, int64_t r1) {                       \
    SddmmImpl<T>(ptr, idx, g, g_rows, x, x_rows, vals, tiles, r0, r1);                     \
  }                                                                                        \
  FULCRUM_SPARSE_CLONES void ToTiles##suffix(const T* src, int64_t tokens, int64_t features, \
                                             const T* zeros, T* dst, int64_t b0, int64_t b1) { \
    ToTilesImpl<T>(src, tokens, features, zeros, dst, b0, b1);                             \
  }                                                                                        \
  FULCRUM_SPARSE_CLONES void FromTiles##suffix(const T* src, int64_t tokens,               \
                                               int64_t features, const T* bias, T* dst,    \
                                               int64_t b0, int64_t b1) {                   \
    FromTilesImpl<T>(src, tokens, features, bias, dst, b0, b1);                            \
  }
FULCRUM_SPARSE_INSTANTIATE(float, F32)
FULCRUM_SPARSE_INSTANTIATE(double, F64)
#undef FULCRUM_SPARSE_INSTANTIATE

// Overloads that pick the instantiation by element type.
void Spmm(const int64_t* p, const int32_t* i, const float* v, const float* s, int64_t sr,
          float* d, int64_t dr, int64_t n, int64_t r0, int64_t r1) {
  SpmmF32(p, i, v, s, sr, d, dr, n, r0, r1);
}
void Spmm(const int64_t* p, const int32_t* i, const double* v, const double* s, int64_t sr,
          double* d, int64_t dr, int64_t n, int64_t r0, int64_t r1) {
  SpmmF64(p, i, v, s, sr, d, dr, n, r0, r1);
}
void Sddmm(const int64_t* p, const int32_t* i, const float* g, int64_t gr, const float* x,
           int64_t xr, float* v, int64_t n, int64_t r0, int64_t r1) {
  SddmmF32(p, i, g, gr, x, xr, v, n, r0, r1);
}
void Sddmm(const int64_t* p, const int32_t* i, const double* g, int64_t gr, const double* x,
           int64_t xr, double* v, int64_t n, int64_t r0, int64_t r1) {
  SddmmF64(p, i, g, gr, x, xr, v, n, r0, r1);
}
void ToTiles(const float* s, int64_t t, int64_t f, const float* z, float* d, int64_t b0,
             int64_t b1) {
  ToTilesF32(s, t, f, z, d, b0, b1);
}
void ToTiles(const double* s, int64_t t, int64_t f, const double* z, double* d, int64_t b0,
             int64_t b1) {
  ToTilesF64(s, t, f, z, d, b0, b1);
}
void FromTiles(const float* s, int64_t t, int64_t f, const float* bias, float* d, int64_t b0,
               int64_t b1) {
  FromTilesF32(s, t, f, bias, d, b0, b1);
}
void FromTiles(const double* s, int64_t t, int64_t f, const double* bias, double* d,
               int64_t b0, int64_t b1) {
  FromTilesF64(s, t, f, bias, d, b0, b1);
}

// ---- Threads (NOTE [sparse threads]). --------------------------------------------------------

// Chunks taken from a shared counter by every thread that runs Work, so a thread that starts
// late, or is descheduled, leaves the remaining chunks to the others.
struct ChunkQueue {
  ChunkQueue(int64_t n, const std::function<void(int64_t)>* f) : chunks(n), fn(f) {}
  const int64_t chunks;
  const std::function<void(int64_t)>* fn;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;

  void Work() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      try {
        (*fn)(c);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// Worker threads for ParallelChunks that sleep between jobs (NOTE [sparse threads]). Created
// on first use, as many as the largest at::get_num_threads() − 1 seen; never destroyed (the
// process may exit while they wait).
class WorkerPool {
 public:
  static WorkerPool& Get() {
    static WorkerPool* pool = new WorkerPool();
    return *pool;
  }

  // Lets `helpers` workers join `queue` (each runs queue->Work() once).
  void Join(const std::shared_ptr<ChunkQueue>& queue, int64_t helpers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int64_t>(workers_.size()) < helpers) {
        workers_.emplace_back([this] { Loop(); });
        workers_.back().detach();
      }
      for (int64_t i = 0; i < helpers; ++i) jobs_.push_back(queue);
    }
    if (helpers == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

 private:
  void Loop() {
    for (;;) {
      std::shared_ptr<ChunkQueue> queue;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !jobs_.empty(); });
        queue = std::move(jobs_.front());
        jobs_.pop_front();
      }
      queue->Work();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<ChunkQueue>> jobs_;
  std::vector<std::thread> workers_;
};

// Runs fn(c) for every chunk c in [0, chunks) on the calling thread and up to
// at::get_num_threads() − 1 pool workers, and rethrows the first exception. The caller
// waits only for chunks a worker has started; a worker that comes late finds none left and
// never touches `fn`.
void ParallelChunks(int64_t chunks, const std::function<void(int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  auto queue = std::make_shared<ChunkQueue>(chunks, &fn);
  WorkerPool::Get().Join(queue, threads - 1);
  queue->Work();
  std::unique_lock<std::mutex> lock(queue->mu);
  queue->cv.wait(lock, [&] { return queue->done.load() == queue->chunks; });
  if (queue->error) std::rethrow_exception(queue->error);
}

// Chunk boundaries over the rows of a CSR/CSC structure with about equal work each (a
// nonzero, plus one per row for its store): 16 per thread of at least 8 rows each, so that
// a thread descheduled by other load holds back little.
std::vector<int64_t> RowChunks(const std::vector<int64_t>& ptr) {
  const int64_t rows = static_cast<int64_t>(ptr.size()) - 1;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min(rows / 8, threads > 1 ? 16 * threads : 1));
  const int64_t total = ptr[rows] + rows;
  std::vector<int64_t> bounds{0};
  int64_t r = 0;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t target = total * c / chunks;
    while (r < rows && ptr[r] + r < target) ++r;
    if (r > bounds.back()) bounds.push_back(r);
  }
  if (rows > bounds.back()) bounds.push_back(rows);
  return bounds;
}

int64_t NumTiles(int64_t tokens, at::ScalarType dtype) {
  const int64_t tile = kTileBytes / static_cast<int64_t>(c10::elementSize(dtype));
  return (tokens + tile - 1) / tile;
}

// NOTE [sparse scratch]
// A fresh tensor of megabytes is page-faulted on first touch (about 2.6 µs per 4 KiB page
// on the development VM: 5 ms for the 8 MiB tiles of a 2048-wide operand, more than the
// 90%-sparse product itself), and glibc gives such blocks back to the system when they are
// freed. The tiled operands therefore come from a small per-thread cache of buffers, each
// reused once nothing else refers to its storage (the autograd context and the deferred
// weight-gradient closure hold theirs until the W pass). At most kMaxEntries buffers per
// thread stay allocated when idle.
at::Tensor ScratchEmpty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr int64_t kMinBytes = int64_t{256} << 10;
  constexpr size_t kMaxEntries = 8;
  thread_local std::vector<at::Tensor> cache;  // Flat; idle when its storage has one user.
  const int64_t numel = c10::multiply_integers(sizes);
  if (numel * static_cast<int64_t>(options.dtype().itemsize()) < kMinBytes) {
    return at::empty(sizes, options);
  }
  at::Tensor* best = nullptr;
  for (at::Tensor& entry : cache) {
    if (entry.storage().use_count() != 1 || entry.dtype() != options.dtype() ||
        entry.numel() < numel || entry.numel() > 2 * numel) {
      continue;
    }
    if (best == nullptr || entry.numel() < best->numel()) best = &entry;
  }
  if (best != nullptr) return best->narrow(0, 0, numel).view(sizes);
  at::Tensor fresh = at::empty({numel}, options);
  if (cache.size() < kMaxEntries) {
    cache.push_back(fresh);
  } else {
    for (at::Tensor& entry : cache) {
      if (entry.storage().use_count() == 1) {
        entry = fresh;
        break;
      }
    }
  }
  return fresh.view(sizes);
}

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

void CheckFloating(at::ScalarType dtype, const char* what) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "sparse linear: ", what,
              " must be float or double, got ", dtype);
}

// [tokens, features] contiguous → [tiles, features, kTile].
at::Tensor Tile(const at::Tensor& m) {
  const int64_t tokens = m.size(0);
  const int64_t features = m.size(1);
  const int64_t tiles = NumTiles(tokens, m.scalar_type());
  const int64_t tile = kTileBytes / static_cast<int64_t>(m.element_size());
  at::Tensor out = ScratchEmpty({tiles, features, tile}, m.options());
  AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "sparse_linear_tile", [&] {
    const scalar_t* src = m.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    // Padding rows of the last tile read zeros.
    std::vector<scalar_t> zeros(tokens % tile == 0 ? 0 : features, scalar_t{0});
    ParallelChunks(tiles,
                   [&](int64_t b) { ToTiles(src, tokens, features, zeros.data(), dst, b, b + 1); });
  });
  return out;
}

// [tiles, features, kTile] → [tokens, features] (+ bias [features]).
at::Tensor Untile(const at::Tensor& tiled, int64_t tokens, const at::Tensor& bias) {
  const int64_t tiles = tiled.size(0);
  const int64_t features = tiled.size(1);
  at::Tensor out = at::empty({tokens, features}, tiled.options());
  at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  AT_DISPATCH_FLOATING_TYPES(tiled.scalar_type(), "sparse_linear_untile", [&] {
    const scalar_t* src = tiled.data_ptr<scalar_t>();
    const scalar_t* bias_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* dst = out.data_ptr<scalar_t>();
    ParallelChunks(tiles,
                   [&](int64_t t) { FromTiles(src, tokens, features, bias_data, dst, t, t + 1); });
  });
  return out;
}

// out [tiles, rows, kTile] = structure (ptr, idx, vals) × tiled src [tiles, cols, kTile].
at::Tensor SpmmTiled(const std::vector<int64_t>& ptr, const std::vector<int32_t>& idx,
                     const at::Tensor& vals, const at::Tensor& src) {
  const int64_t rows = static_cast<int64_t>(ptr.size()) - 1;
  const int64_t tiles = src.size(0);
  at::Tensor out = ScratchEmpty({tiles, rows, src.size(2)}, src.options());
  const std::vector<int64_t> bounds = RowChunks(ptr);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "sparse_linear_spmm", [&] {
    const scalar_t* v = vals.data_ptr<scalar_t>();
    const scalar_t* s = src.data_ptr<scalar_t>();
    scalar_t* d = out.data_ptr<scalar_t>();
    ParallelChunks(static_cast<int64_t>(bounds.size()) - 1, [&](int64_t c) {
      Spmm(ptr.data(), idx.data(), v, s, src.size(1), d, rows, tiles, bounds[c], bounds[c + 1]);
    });
  });
  return out;
}

// [nnz] CSR order: Σ over tokens of tiled g [tiles, out, kTile] · tiled x [tiles, in, kTile].
at::Tensor SddmmTiled(const SparseWeight& w, const at::Tensor& g, const at::Tensor& x) {
  at::Tensor vals = ScratchEmpty({w.nnz()}, g.options());
  const std::vector<int64_t>& ptr = w.csr_row_ptr();
  const std::vector<int64_t> bounds = RowChunks(ptr);
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "sparse_linear_sddmm", [&] {
    const scalar_t* gd = g.data_ptr<scalar_t>();
    const scalar_t* xd = x.data_ptr<scalar_t>();
    scalar_t* v = vals.data_ptr<scalar_t>();
    ParallelChunks(static_cast<int64_t>(bounds.size()) - 1, [&](int64_t c) {
      Sddmm(ptr.data(), w.csr_col().data(), gd, w.rows(), xd, w.cols(), v, g.size(0),
            bounds[c], bounds[c + 1]);
    });
  });
  return vals;
}

// `t` [..., features] as a contiguous [tokens, features] matrix of dtype `dtype`.
at::Tensor Flatten2d(const at::Tensor& t, int64_t features, at::ScalarType dtype,
                     const char* what) {
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == features, "sparse linear: ", what,
              " must be [..., ", features, "], got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu(), "sparse linear: ", what, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, "sparse linear: ", what, " has dtype ", t.scalar_type(),
              ", the sparse weight ", dtype);
  return t.reshape({-1, features}).contiguous();
}

std::vector<int64_t> WithLast(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out = sizes.vec();
  out.back() = last;
  return out;
}

// ---- Autograd. ---------------------------------------------------------------------------

constexpr const char* kTagKey = "weight_grad_tag";

// Holds the SparseWeight in the autograd context (saved_data takes IValues).
struct SparseWeightHolder : torch::CustomClassHolder {
  explicit SparseWeightHolder(std::shared_ptr<const SparseWeight> w) : weight(std::move(w)) {}
  std::shared_ptr<const SparseWeight> weight;
};

// Accumulates the masked weight gradient into weight.grad() as autograd's AccumulateGrad
// would: a fresh dense tensor when there is none, else an O(nnz) add at the nonzeros (the
// fused path adds a dense tensor that is zero elsewhere: the same values).
void AccumulateMasked(const at::Tensor& weight, const SparseWeight& w, const at::Tensor& vals) {
  at::Tensor& slot = const_cast<at::Tensor&>(weight).mutable_grad();
  if (slot.defined()) {
    w.AccumulateInto(slot, vals);
  } else {
    slot = w.ScatterToDense(vals);
  }
}

class SparseLinearFunction : public torch::autograd::Function<SparseLinearFunction> {
 public:
  // The bias is an input only when defined (autograd's input metadata needs defined
  // tensors); the backward returns one gradient per input either way.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            std::shared_ptr<const SparseWeight> w) {
    return Forward(ctx, x, weight, bias, std::move(w));
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, std::shared_ptr<const SparseWeight> w) {
    return Forward(ctx, x, weight, at::Tensor(), std::move(w));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[0];
    const at::Tensor x_tiles = saved[1];  // Undefined for a frozen weight.
    const std::shared_ptr<const SparseWeight> w =
        c10::static_intrusive_pointer_cast<SparseWeightHolder>(ctx->saved_data["w"].toCapsule())
            ->weight;
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const at::Tensor grad_out = Flatten2d(grads[0], w->rows(), w->dtype(), "grad_output");
    const int64_t tokens = grad_out.size(0);

    const bool need_weight_grad = x_tiles.defined();
    const bool need_input_grad = ctx->needs_input_grad(0);
    at::Tensor g_tiles;
    if (need_input_grad || need_weight_grad) g_tiles = Tile(grad_out);

    at::Tensor grad_input;
    if (need_input_grad) {
      grad_input = Untile(SpmmTiled(w->csc_col_ptr(), w->csc_row(), w->csc_values(), g_tiles),
                          tokens, at::Tensor())
                       .view(x_sizes);
    }
    at::Tensor grad_bias;
    if (has_bias && ctx->needs_input_grad(2)) grad_bias = grad_out.sum(0);

    at::Tensor grad_weight;
    if (!need_weight_grad) {
      // Frozen: no weight-gradient work now or deferred.
    } else if (WeightGradStore* store = WeightGradStore::Active()) {
      // Deferred (core/linear.h NOTE [B/W split]); autograd receives no weight gradient.
      const int64_t bytes = Bytes(g_tiles) + Bytes(x_tiles);
      store->Push(
          [weight, w, g_tiles, x_tiles]() {
            AccumulateMasked(weight, *w, SddmmTiled(*w, g_tiles, x_tiles));
          },
          ctx->saved_data[kTagKey].toInt(), bytes);
    } else {
      grad_weight = w->ScatterToDense(SddmmTiled(*w, g_tiles, x_tiles));
    }
    if (has_bias) return {grad_input, grad_weight, grad_bias, at::Tensor()};
    return {grad_input, grad_weight, at::Tensor()};
  }

 private:
  static at::Tensor Forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            std::shared_ptr<const SparseWeight> w) {
    TORCH_CHECK(w != nullptr, "SparseLinearForward: no sparse weight");
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == w->rows() && weight.size(1) == w->cols(),
                "SparseLinearForward: weight ", weight.sizes(), " does not match the sparse "
                "weight [", w->rows(), ", ", w->cols(), "]");
    if (bias.defined()) {
      TORCH_CHECK(bias.dim() == 1 && bias.size(0) == w->rows(), "SparseLinearForward: bias ",
                  bias.sizes(), " must be [", w->rows(), "]");
      TORCH_CHECK(bias.scalar_type() == w->dtype(), "SparseLinearForward: bias dtype ",
                  bias.scalar_type(), " differs from the weight's ", w->dtype());
    }
    const at::Tensor x2 = Flatten2d(x, w->cols(), w->dtype(), "input");
    const at::Tensor x_tiles = Tile(x2);
    const at::Tensor y_tiles = SpmmTiled(w->csr_row_ptr(), w->csr_col(), w->csr_values(), x_tiles);
    at::Tensor y = Untile(y_tiles, x2.size(0), bias).view(WithLast(x.sizes(), w->rows()));

    // The tiled x replaces x for the weight gradient (NOTE [token tiles]).
    ctx->save_for_backward({weight, weight.requires_grad() ? x_tiles : at::Tensor()});
    ctx->saved_data["w"] = c10::IValue::make_capsule(c10::make_intrusive<SparseWeightHolder>(w));
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_bias"] = bias.defined();
    // NOTE [weight-gradient tags]: the tag of the layer whose forward this is.
    ctx->saved_data[kTagKey] = WeightGradStore::CurrentTag();
    return y;
  }
};

}  // namespace

// ---- SparseWeight. -------------------------------------------------------------------------

SparseWeight::SparseWeight(const at::Tensor& weight, const at::Tensor& mask) {
  TORCH_CHECK(weight.dim() == 2, "SparseWeight: weight must be [out, in], got ", weight.sizes());
  TORCH_CHECK(weight.device().is_cpu(), "SparseWeight: weight must be on the CPU");
  CheckFloating(weight.scalar_type(), "the weight");
  TORCH_CHECK(mask.sizes() == weight.sizes(), "SparseWeight: mask ", mask.sizes(),
              " must have the weight's shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) <= std::numeric_limits<int32_t>::max() &&
                  weight.size(0) <= std::numeric_limits<int32_t>::max(),
              "SparseWeight: ", weight.sizes(), " is too large for 32-bit indices");
  rows_ = weight.size(0);
  cols_ = weight.size(1);
  const at::Tensor kept = mask.to(at::kCPU).ne(0).contiguous();
  const bool* m = kept.data_ptr<bool>();

  csr_row_ptr_.assign(rows_ + 1, 0);
  csc_col_ptr_.assign(cols_ + 1, 0);
  for (int64_t o = 0; o < rows_; ++o) {
    for (int64_t j = 0; j < cols_; ++j) {
      if (!m[o * cols_ + j]) continue;
      csr_col_.push_back(static_cast<int32_t>(j));
      csr_flat_.push_back(o * cols_ + j);
      ++csc_col_ptr_[j + 1];
    }
    csr_row_ptr_[o + 1] = static_cast<int64_t>(csr_col_.size());
  }
  for (int64_t j = 0; j < cols_; ++j) csc_col_ptr_[j + 1] += csc_col_ptr_[j];
  // Rows ascending within each column: visit the CSR nonzeros in row order.
  csc_row_.resize(csr_col_.size());
  csc_to_csr_.resize(csr_col_.size());
  std::vector<int64_t> fill(csc_col_ptr_.begin(), csc_col_ptr_.end() - 1);
  for (int64_t o = 0; o < rows_; ++o) {
    for (int64_t k = csr_row_ptr_[o]; k < csr_row_ptr_[o + 1]; ++k) {
      const int64_t p = fill[csr_col_[k]]++;
      csc_row_[p] = static_cast<int32_t>(o);
      csc_to_csr_[p] = k;
    }
  }
  RefreshValues(weight);
}

void SparseWeight::RefreshValues(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == rows_ && weight.size(1) == cols_,
              "SparseWeight::RefreshValues: weight ", weight.sizes(), " must be [", rows_, ", ",
              cols_, "]");
  TORCH_CHECK(!csr_values_.defined() || weight.scalar_type() == csr_values_.scalar_type(),
              "SparseWeight::RefreshValues: weight dtype ", weight.scalar_type(),
              " differs from the structure's ", csr_values_.scalar_type());
  CheckFloating(weight.scalar_type(), "the weight");
  const at::Tensor dense = weight.detach().to(at::kCPU).contiguous();
  const int64_t n = nnz();
  if (!csr_values_.defined()) {
    csr_values_ = at::empty({n}, dense.options());
    csc_values_ = at::empty({n}, dense.options());
  }
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "sparse_weight_refresh", [&] {
    const scalar_t* src = dense.data_ptr<scalar_t>();
    scalar_t* csr = csr_values_.data_ptr<scalar_t>();
    scalar_t* csc = csc_values_.data_ptr<scalar_t>();
    for (int64_t k = 0; k < n; ++k) csr[k] = src[csr_flat_[k]];
    for (int64_t p = 0; p < n; ++p) csc[p] = csr[csc_to_csr_[p]];
  });
}

double SparseWeight::density() const {
  const int64_t size = rows_ * cols_;
  return size == 0 ? 0.0 : static_cast<double>(nnz()) / static_cast<double>(size);
}

at::Tensor SparseWeight::ScatterToDense(const at::Tensor& csr_values) const {
  at::Tensor dense = at::zeros({rows_, cols_}, csr_values.options());
  AccumulateInto(dense, csr_values);
  return dense;
}

void SparseWeight::AccumulateInto(at::Tensor& dense, const at::Tensor& csr_values) const {
  TORCH_CHECK(dense.dim() == 2 && dense.size(0) == rows_ && dense.size(1) == cols_,
              "SparseWeight::AccumulateInto: dense ", dense.sizes(), " must be [", rows_, ", ",
              cols_, "]");
  TORCH_CHECK(csr_values.dim() == 1 && csr_values.size(0) == nnz(),
              "SparseWeight::AccumulateInto: values ", csr_values.sizes(), " must be [", nnz(),
              "]");
  TORCH_CHECK(dense.scalar_type() == csr_values.scalar_type(),
              "SparseWeight::AccumulateInto: dtypes differ: ", dense.scalar_type(), " and ",
              csr_values.scalar_type());
  if (!dense.is_contiguous()) {
    dense.add_(ScatterToDense(csr_values));
    return;
  }
  const at::Tensor vals = csr_values.contiguous();
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "sparse_weight_accumulate", [&] {
    scalar_t* d = dense.data_ptr<scalar_t>();
    const scalar_t* v = vals.data_ptr<scalar_t>();
    const int64_t n = nnz();
    for (int64_t k = 0; k < n; ++k) d[csr_flat_[k]] += v[k];
  });
}

// ---- Kernels without autograd. -------------------------------------------------------------

at::Tensor SparseLinearOutput(const at::Tensor& x, const SparseWeight& w, const at::Tensor& bias) {
  const at::Tensor x2 = Flatten2d(x, w.cols(), w.dtype(), "input");
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == w.rows() && bias.scalar_type() == w.dtype(),
                "SparseLinearOutput: bias ", bias.sizes(), " must be [", w.rows(), "] of ",
                w.dtype());
  }
  const at::Tensor y_tiles = SpmmTiled(w.csr_row_ptr(), w.csr_col(), w.csr_values(), Tile(x2));
  return Untile(y_tiles, x2.size(0), bias).view(WithLast(x.sizes(), w.rows()));
}

at::Tensor SparseLinearInputGrad(const at::Tensor& grad_y, const SparseWeight& w) {
  const at::Tensor g2 = Flatten2d(grad_y, w.rows(), w.dtype(), "grad_y");
  const at::Tensor x_tiles = SpmmTiled(w.csc_col_ptr(), w.csc_row(), w.csc_values(), Tile(g2));
  return Untile(x_tiles, g2.size(0), at::Tensor()).view(WithLast(grad_y.sizes(), w.cols()));
}

at::Tensor SparseLinearWeightGrad(const at::Tensor& grad_y, const at::Tensor& x,
                                  const SparseWeight& w) {
  const at::Tensor g2 = Flatten2d(grad_y, w.rows(), w.dtype(), "grad_y");
  const at::Tensor x2 = Flatten2d(x, w.cols(), w.dtype(), "input");
  TORCH_CHECK(g2.size(0) == x2.size(0), "SparseLinearWeightGrad: grad_y has ", g2.size(0),
              " tokens, x ", x2.size(0));
  return SddmmTiled(w, Tile(g2), Tile(x2));
}

at::Tensor SparseLinearForward(const at::Tensor& x, std::shared_ptr<const SparseWeight> w,
                               const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(w != nullptr, "SparseLinearForward: no sparse weight");
  // NOTE [sparse mixed precision]: the kernels have no bf16 path (they are CPU kernels over
  // 256-byte token tiles of fp32 or fp64), so bf16 or fp16 activations over an fp32 sparse
  // weight are widened on the way in and the output narrowed on the way out, through
  // autograd's own casts: the products run in fp32 — more precise than a bf16 GEMM, the
  // same result a bf16 GEMM accumulating in fp32 would round to — the input gradient comes
  // back in the activations' dtype and the masked weight gradient is fp32 (NOTE [mixed
  // precision] in core/linear.h).
  const at::ScalarType narrow = x.scalar_type();
  const bool widen = w->dtype() == at::kFloat && (narrow == at::kBFloat16 || narrow == at::kHalf);
  const at::Tensor input = widen ? x.to(at::kFloat) : x;
  at::Tensor y = bias.defined() ? SparseLinearFunction::apply(input, weight, bias, std::move(w))
                                : SparseLinearFunction::apply(input, weight, std::move(w));
  return widen ? y.to(narrow) : y;
}

bool SparseIsFaster(int64_t out, int64_t in, double density) {
  return out > 0 && in > 0 && density < kSparseCrossoverDensity;
}

}  // namespace fulcrum
