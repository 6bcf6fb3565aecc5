// The safetensors reader against hand-built files: a valid one, then one file per way a header can be broken.
// Every failure must be a DataLoss (exit code 4) whose message names the file, and the tensor where one is at
// fault; a known dtype that odmoe does not compute with parses (the checkpoint refuses it when asked for it).
#include "src/model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "tests/model/safetensors_builder.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::BuildSafetensors;
using ::odmoe::testing::SerializeSafetensors;
using ::odmoe::testing::StTensor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kPath[] = "dir/model.safetensors";

absl::StatusOr<SafetensorsHeader> Parse(const std::string& file) {
  return ParseSafetensors(reinterpret_cast<const uint8_t*>(file.data()), file.size(), kPath);
}

// A header entry, written as given.
Json Entry(const std::string& dtype, const std::vector<int64_t>& shape, uint64_t begin, uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

// Expects a DataLoss naming the file and containing each of `parts`.
void ExpectCorrupt(const absl::StatusOr<SafetensorsHeader>& h, const std::vector<std::string>& parts) {
  ASSERT_FALSE(h.ok()) << "accepted; expected an error containing '" << parts.front() << "'";
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss) << h.status();
  EXPECT_EQ(ExitCodeFor(h.status()), kExitCorrupt);
  EXPECT_THAT(h.status().message(), HasSubstr(kPath)) << h.status();
  for (const std::string& p : parts) EXPECT_THAT(h.status().message(), HasSubstr(p)) << h.status();
}

std::string TwoTensorFile() {
  return BuildSafetensors({{"a.weight", "F32", {2, 3}, ""}, {"b.bias", "BF16", {5}, ""}}, {{"format", "pt"}});
}

TEST(SafetensorsTest, ParsesAValidFile) {
  const std::string file = TwoTensorFile();
  auto h = Parse(file);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->data_start, file.size() - 24 - 10);  // the data section holds 24 + 10 bytes
  EXPECT_EQ(h->data_start % 8, 0u);                 // the builder pads like the reference writer
  const TensorInfo& a = h->tensors[0];
  EXPECT_EQ(a.name, "a.weight");
  EXPECT_EQ(a.dtype_name, "F32");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_THAT(a.shape, ElementsAre(2, 3));
  EXPECT_EQ(a.numel(), 6);
  EXPECT_EQ(a.ShapeString(), "[2, 3]");
  EXPECT_EQ(a.offset, h->data_start);
  EXPECT_EQ(a.nbytes, 24u);
  const TensorInfo& b = h->tensors[1];
  EXPECT_EQ(b.name, "b.bias");
  EXPECT_EQ(b.dtype, DType::kBF16);
  EXPECT_EQ(b.offset, h->data_start + 24);
  EXPECT_EQ(b.nbytes, 10u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(SafetensorsTest, OpensFromDiskAndHandsOutTheBytes) {
  odmoe::testing::TempDir dir;
  std::string data(6 * 4, '\0');
  const float values[6] = {1, 2, 3, 4, 5, -6.5f};
  std::memcpy(data.data(), values, sizeof(values));
  odmoe::testing::WriteFile(dir.File("m.safetensors"), BuildSafetensors({{"x", "F32", {2, 3}, data}}));
  auto f = SafetensorsFile::Open(dir.File("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorInfo* x = (*f)->Find("x");
  ASSERT_NE(x, nullptr);
  EXPECT_EQ((*f)->Find("y"), nullptr);
  float read[6];
  std::memcpy(read, (*f)->DataOf(*x), sizeof(read));
  EXPECT_EQ(read[5], -6.5f);
  EXPECT_EQ((*f)->path(), dir.File("m.safetensors"));
  EXPECT_EQ((*f)->tensors().size(), 1u);
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  odmoe::testing::TempDir dir;
  auto f = SafetensorsFile::Open(dir.File("absent.safetensors"));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(f.status().message(), HasSubstr(dir.File("absent.safetensors")));
}

TEST(SafetensorsTest, EmptyHeaderAndEmptyTensorsAreValid) {
  auto empty = Parse(SerializeSafetensors(Json::object(), ""));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->tensors.empty());
  // Zero-element tensors take no bytes and may share an offset with anything.
  Json header = {{"a", Entry("F32", {0}, 0, 0)}, {"b", Entry("F32", {2, 0}, 0, 0)}, {"c", Entry("F16", {1}, 0, 2)}};
  auto h = Parse(SerializeSafetensors(header, std::string(2, '\0')));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 3u);
  // A scalar (shape []) has one element.
  auto scalar = Parse(SerializeSafetensors({{"s", Entry("F32", {}, 0, 4)}}, std::string(4, '\0')));
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_EQ(scalar->tensors[0].numel(), 1);
}

TEST(SafetensorsTest, FileShorterThanTheLengthField) {
  for (size_t n : {0, 1, 7}) ExpectCorrupt(Parse(std::string(n, '\0')), {"too short"});
}

TEST(SafetensorsTest, TruncatedAnywhereIsRefusedWithoutCrashing) {
  const std::string file = TwoTensorFile();
  for (size_t n = 0; n < file.size(); ++n) {
    auto h = Parse(file.substr(0, n));
    ASSERT_FALSE(h.ok()) << "a file truncated to " << n << " of " << file.size() << " bytes was accepted";
    ASSERT_EQ(h.status().code(), absl::StatusCode::kDataLoss) << n << ": " << h.status();
  }
  // Cut inside the data: the message names the tensor that no longer fits.
  ExpectCorrupt(Parse(file.substr(0, file.size() - 1)), {"tensor 'b.bias'", "outside the data section"});
}

TEST(SafetensorsTest, HeaderLengthPastTheEnd) {
  const std::string file = SerializeSafetensors({{"x", Entry("F32", {1}, 0, 4)}}, std::string(4, '\0'), 1000);
  ExpectCorrupt(Parse(file), {"header length 1000 runs past the end of the file"});
}

TEST(SafetensorsTest, HugeHeaderLength) {
  const std::string data(64, ' ');
  ExpectCorrupt(Parse(SerializeSafetensors(Json::object(), data, kMaxSafetensorsHeaderBytes + 1)),
                {"exceeds the limit"});
  ExpectCorrupt(Parse(SerializeSafetensors(Json::object(), data, ~uint64_t{0})), {"exceeds the limit"});
  ExpectCorrupt(Parse(SerializeSafetensors(Json::object(), data, uint64_t{1} << 63)), {"exceeds the limit"});
}

TEST(SafetensorsTest, InvalidJson) {
  auto raw = [](const std::string& header) {
    std::string out(8, '\0');
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + header;
  };
  ExpectCorrupt(Parse(raw(R"({"x": {"dtype": "F32", )")), {"invalid JSON"});
  ExpectCorrupt(Parse(raw(R"({"x": 1,})")), {"invalid JSON"});
  ExpectCorrupt(Parse(raw("{\"x\xff\": 1}")), {"invalid JSON"});
  ExpectCorrupt(Parse(raw("[1, 2]   ")), {"does not start with a JSON object"});
  ExpectCorrupt(Parse(raw("        ")), {"does not start with a JSON object"});
  ExpectCorrupt(Parse(raw("")), {"does not start with a JSON object"});
}

TEST(SafetensorsTest, MalformedEntries) {
  const std::string data(16, '\0');
  auto parse = [&](const Json& header) { return Parse(SerializeSafetensors(header, data)); };
  ExpectCorrupt(parse({{"x", 5}}), {"tensor 'x'", "not an object"});
  ExpectCorrupt(parse({{"x", {{"shape", {1}}, {"data_offsets", {0, 4}}}}}), {"tensor 'x'", "dtype"});
  ExpectCorrupt(parse({{"x", {{"dtype", 7}, {"shape", {1}}, {"data_offsets", {0, 4}}}}}), {"tensor 'x'", "dtype"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"data_offsets", {0, 4}}}}}), {"tensor 'x'", "shape"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {1}}}}}), {"tensor 'x'", "data_offsets"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0}}}}}),
                {"tensor 'x'", "data_offsets"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4.0}}}}}),
                {"tensor 'x'", "data_offsets"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {-4, 0}}}}}),
                {"tensor 'x'", "data_offsets"});
  ExpectCorrupt(parse({{"x", Entry("F32", {-1}, 0, 4)}}), {"tensor 'x'", "non-negative"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {1.5}}, {"data_offsets", {0, 4}}}}}),
                {"tensor 'x'", "non-negative integers"});
  ExpectCorrupt(parse({{"x", {{"dtype", "F32"}, {"shape", {"1"}}, {"data_offsets", {0, 4}}}}}),
                {"tensor 'x'", "non-negative integers"});
  ExpectCorrupt(parse({{"", Entry("F32", {1}, 0, 4)}}), {"empty name"});
  // Dimensions whose product overflows 64 bits must not wrap around to a small size.
  ExpectCorrupt(parse({{"x", Entry("U8", {int64_t{1} << 32, int64_t{1} << 32, 16}, 0, 0)}}),
                {"tensor 'x'", "too large"});
  ExpectCorrupt(parse({{"x", Entry("U8", {int64_t{1} << 41}, 0, 0)}}), {"tensor 'x'", "too large"});
}

TEST(SafetensorsTest, Metadata) {
  auto ok = Parse(BuildSafetensors({{"x", "F32", {1}, ""}}, {{"format", "pt"}, {"source", "test"}}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->metadata.size(), 2u);
  EXPECT_EQ(ok->tensors.size(), 1u);  // __metadata__ is not a tensor
  ExpectCorrupt(Parse(BuildSafetensors({{"x", "F32", {1}, ""}}, {{"format", 1}})), {"__metadata__", "format"});
  Json header = {{"__metadata__", {1, 2}}};
  ExpectCorrupt(Parse(SerializeSafetensors(header, "")), {"__metadata__ is not an object"});
}

TEST(SafetensorsTest, UnknownDtype) {
  for (const char* dtype : {"F17", "bf16", "FLOAT32", ""}) {
    Json header = {{"w", Entry(dtype, {2}, 0, 4)}};
    ExpectCorrupt(Parse(SerializeSafetensors(header, std::string(4, '\0'))),
                  {"tensor 'w'", StrCat("unknown dtype '", dtype, "'")});
  }
}

TEST(SafetensorsTest, KnownButUnsupportedDtypesParse) {
  // Valid safetensors: the reader records the name and leaves `dtype` empty; Checkpoint::Read refuses them.
  const std::vector<StTensor> tensors = {
      {"f64", "F64", {3}, ""},   {"i64", "I64", {2}, ""}, {"f8", "F8_E4M3", {5}, ""}, {"f8b", "F8_E5M2", {1}, ""},
      {"bool", "BOOL", {3}, ""}, {"i16", "I16", {2}, ""}, {"u8", "U8", {4}, ""}};
  auto h = Parse(BuildSafetensors(tensors));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), tensors.size());
  for (const TensorInfo& t : h->tensors) {
    if (t.name == "u8") {
      EXPECT_EQ(t.dtype, DType::kU8);
    } else {
      EXPECT_FALSE(t.dtype.has_value()) << t.name;
    }
  }
  // Sizes follow the dtype: F64 [3] is 24 bytes; claiming 12 is inconsistent.
  ExpectCorrupt(Parse(SerializeSafetensors({{"f64", Entry("F64", {3}, 0, 12)}}, std::string(12, '\0'))),
                {"tensor 'f64'", "needs 24"});
  // Sub-byte dtypes round up: F4 [3] is 12 bits, 2 bytes.
  auto f4 = Parse(SerializeSafetensors({{"f4", Entry("F4", {3}, 0, 2)}}, std::string(2, '\0')));
  ASSERT_TRUE(f4.ok()) << f4.status();
}

TEST(SafetensorsTest, OffsetsOutOfBounds) {
  const std::string data(16, '\0');
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F32", {8}, 0, 32)}}, data)),
                {"tensor 'w'", "data_offsets [0, 32] lie outside the data section (16 bytes)"});
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F32", {1}, 16, 20)}}, data)),
                {"tensor 'w'", "outside the data section"});
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F32", {1}, ~uint64_t{0} - 3, ~uint64_t{0})}}, data)),
                {"tensor 'w'", "outside the data section"});
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F32", {1}, 8, 4)}}, data)), {"tensor 'w'", "reversed"});
}

TEST(SafetensorsTest, OffsetsInconsistentWithShape) {
  const std::string data(64, '\0');
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F32", {2, 3}, 0, 20)}}, data)),
                {"tensor 'w'", "span 20 bytes but shape [2, 3] of F32 needs 24"});
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("BF16", {4}, 0, 16)}}, data)), {"tensor 'w'", "needs 8"});
  ExpectCorrupt(Parse(SerializeSafetensors({{"w", Entry("F16", {0}, 0, 2)}}, data)), {"tensor 'w'", "needs 0"});
}

TEST(SafetensorsTest, OverlappingTensors) {
  const std::string data(64, '\0');
  ExpectCorrupt(Parse(SerializeSafetensors({{"a", Entry("F32", {4}, 0, 16)}, {"b", Entry("F32", {4}, 8, 24)}}, data)),
                {"tensors 'a' and 'b' overlap"});
  // Identical ranges.
  ExpectCorrupt(Parse(SerializeSafetensors({{"a", Entry("F32", {4}, 0, 16)}, {"b", Entry("F32", {4}, 0, 16)}}, data)),
                {"overlap"});
  // One inside another.
  ExpectCorrupt(Parse(SerializeSafetensors({{"a", Entry("F32", {8}, 0, 32)}, {"b", Entry("F32", {1}, 8, 12)}}, data)),
                {"tensors 'a' and 'b' overlap"});
  // An empty tensor between two overlapping ones must not hide the overlap.
  ExpectCorrupt(
      Parse(SerializeSafetensors(
          {{"a", Entry("F32", {8}, 0, 32)}, {"m", Entry("F32", {0}, 12, 12)}, {"z", Entry("F32", {2}, 16, 24)}}, data)),
      {"tensors 'a' and 'z' overlap"});
  // Adjacent tensors do not overlap, in any header order.
  auto ok = Parse(SerializeSafetensors({{"z", Entry("F32", {4}, 0, 16)}, {"a", Entry("F32", {4}, 16, 32)}}, data));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tensors[0].name, "z");  // sorted by offset
}

}  // namespace
}  // namespace odmoe
