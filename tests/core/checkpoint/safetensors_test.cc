#include "core/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "core/checkpoint/checksum.h"
#include "tests/core/checkpoint/test_util.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::LittleEndian64;
using ::fulcrum::testing_util::ReadBytes;
using ::fulcrum::testing_util::ScopedTempDir;
using ::fulcrum::testing_util::TruncateTo;
using ::fulcrum::testing_util::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// True if `a` and `b` have the same dtype, shape and bytes (NaN-safe, unlike equal()).
bool BitIdentical(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

TEST(SafetensorsDtypeTest, NamesRoundTrip) {
  const std::vector<std::pair<at::ScalarType, std::string>> names = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},    {at::kBool, "BOOL"}};
  for (const auto& [dtype, name] : names) {
    EXPECT_EQ(*SafetensorsDtypeName(dtype), name);
    EXPECT_EQ(*ScalarTypeFromSafetensorsDtype(name), dtype);
    // The torch-free header parser (safetensors_header.h) has its own table of sizes.
    EXPECT_EQ(SafetensorsDtypeSize(name), c10::elementSize(dtype)) << name;
  }
  EXPECT_EQ(SafetensorsDtypeSize("F33"), 0u);
  EXPECT_FALSE(SafetensorsDtypeName(at::kComplexFloat).ok());
  EXPECT_THAT(std::string(ScalarTypeFromSafetensorsDtype("F33").status().message()),
              HasSubstr("F33"));
}

TEST(SafetensorsTest, RoundTripsEveryDtype) {
  ScopedTempDir dir;
  const at::Tensor values = torch::arange(-7, 8).reshape({3, 5});
  NamedTensors tensors;
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                     at::kInt, at::kShort, at::kChar}) {
    tensors.emplace_back(c10::toString(dtype), values.to(dtype));
  }
  tensors.emplace_back("Byte", (values + 7).to(at::kByte));
  tensors.emplace_back("Bool", values.gt(0));
  // Values that only round-trip if every bit is kept.
  tensors.emplace_back("bf16_odd", torch::tensor({1.0f / 3, -1e-30f, 3e38f}).to(at::kBFloat16));
  tensors.emplace_back("f32_specials",
                       torch::tensor({std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::infinity(), -0.0f}));

  const std::string path = dir.Join("all.safetensors");
  std::map<std::string, uint64_t> checksums;
  ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), path, tensors,
                               {{"format", "pt"}, {"note", "ünïcode ok"}}, &checksums)
                  .ok());
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "ünïcode ok"}}));
  EXPECT_EQ((*reader)->names().size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    SCOPED_TRACE(name);
    const SafetensorsTensorInfo* info = (*reader)->info(name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->dtype, expected.scalar_type());
    EXPECT_EQ(info->shape, expected.sizes().vec());
    // Data starts 8-aligned and is sorted by element size, so every tensor is aligned.
    EXPECT_EQ(info->begin % expected.element_size(), 0u);
    absl::StatusOr<at::Tensor> actual = (*reader)->Read(name);
    ASSERT_TRUE(actual.ok()) << actual.status();
    EXPECT_TRUE(BitIdentical(*actual, expected));
    EXPECT_EQ(checksums.at(name), Xxh3Checksum(*(*reader)->RawBytes(name)));
  }
}

TEST(SafetensorsTest, RoundTripsZeroDimEmptyAndNonContiguousTensors) {
  ScopedTempDir dir;
  const at::Tensor matrix = torch::arange(24, torch::kFloat).reshape({4, 6});
  const NamedTensors tensors = {
      {"scalar", torch::tensor(2.5, torch::kDouble).reshape({})},
      {"empty", torch::empty({0}, torch::kFloat)},
      {"empty_3d", torch::empty({2, 0, 3}, torch::kLong)},
      {"transposed", matrix.t()},
      {"strided", matrix.index({torch::indexing::Slice(), torch::indexing::Slice(0, 6, 2)})},
      {"expanded", torch::tensor({1, 2, 3}, torch::kInt).expand({2, 3})},
  };
  for (const auto& [name, tensor] : tensors) {
    if (name == "transposed" || name == "strided" || name == "expanded") {
      ASSERT_FALSE(tensor.is_contiguous()) << name;
    }
  }
  const std::string path = dir.Join("shapes.safetensors");
  ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), path, tensors, {}).ok());
  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->metadata().empty());
  for (const auto& [name, expected] : tensors) {
    SCOPED_TRACE(name);
    absl::StatusOr<at::Tensor> actual = (*reader)->Read(name);
    ASSERT_TRUE(actual.ok()) << actual.status();
    EXPECT_TRUE(actual->is_contiguous());
    EXPECT_TRUE(BitIdentical(*actual, expected));
  }
  EXPECT_EQ((*reader)->info("scalar")->shape, std::vector<int64_t>{});
  EXPECT_EQ((*reader)->info("scalar")->byte_size(), 8u);
  EXPECT_EQ((*reader)->info("empty_3d")->byte_size(), 0u);
  EXPECT_EQ((*reader)->Read("missing").status().code(), absl::StatusCode::kNotFound);
}

// The expected bytes below are laid out by hand from the format description: u64 LE header
// length, compact JSON, spaces up to a multiple of 8, then raw little-endian data. The first
// case is the same file as the reference implementation's own serialization test.
TEST(SafetensorsTest, MatchesHandLaidOutBytes) {
  ScopedTempDir dir;
  {
    const std::string path = dir.Join("golden1.safetensors");
    ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), path,
                                 {{"attn.0", torch::arange(6, torch::kFloat).reshape({1, 2, 3})}},
                                 {})
                    .ok());
    const std::string json = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(json.size(), 64u);  // Already a multiple of 8: no padding.
    const std::string data(
        "\x00\x00\x00\x00"
        "\x00\x00\x80\x3f"
        "\x00\x00\x00\x40"
        "\x00\x00\x40\x40"
        "\x00\x00\x80\x40"
        "\x00\x00\xa0\x40",
        24);
    EXPECT_EQ(ReadBytes(path), std::string("\x40\0\0\0\0\0\0\0", 8) + json + data);
  }
  {
    // Metadata first; tensors by descending element size (F64 before I8), not by name;
    // a 0-d tensor has shape []; the header is padded with 7 spaces to 144 bytes.
    const std::string path = dir.Join("golden2.safetensors");
    ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), path,
                                 {{"b", torch::tensor({1, -2, 3}, torch::kChar)},
                                  {"a", torch::tensor(1.5, torch::kDouble).reshape({})}},
                                 {{"format", "pt"}})
                    .ok());
    const std::string json = R"({"__metadata__":{"format":"pt"},)"
                             R"("a":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})"
                             "       ";
    ASSERT_EQ(json.size(), 144u);
    const std::string data(
        "\x00\x00\x00\x00\x00\x00\xf8\x3f"
        "\x01\xfe\x03",
        11);
    EXPECT_EQ(ReadBytes(path), std::string("\x90\0\0\0\0\0\0\0", 8) + json + data);
  }
  {
    const std::string path = dir.Join("golden_empty.safetensors");
    ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), path, {}, {}).ok());
    EXPECT_EQ(ReadBytes(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
    auto reader = SafetensorsReader::Open(path);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_TRUE((*reader)->names().empty());
  }
}

TEST(SafetensorsTest, WriterRejectsBadInputBeforeCreatingTheFile) {
  ScopedTempDir dir;
  const std::string path = dir.Join("bad.safetensors");
  const at::Tensor t = torch::zeros({2});
  EXPECT_THAT(
      std::string(WriteSafetensors(DefaultFileSystem(), path, {{"x", t}, {"x", t}}, {}).message()),
      AllOf(HasSubstr(path), HasSubstr("'x' appears twice")));
  EXPECT_FALSE(WriteSafetensors(DefaultFileSystem(), path, {{"__metadata__", t}}, {}).ok());
  EXPECT_FALSE(WriteSafetensors(DefaultFileSystem(), path, {{"", t}}, {}).ok());
  EXPECT_THAT(std::string(WriteSafetensors(DefaultFileSystem(), path,
                                           {{"c", torch::zeros({2}, torch::kComplexFloat)}}, {})
                              .message()),
              AllOf(HasSubstr("'c'"), HasSubstr("ComplexFloat")));
  EXPECT_FALSE(WriteSafetensors(DefaultFileSystem(), path, {{"u", at::Tensor()}}, {}).ok());
  EXPECT_FALSE(DefaultFileSystem()->FileExists(path));
}

// Builds a file from a header (padded here) and raw data, for the rejection tests.
std::string MakeFile(const std::string& header, const std::string& data) {
  std::string padded = header;
  padded.append((8 - padded.size() % 8) % 8, ' ');
  return LittleEndian64(padded.size()) + padded + data;
}

struct BadFileCase {
  std::string label;
  std::string bytes;
  std::string expected;  // Substring of the error besides the file name.
};

TEST(SafetensorsTest, ReaderRejectsMalformedFilesNamingFileAndTensor) {
  ScopedTempDir dir;
  const std::string f32x2 = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\x11');
  const std::vector<BadFileCase> cases = {
      {"tiny", "abc", "too short for the 8-byte header length"},
      {"huge_header_length", LittleEndian64(1ull << 62) + "{}", "more than the limit"},
      {"header_past_eof", LittleEndian64(64) + "{}      ", "only 8 bytes follow it"},
      {"not_json", MakeFile("{\"w\": [", ""), "not valid JSON"},
      {"not_object", MakeFile("[1, 2]", ""), "must be a JSON object"},
      {"unknown_dtype", MakeFile(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", eight),
       "tensor 'w': unknown dtype 'Q4'"},
      {"negative_shape",
       MakeFile(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "tensor 'w': shape [-2] must hold non-negative integers"},
      {"wrong_byte_count",
       MakeFile(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "tensor 'w': data_offsets [0,8] span 8 bytes but dtype F32 and shape [3] need 12"},
      {"out_of_range", MakeFile(f32x2, std::string(4, '\0')),
       "tensor 'w': data_offsets [0,8] reach past the data buffer, which holds only 4 bytes"},
      {"reversed_offsets",
       MakeFile(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", eight),
       "end before they begin"},
      {"overlap",
       MakeFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                std::string(12, '\0')),
       "tensor 'b' bytes [4, 12) overlap tensor 'a' bytes [0, 8)"},
      {"gap",
       MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                std::string(12, '\0')),
       "data bytes [4, 8) belong to no tensor (gap before tensor 'b')"},
      {"trailing", MakeFile(f32x2, eight + "xx"), "2 trailing bytes"},
      {"metadata_not_string",
       MakeFile(
           R"({"__metadata__":{"step":3},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
           eight),
       "'__metadata__' value for 'step' must be a string"},
      // Found by tests/fuzz/safetensors_header_fuzz: nlohmann_json throws out_of_range, not
      // parse_error, for a number beyond a double.
      {"number_beyond_double",
       MakeFile(R"({"w":{"dtype":"F32","shape":[1e500],"data_offsets":[0,8]}})", eight),
       "header is not valid JSON: [json.exception.out_of_range.406] number overflow"},
      // Printing this entry in the error message overflowed the stack (NOTE [JSON nesting
      // limit] in core/json_limits.h).
      {"deep_nesting",
       MakeFile("{\"w\":" + std::string(1'000'000, '[') + std::string(1'000'000, ']') + "}", ""),
       "JSON nests more than 64 levels deep"},
  };
  for (const BadFileCase& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = dir.Join(c.label + ".safetensors");
    WriteBytes(path, c.bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
    ASSERT_FALSE(reader.ok());
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(reader.status().message()),
                AllOf(HasSubstr(path), HasSubstr(c.expected)));
  }
}

TEST(SafetensorsTest, ReaderRejectsTruncatedFile) {
  ScopedTempDir dir;
  const std::string path = dir.Join("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(
                  DefaultFileSystem(), path,
                  {{"layers.0.weight", torch::ones({4, 4})}, {"layers.0.bias", torch::ones({4})}},
                  {})
                  .ok());
  const uint64_t full = *DefaultFileSystem()->FileSize(path);
  TruncateTo(path, full - 4);
  absl::Status status = SafetensorsReader::Open(path).status();
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(path), HasSubstr("layers.0.weight"), HasSubstr("file truncated?")));
  TruncateTo(path, 20);  // Inside the header.
  status = SafetensorsReader::Open(path).status();
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr("file truncated?")));
  EXPECT_THAT(
      std::string(SafetensorsReader::Open(dir.Join("absent.safetensors")).status().message()),
      HasSubstr("absent.safetensors"));
}

}  // namespace
}  // namespace fulcrum::ckpt
