#include "core/kernels/device_timer.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <utility>

namespace fulcrum::kernels {

struct DeviceTimer::Interval {
  std::string key;
  std::unique_ptr<c10::Event> start_event;
  std::unique_ptr<c10::Event> stop_event;
  std::chrono::steady_clock::time_point start_time;
  std::chrono::steady_clock::time_point stop_time;
};

DeviceTimer::DeviceTimer(c10::Device device)
    : device_(device), events_(device.type() != c10::DeviceType::CPU) {}

DeviceTimer::~DeviceTimer() = default;

std::unique_ptr<c10::Event> DeviceTimer::TakeEvent() {
  if (spare_events_.empty()) {
    // BACKEND_DEFAULT: an event that records a timestamp (PyTorch's default one does not).
    return std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  }
  std::unique_ptr<c10::Event> event = std::move(spare_events_.back());
  spare_events_.pop_back();
  return event;
}

void DeviceTimer::Start(const std::string& key) {
  TORCH_CHECK(open_.count(key) == 0, "DeviceTimer: '", key, "' started twice without Stop");
  Interval interval;
  interval.key = key;
  if (events_) {
    interval.start_event = TakeEvent();
    const c10::impl::VirtualGuardImpl guard(device_.type());
    interval.start_event->record(guard.getStream(device_));
  } else {
    interval.start_time = std::chrono::steady_clock::now();
  }
  open_.emplace(key, std::move(interval));
}

void DeviceTimer::Stop(const std::string& key) {
  auto it = open_.find(key);
  TORCH_CHECK(it != open_.end(), "DeviceTimer: Stop('", key, "') without Start");
  Interval interval = std::move(it->second);
  open_.erase(it);
  if (events_) {
    interval.stop_event = TakeEvent();
    const c10::impl::VirtualGuardImpl guard(device_.type());
    interval.stop_event->record(guard.getStream(device_));
  } else {
    interval.stop_time = std::chrono::steady_clock::now();
  }
  done_.push_back(std::move(interval));
}

void DeviceTimer::MarkOrigin() {
  TORCH_CHECK(open_.empty(), "DeviceTimer: MarkOrigin with '", open_.begin()->first,
              "' still open (Stop it first)");
  if (events_) {
    if (!origin_event_) origin_event_ = TakeEvent();
    const c10::impl::VirtualGuardImpl guard(device_.type());
    origin_event_->record(guard.getStream(device_));
  } else {
    origin_time_ = std::chrono::steady_clock::now();
  }
  has_origin_ = true;
}

std::map<std::string, double> DeviceTimer::Collect(std::vector<Span>* spans) {
  TORCH_CHECK(open_.empty(), "DeviceTimer: Collect with '", open_.begin()->first,
              "' still open (Stop it first)");
  TORCH_CHECK(spans == nullptr || has_origin_,
              "DeviceTimer: Collect asked for spans but MarkOrigin was never called");
  if (spans != nullptr) spans->clear();
  std::map<std::string, double> ms;
  std::vector<Interval> intervals;
  intervals.swap(done_);
  auto host_ms = [](std::chrono::steady_clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  for (Interval& interval : intervals) {
    if (events_) {
      // The first wait covers the iteration when every interval was on one stream; the
      // rest return at once. (Intervals on other streams are waited for too, not misread.)
      // The origin was recorded before any of them, so it is done too.
      interval.stop_event->synchronize();
      ms[interval.key] += interval.start_event->elapsedTime(*interval.stop_event);
      if (spans != nullptr) {
        spans->push_back({interval.key, origin_event_->elapsedTime(*interval.start_event),
                          origin_event_->elapsedTime(*interval.stop_event)});
      }
      spare_events_.push_back(std::move(interval.start_event));
      spare_events_.push_back(std::move(interval.stop_event));
    } else {
      ms[interval.key] += host_ms(interval.stop_time - interval.start_time);
      if (spans != nullptr) {
        spans->push_back({interval.key, host_ms(interval.start_time - origin_time_),
                          host_ms(interval.stop_time - origin_time_)});
      }
    }
  }
  return ms;
}

std::string DeviceMemory::ToString() const {
  if (!tracked) return "not tracked (cpu)";
  auto gib = [](int64_t bytes) { return static_cast<double>(bytes) / (1ull << 30); };
  char text[160];
  std::snprintf(text, sizeof(text), "allocated %.2f GiB, reserved %.2f GiB, peak %.2f GiB",
                gib(allocated_bytes), gib(reserved_bytes), gib(peak_allocated_bytes));
  return text;
}

DeviceMemory DeviceMemoryStats(c10::Device device) {
  DeviceMemory memory;
  if (device.type() == c10::DeviceType::CPU) return memory;
  c10::DeviceAllocator* allocator = c10::getDeviceAllocator(device.type());
  const c10::DeviceIndex index =
      device.has_index() ? device.index()
                         : c10::impl::VirtualGuardImpl(device.type()).getDevice().index();
  const c10::CachingDeviceAllocator::DeviceStats stats = allocator->getDeviceStats(index);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  memory.tracked = true;
  memory.allocated_bytes = stats.allocated_bytes[kAll].current;
  memory.reserved_bytes = stats.reserved_bytes[kAll].current;
  memory.peak_allocated_bytes = stats.allocated_bytes[kAll].peak;
  memory.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
  return memory;
}

}  // namespace fulcrum::kernels
