// [[device_profile]] tables, [cluster] device_profiles / timing_model / time_scale, and device = "timed:NAME"
// (src/common/device_profile.h, src/common/cluster_config.h); the profiles shipped in configs/profiles parse.
#include <string>

#include "gtest/gtest.h"
#include "src/common/cluster_config.h"
#include "src/common/strings.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

constexpr char kProfile[] = R"(
[[device_profile]]
name = "card"
memory_gib = 2
memory_gb_per_s = 100
h2d_pinned_gb_per_s = 10
h2d_pageable_gb_per_s = 5
d2h_gb_per_s = 8
launch_latency_us = 4
copy_latency_us = 6
tflops = { fp32 = 1, bf16 = 2, fp16 = 3, int8 = 4 }
)";

constexpr char kNodes[] = R"(
[[node]]
name = "main"
role = "main"
address = "10.0.0.1:7100"
device = "timed:card"

[[node]]
name = "w0"
role = "worker"
address = "10.0.0.2:7100"
)";

std::string Cluster(const std::string& cluster_section, const std::string& profiles = kProfile) {
  return StrCat(cluster_section, "\n", kNodes, profiles);
}

absl::Status ParseError(const std::string& text) { return ParseClusterConfig(text, "lab.toml", "/etc/odmoe").status(); }

TEST(DeviceProfileTest, AnInlineProfileParsesInBaseUnits) {
  auto c = ParseClusterConfig(Cluster("[cluster]\ntime_scale = 0.5\ntiming_model = \"models/big/config.json\""),
                              "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->device_profiles.size(), 1u);
  const DeviceProfile* p = c->FindProfile("card");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->defined_in, "lab.toml");
  EXPECT_EQ(p->memory_bytes, uint64_t{2} << 30);
  EXPECT_DOUBLE_EQ(p->memory_bytes_per_s, 100e9);
  EXPECT_DOUBLE_EQ(p->h2d_pinned_bytes_per_s, 10e9);
  EXPECT_DOUBLE_EQ(p->h2d_pageable_bytes_per_s, 5e9);
  EXPECT_DOUBLE_EQ(p->d2h_bytes_per_s, 8e9);
  EXPECT_DOUBLE_EQ(p->launch_latency_s, 4e-6);
  EXPECT_DOUBLE_EQ(p->copy_latency_s, 6e-6);
  EXPECT_DOUBLE_EQ(p->FlopsPerS(DType::kF32), 1e12);
  EXPECT_DOUBLE_EQ(p->FlopsPerS(DType::kBF16), 2e12);
  EXPECT_DOUBLE_EQ(p->FlopsPerS(DType::kF16), 3e12);
  EXPECT_DOUBLE_EQ(p->FlopsPerS(DType::kI8), 4e12);
  EXPECT_DOUBLE_EQ(p->FlopsPerS(DType::kU8), 3e12);  // NF4 is dequantized to fp16
  EXPECT_EQ(c->main()->device, "timed:card");
  EXPECT_DOUBLE_EQ(c->time_scale, 0.5);
  EXPECT_EQ(c->timing_model, "/etc/odmoe/models/big/config.json");
  EXPECT_EQ(c->FindProfile("other"), nullptr);
}

TEST(DeviceProfileTest, DefaultsAreRealTimeAtTheModelsOwnShapes) {
  auto c = ParseClusterConfig(Cluster("[cluster]\nname = \"x\""), "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->time_scale, 1.0);
  EXPECT_EQ(c->timing_model, "");
}

TEST(DeviceProfileTest, TheShippedProfilesParse) {
  const std::string configs = StrCat(ODMOE_SOURCE_DIR, "/configs");
  auto c =
      ParseClusterConfig(Cluster("[cluster]\ndevice_profiles = [\"profiles/rtx3090.toml\", \"profiles/rtx3080.toml\", "
                                 "\"profiles/h100-pcie.toml\", \"profiles/jetson-agx-orin.toml\"]",
                                 ""),
                         "lab.toml", configs);
  // kNodes names "timed:card", which none of the shipped files defines.
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("no device profile named 'card' (defined: rtx3090, rtx3080, h100-pcie, "
                                      "jetson-agx-orin)"),
            std::string::npos)
      << c.status();
  std::string text = Cluster("[cluster]\ndevice_profiles = [\"profiles/rtx3090.toml\", \"profiles/rtx3080.toml\"]", "");
  text.replace(text.find("timed:card"), 10, "timed:rtx3090");
  c = ParseClusterConfig(text, "lab.toml", configs);
  ASSERT_TRUE(c.ok()) << c.status();
  const DeviceProfile* p = c->FindProfile("rtx3090");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->defined_in, configs + "/profiles/rtx3090.toml");
  EXPECT_DOUBLE_EQ(p->memory_bytes_per_s, 936e9);
  EXPECT_DOUBLE_EQ(p->h2d_pinned_bytes_per_s, 25e9);
  EXPECT_DOUBLE_EQ(c->FindProfile("rtx3080")->memory_bytes_per_s, 760e9);
  EXPECT_EQ(c->FindProfile("rtx3080")->memory_bytes, uint64_t{10} << 30);
}

TEST(DeviceProfileTest, EveryFieldIsRequiredAndPositiveAndNamedInTheError) {
  for (const char* field : {"memory_gib", "memory_gb_per_s", "h2d_pinned_gb_per_s", "h2d_pageable_gb_per_s",
                            "d2h_gb_per_s", "launch_latency_us", "copy_latency_us"}) {
    std::string profile = kProfile;
    const size_t at = profile.find(StrCat(field, " = "));
    ASSERT_NE(at, std::string::npos) << field;
    const size_t eol = profile.find('\n', at);
    std::string without = profile;
    without.erase(at, eol - at + 1);
    EXPECT_EQ(ParseError(Cluster("", without)).message(),
              StrCat("lab.toml: device_profile 'card': field '", field,
                     "': missing (every field of a device profile is required)"));
    std::string negative = profile;
    negative.replace(at, eol - at, StrCat(field, " = -1"));
    EXPECT_EQ(ParseError(Cluster("", negative)).message(),
              StrCat("lab.toml: device_profile 'card': field '", field, "': must be > 0, got -1"));
  }
  std::string text = kProfile;
  text.replace(text.find("int8 = 4"), 8, "int8 = 0");
  EXPECT_EQ(ParseError(Cluster("", text)).message(),
            "lab.toml: device_profile 'card': tflops: field 'int8': must be > 0, got 0");
  text = kProfile;
  text.replace(text.find("int8 = 4"), 8, "int4 = 4");
  EXPECT_EQ(ParseError(Cluster("", text)).message(),
            "lab.toml: device_profile 'card': tflops: field 'int4': unknown field");
  text = kProfile;
  text.replace(text.find("launch_latency_us"), 17, "launch_latency");
  EXPECT_EQ(ParseError(Cluster("", text)).message(),
            "lab.toml: device_profile 'card': field 'launch_latency': unknown field");
  text = kProfile;
  text.replace(text.find("h2d_pageable_gb_per_s = 5"), 25, "h2d_pageable_gb_per_s = 50");
  EXPECT_NE(ParseError(Cluster("", text)).message().find("field 'h2d_pageable_gb_per_s': 50 exceeds h2d_pinned"),
            std::string::npos);
  text = kProfile;
  text.replace(text.find("name = \"card\""), 13, "name = \"a:b\"");
  EXPECT_NE(ParseError(Cluster("", text)).message().find("lab.toml: [[device_profile]] #1: field 'name'"),
            std::string::npos);
}

TEST(DeviceProfileTest, ClusterFieldsAreChecked) {
  EXPECT_EQ(ParseError(Cluster("[cluster]\ntime_scale = 0")).message(),
            "lab.toml: [cluster]: field 'time_scale': must be in (0, 1000000], got 0");
  EXPECT_EQ(ParseError(Cluster("[cluster]\ntime_scale = \"fast\"")).message(),
            "lab.toml: [cluster]: field 'time_scale': expected a number");
  EXPECT_EQ(ParseError(Cluster("[cluster]\ntiming_model = \"\"")).message(),
            "lab.toml: [cluster]: field 'timing_model': expected a config.json path (or a folder holding one)");
  EXPECT_EQ(ParseError(Cluster("[cluster]\ndevice_profiles = \"profiles/rtx3090.toml\"")).message(),
            "lab.toml: [cluster]: field 'device_profiles': expected a list of profile files");
  // A node naming a profile nobody defined.
  EXPECT_EQ(ParseError(Cluster("", "")).message(),
            "lab.toml: node 'main': field 'device': 'timed:card': no device profile named 'card' (defined: none; list "
            "profile files in [cluster] device_profiles)");
}

TEST(DeviceProfileTest, ProfileFilesAreReadRelativeToTheClusterFile) {
  testing::TempDir dir;
  testing::WriteFile(dir.path() + "/card.toml", kProfile);
  testing::WriteFile(dir.path() + "/bad.toml", "[cluster]\nname = \"x\"\n");
  auto c = ParseClusterConfig(Cluster("[cluster]\ndevice_profiles = [\"card.toml\"]", ""), "lab.toml", dir.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->FindProfile("card")->defined_in, dir.path() + "/card.toml");
  // The same name in a profile file and in the cluster file: the error names both.
  absl::Status twice =
      ParseClusterConfig(Cluster("[cluster]\ndevice_profiles = [\"card.toml\"]"), "lab.toml", dir.path()).status();
  EXPECT_EQ(twice.message(),
            StrCat("lab.toml: device_profile 'card': field 'name': already defined in ", dir.path(), "/card.toml"));
  absl::Status missing =
      ParseClusterConfig(Cluster("[cluster]\ndevice_profiles = [\"nope.toml\"]", ""), "lab.toml", dir.path()).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("lab.toml: [cluster]: field 'device_profiles': "), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("nope.toml"), std::string::npos) << missing;
  absl::Status other =
      ParseClusterConfig(Cluster("[cluster]\ndevice_profiles = [\"bad.toml\"]", ""), "lab.toml", dir.path()).status();
  EXPECT_EQ(other.message(), StrCat(dir.path(),
                                    "/bad.toml: field 'cluster': unknown section (a profile file holds "
                                    "[[device_profile]] only)"));
}

TEST(DeviceProfileTest, TheEmulatedTestbedParses) {
  auto c = LoadClusterConfig(StrCat(ODMOE_SOURCE_DIR, "/configs/testbed-emulated.toml"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->workers().size(), 8u);
  EXPECT_EQ(c->group_size, 2);
  EXPECT_EQ(c->main()->device, "timed:rtx3090");
  EXPECT_EQ(c->shadow()->device, "timed:rtx3090x2");
  const DeviceProfile* one = c->FindProfile("rtx3090");
  const DeviceProfile* pair = c->FindProfile("rtx3090x2");
  ASSERT_NE(one, nullptr);
  ASSERT_NE(pair, nullptr);
  EXPECT_EQ(pair->memory_bytes, 2 * one->memory_bytes);
  EXPECT_DOUBLE_EQ(pair->memory_bytes_per_s, 2 * one->memory_bytes_per_s);
  EXPECT_EQ(c->timing_model, StrCat(ODMOE_SOURCE_DIR, "/configs/models/mixtral-8x7b/config.json"));
}

}  // namespace
}  // namespace odmoe
