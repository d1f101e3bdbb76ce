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
//
// Placing intervals on a time axis: MarkOrigin records time zero (an event on the current
// stream, or the host clock on the CPU), and Collect can also return each interval's start
// and end in milliseconds since that mark (Span), read in the same one wait: an event's
// elapsed time from the origin event. On a GPU a span is when the stream reached the
// interval's start mark and when it finished the work queued before its stop mark, so
// while the host blocks (a receive) the stream idles inside the interval; the host clock
// alone cannot see when queued work ran. Zero is when the stream reached the origin mark:
// the host's time of the mark when the stream was idle then, later when work queued before
// it was still running. On the CPU the spans are steady_clock times since the mark.
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
  /// One interval on the time axis: milliseconds since the last MarkOrigin.
  struct Span {
    std::string key;
    double start_ms = 0;
    double end_ms = 0;
  };

  /// Time zero of the spans (see above); may be marked again (later spans count from the
  /// new mark). Call it with no interval open.
  virtual void MarkOrigin();
  /// Waits for the recorded work once, returns the milliseconds per key since the last
  /// Collect (summed over its intervals) and forgets them. Throws, naming the key, if an
  /// interval is still open. With `spans`, also replaces its contents with every interval
  /// collected, in the order they were stopped, as start and end since the origin (throws
  /// if MarkOrigin was never called).
  virtual std::map<std::string, double> Collect(std::vector<Span>* spans);
  std::map<std::string, double> Collect() { return Collect(nullptr); }

  /// True where the intervals are device events (work), false for the host clock.
  virtual bool uses_device_events() const { return events_; }

 private:
  struct Interval;
  std::unique_ptr<c10::Event> TakeEvent();

  c10::Device device_;
  bool events_;
  bool has_origin_ = false;
  std::unique_ptr<c10::Event> origin_event_;              // device events
  std::chrono::steady_clock::time_point origin_time_;     // host clock
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
