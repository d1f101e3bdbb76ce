// Timing that measures work, not launches, and the device allocator's memory figures.
//
// NOTE [device timer]
// On a GPU the host returns from a kernel launch long before the kernel ends, so wall
// clocks around a layer measure launches. DeviceTimer records an event on the device's
// current stream at Start and at Stop — no synchronisation — and Collect, called once per
// iteration, waits for the recorded events once and returns each key's total milliseconds.
// On the CPU the work is done when the call returns, so steady_clock is exact and the same
// interface holds. The executor keys intervals by action and layer ("F/3", "W/3", ...).
//
// Not thread-safe: one timer per thread (the executor's compute thread). The autograd
// engine may call it from its device thread while the compute thread is blocked in
// backward(): one user at a time, which is all it needs.
//
// Start, Stop and Collect are virtual so that a test can stand in a timer with known
// durations (the pipeline executor's per-layer times are checked that way); the cost is one
// indirect call per interval, nothing beside a kernel.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace c10 {
struct Event;
}  // namespace c10

namespace fulcrum::kernels {

class DeviceTimer {
 public:
  /// Times work on `device` (events on its current stream for an accelerator, the host
  /// clock for the CPU).
  explicit DeviceTimer(c10::Device device);
  virtual ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

  /// Opens an interval of `key`; a key may be opened again after it is stopped (its
  /// intervals add up). Throws if `key` is already open.
  virtual void Start(const std::string& key);
  /// Closes `key`'s open interval. Throws if `key` is not open.
  virtual void Stop(const std::string& key);
  /// Waits for the recorded work once, returns the milliseconds per key since the last
  /// Collect (summed over its intervals) and forgets them. Throws, naming the key, if an
  /// interval is still open.
  virtual std::map<std::string, double> Collect();

  /// True where the intervals are device events (work), false for the host clock.
  bool uses_device_events() const { return events_; }

 private:
  struct Interval;
  std::unique_ptr<c10::Event> TakeEvent();

  c10::Device device_;
  bool events_;
  std::vector<Interval> done_;
  std::map<std::string, Interval> open_;
  std::vector<std::unique_ptr<c10::Event>> spare_events_;  // reused across iterations
};

/// The caching allocator's figures for one device. On the CPU nothing is tracked: `tracked`
/// is false and the byte counts are -1, so a report cannot mistake them for real zeros.
struct DeviceMemory {
  bool tracked = false;
  int64_t allocated_bytes = -1;       ///< held by live tensors now
  int64_t reserved_bytes = -1;        ///< held by the allocator (live + cached) now
  int64_t peak_allocated_bytes = -1;  ///< since the process began or the last reset
  int64_t peak_reserved_bytes = -1;
  /// "allocated 1.50 GiB, reserved 2.00 GiB, peak 1.75 GiB", or "not tracked (cpu)".
  std::string ToString() const;
};

/// `device`'s memory from its caching allocator (c10's DeviceAllocator stats: the CUDA
/// caching allocator on a GPU); untracked for the CPU.
DeviceMemory DeviceMemoryStats(c10::Device device);

}  // namespace fulcrum::kernels
