// DeviceTimer and DeviceMemoryStats (NOTE [device timer]).
#include "core/kernels/device_timer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

namespace fulcrum::kernels {
namespace {

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(DeviceTimerTest, CpuMeasuresKnownWorkPerKeyAndSumsIntervals) {
  DeviceTimer timer(c10::Device(c10::kCPU));
  EXPECT_FALSE(timer.uses_device_events());
  timer.Start("F/0");
  SleepMs(30);
  timer.Stop("F/0");
  timer.Start("B/0");
  SleepMs(10);
  timer.Start("W/0");  // keys may overlap
  SleepMs(10);
  timer.Stop("W/0");
  timer.Stop("B/0");
  timer.Start("F/0");  // a second interval of the same key adds
  SleepMs(20);
  timer.Stop("F/0");
  const std::map<std::string, double> ms = timer.Collect();
  ASSERT_EQ(ms.size(), 3u);
  // Sleeps last at least what was asked; the upper bounds allow a loaded machine.
  EXPECT_GE(ms.at("F/0"), 50.0);
  EXPECT_LT(ms.at("F/0"), 50.0 + 200.0);
  EXPECT_GE(ms.at("B/0"), 20.0);
  EXPECT_GE(ms.at("W/0"), 10.0);
  EXPECT_LE(ms.at("W/0"), ms.at("B/0"));
  // Collect forgets what it returned.
  EXPECT_TRUE(timer.Collect().empty());
}

TEST(DeviceTimerTest, MisuseIsRefusedNamingTheKey) {
  DeviceTimer timer(c10::Device(c10::kCPU));
  try {
    timer.Stop("F/3");
    FAIL() << "Stop without Start accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("F/3"), std::string::npos) << e.what();
  }
  timer.Start("B/1");
  EXPECT_THROW(timer.Start("B/1"), c10::Error);
  try {
    timer.Collect();
    FAIL() << "Collect with an open interval accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("B/1"), std::string::npos) << e.what();
  }
  timer.Stop("B/1");
  EXPECT_EQ(timer.Collect().count("B/1"), 1u);
}

// The time axis (MarkOrigin, Collect's spans): every interval in stop order, each from its
// start to its end since the origin, in the order the clock saw them, and each span as long
// as what Collect returns for its key. No sleeps: only the order is asserted.
TEST(DeviceTimerTest, CpuSpansPlaceIntervalsSinceTheOrigin) {
  DeviceTimer timer(c10::Device(c10::kCPU));
  timer.MarkOrigin();
  timer.Start("A/0");
  timer.Stop("A/0");
  timer.Start("A/1");
  timer.Start("F/1/3");  // nested
  timer.Stop("F/1/3");
  timer.Stop("A/1");
  std::vector<DeviceTimer::Span> spans = {{"stale", 1, 2}};  // replaced, not appended to
  const std::map<std::string, double> ms = timer.Collect(&spans);
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].key, "A/0");
  EXPECT_EQ(spans[1].key, "F/1/3");
  EXPECT_EQ(spans[2].key, "A/1");
  EXPECT_GE(spans[0].start_ms, 0.0);
  EXPECT_GE(spans[0].end_ms, spans[0].start_ms);
  EXPECT_GE(spans[2].start_ms, spans[0].end_ms);   // A/1 after A/0
  EXPECT_GE(spans[1].start_ms, spans[2].start_ms);  // F inside A/1
  EXPECT_GE(spans[1].end_ms, spans[1].start_ms);
  EXPECT_GE(spans[2].end_ms, spans[1].end_ms);
  for (const DeviceTimer::Span& span : spans) {
    EXPECT_NEAR(span.end_ms - span.start_ms, ms.at(span.key), 1e-6) << span.key;
  }
  // Marked again: the next spans count from the new mark.
  timer.MarkOrigin();
  timer.Start("A/0");
  timer.Stop("A/0");
  timer.Collect(&spans);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_GE(spans[0].start_ms, 0.0);
  // Without spans Collect is what it was.
  timer.Start("B/0");
  timer.Stop("B/0");
  EXPECT_EQ(timer.Collect().count("B/0"), 1u);
}

TEST(DeviceTimerTest, SpansNeedAnOriginAndTheOriginNoOpenInterval) {
  DeviceTimer timer(c10::Device(c10::kCPU));
  timer.Start("F/0");
  timer.Stop("F/0");
  std::vector<DeviceTimer::Span> spans;
  try {
    timer.Collect(&spans);
    FAIL() << "spans without an origin accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MarkOrigin"), std::string::npos) << e.what();
  }
  timer.Start("B/2");
  try {
    timer.MarkOrigin();
    FAIL() << "origin marked inside an open interval";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("B/2"), std::string::npos) << e.what();
  }
}

TEST(DeviceTimerTest, CpuMemoryIsNotTrackedRatherThanZero) {
  const DeviceMemory memory = DeviceMemoryStats(c10::Device(c10::kCPU));
  EXPECT_FALSE(memory.tracked);
  EXPECT_EQ(memory.allocated_bytes, -1);
  EXPECT_EQ(memory.reserved_bytes, -1);
  EXPECT_EQ(memory.peak_allocated_bytes, -1);
  EXPECT_EQ(memory.ToString(), "not tracked (cpu)");
}

TEST(DeviceTimerCudaTest, EventsMeasureKernelsNotLaunches) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const c10::Device device(c10::kCUDA, 0);
  DeviceTimer timer(device);
  EXPECT_TRUE(timer.uses_device_events());
  const at::Tensor a = at::randn({4096, 4096}, at::TensorOptions().device(device));
  at::Tensor c = at::matmul(a, a);  // warm-up (cuBLAS handle, workspace)
  torch::cuda::synchronize();
  const auto host_start = std::chrono::steady_clock::now();
  timer.Start("matmul");
  for (int i = 0; i < 20; ++i) c = at::matmul(a, a);
  timer.Stop("matmul");
  const double launch_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
  const std::map<std::string, double> ms = timer.Collect();
  // 20 GEMMs of 2·4096³ flops ≈ 2.7 Tflop: milliseconds of work on any GPU, while the
  // launches return at once. The events see the work.
  EXPECT_GT(ms.at("matmul"), 0.5);
  EXPECT_GT(ms.at("matmul"), launch_ms) << "events measured launches, not work";
  const DeviceMemory memory = DeviceMemoryStats(device);
  EXPECT_TRUE(memory.tracked);
  EXPECT_GE(memory.allocated_bytes, 2 * 4096 * 4096 * 4);
  EXPECT_GE(memory.reserved_bytes, memory.allocated_bytes);
  EXPECT_GE(memory.peak_allocated_bytes, memory.allocated_bytes);
}

// On a GPU the spans are the stream's: an interval queued behind work starts when that
// work is done, later than the host reached it, and ends when its own work is done.
TEST(DeviceTimerCudaTest, SpansAreWhenTheStreamRanTheWork) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const c10::Device device(c10::kCUDA, 0);
  DeviceTimer timer(device);
  const at::Tensor a = at::randn({4096, 4096}, at::TensorOptions().device(device));
  at::Tensor c = at::matmul(a, a);  // warm-up
  torch::cuda::synchronize();
  timer.MarkOrigin();
  timer.Start("queued");
  for (int i = 0; i < 20; ++i) c = at::matmul(a, a);
  timer.Stop("queued");
  timer.Start("behind");
  for (int i = 0; i < 20; ++i) c = at::matmul(a, a);
  timer.Stop("behind");
  std::vector<DeviceTimer::Span> spans;
  const std::map<std::string, double> ms = timer.Collect(&spans);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_GE(spans[0].start_ms, 0.0);
  EXPECT_GE(spans[1].start_ms, spans[0].end_ms);
  // The second interval was launched at once but its work waited for the first's.
  EXPECT_GT(spans[1].start_ms, 0.5);
  for (const DeviceTimer::Span& span : spans) {
    EXPECT_NEAR(span.end_ms - span.start_ms, ms.at(span.key), 0.05) << span.key;
  }
}

}  // namespace
}  // namespace fulcrum::kernels
