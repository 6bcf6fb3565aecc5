// ParseJson / DumpJson and JsonFields: typed reads whose errors name the file and the field, with the Status
// code that decides the exit code (DataLoss for unparsable text, FailedPrecondition for wrong content).
#include "src/common/json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace odmoe {
namespace {

using ::testing::HasSubstr;

Json Parse(const std::string& text) {
  auto j = ParseJson(text, "test.json");
  EXPECT_TRUE(j.ok()) << j.status();
  return j.ok() ? *j : Json();
}

TEST(ParseJsonTest, ParsesValidText) {
  auto j = ParseJson(R"({"a": [1, 2.5, "x", null, true]})", "f.json");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["a"].size(), 5u);
  EXPECT_EQ((*j)["a"][0].get<int>(), 1);
}

TEST(ParseJsonTest, InvalidTextIsDataLossNamingTheSource) {
  for (const char* text : {"", "{", R"({"a": })", R"({"a": 1,})", "[1 2]", "{'a': 1}", "nul", R"({"a": 1} x)"}) {
    auto j = ParseJson(text, "dir/config.json");
    ASSERT_FALSE(j.ok()) << "accepted: " << text;
    EXPECT_EQ(j.status().code(), absl::StatusCode::kDataLoss) << text;
    EXPECT_THAT(j.status().message(), HasSubstr("dir/config.json: invalid JSON")) << text;
  }
}

TEST(ParseJsonTest, InvalidUtf8IsRejectedNotCrashing) {
  auto j = ParseJson(std::string("{\"a\": \"\xff\xfe\"}"), "x.json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kDataLoss);
}

TEST(DumpJsonTest, CompactAndTolerantOfInvalidUtf8) {
  Json j = {{"b", 1}, {"a", {1, 2}}};
  EXPECT_EQ(DumpJson(j), R"({"a":[1,2],"b":1})");
  Json bad = std::string("x\xffy");
  EXPECT_EQ(DumpJson(bad), "\"x\xEF\xBF\xBDy\"");  // U+FFFD replaces the bad byte
}

TEST(FloatJsonTest, ShortestDigitsThatReadBackAsTheSameFloat) {
  EXPECT_EQ(DumpJson(FloatJson(-0.16076527535915375f)), "-0.16076528");
  EXPECT_EQ(DumpJson(FloatJson(-9999.0f)), "-9999.0");
  EXPECT_EQ(DumpJson(FloatJson(0.0f)), "0.0");
  // Every float of a spread of magnitudes comes back bit for bit through the text.
  for (float f = -1e-30f; f > -1e30f; f *= 3.7f) {
    const float back = Json::parse(DumpJson(FloatJson(f))).get<float>();
    EXPECT_EQ(back, f) << DumpJson(FloatJson(f));
    const float next = std::nextafter(f, 0.0f);
    EXPECT_EQ(Json::parse(DumpJson(FloatJson(next))).get<float>(), next);
  }
}

TEST(JsonTypeNameTest, NamesEveryKind) {
  EXPECT_EQ(JsonTypeName(Json(nullptr)), "null");
  EXPECT_EQ(JsonTypeName(Json::object()), "object");
  EXPECT_EQ(JsonTypeName(Json::array()), "array");
  EXPECT_EQ(JsonTypeName(Json("s")), "string");
  EXPECT_EQ(JsonTypeName(Json(true)), "boolean");
  EXPECT_EQ(JsonTypeName(Json(-3)), "integer");
  EXPECT_EQ(JsonTypeName(Json(3u)), "integer");
  EXPECT_EQ(JsonTypeName(Json(2.5)), "number");
}

class JsonFieldsTest : public ::testing::Test {
 protected:
  JsonFieldsTest()
      : json_(Parse(R"({
          "int": 4096, "neg": -7, "whole_float": 4096.0, "frac": 4096.5, "str": "128", "bool": true,
          "null": null, "list": [1, 2, 3], "list_bad": [1, "2"], "obj": {"x": 1}, "big": 18446744073709551615,
          "dbl": 1e-5, "huge_float": 1e300
        })")),
        f_(json_, "m/config.json") {}

  // Checks that `s` is a FailedPrecondition naming the file and the field.
  static void ExpectFieldError(const absl::Status& s, const std::string& field, const std::string& problem) {
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("m/config.json: field '" + field + "': ")) << s;
    EXPECT_THAT(s.message(), HasSubstr(problem)) << s;
  }

  Json json_;
  JsonFields f_;
};

TEST_F(JsonFieldsTest, HasContainsGet) {
  EXPECT_TRUE(f_.Has("int"));
  EXPECT_FALSE(f_.Has("null"));  // null counts as absent
  EXPECT_TRUE(f_.Contains("null"));
  EXPECT_FALSE(f_.Has("missing"));
  EXPECT_FALSE(f_.Contains("missing"));
  EXPECT_EQ(f_.Get("null"), nullptr);
  ASSERT_NE(f_.Get("int"), nullptr);
  EXPECT_EQ(f_.Get("int")->get<int>(), 4096);
  EXPECT_EQ(f_.where(), "m/config.json");
}

TEST_F(JsonFieldsTest, Int) {
  EXPECT_EQ(*f_.Int("int"), 4096);
  EXPECT_EQ(*f_.Int("neg"), -7);
  EXPECT_EQ(*f_.Int("whole_float"), 4096);  // 4096.0 is an integer
  EXPECT_EQ(*f_.Int("missing", 5), 5);
  EXPECT_EQ(*f_.Int("null", 6), 6);
  EXPECT_EQ(*f_.Int("int", 6), 4096);
  ExpectFieldError(f_.Int("frac").status(), "frac", "expected an integer, got number 4096.5");
  ExpectFieldError(f_.Int("str").status(), "str", "expected an integer, got string \"128\"");
  ExpectFieldError(f_.Int("bool").status(), "bool", "expected an integer, got boolean");
  ExpectFieldError(f_.Int("list").status(), "list", "expected an integer, got array");
  ExpectFieldError(f_.Int("big").status(), "big", "integer out of range");
  ExpectFieldError(f_.Int("huge_float").status(), "huge_float", "expected an integer");
  ExpectFieldError(f_.Int("missing").status(), "missing", "required but missing");
  ExpectFieldError(f_.Int("null").status(), "null", "required but missing");
  ExpectFieldError(f_.Int("str", 1).status(), "str", "expected an integer");  // a fallback does not hide a bad type
}

TEST_F(JsonFieldsTest, Number) {
  EXPECT_EQ(*f_.Number("dbl"), 1e-5);
  EXPECT_EQ(*f_.Number("int"), 4096.0);  // integers are numbers
  EXPECT_EQ(*f_.Number("missing", 0.5), 0.5);
  EXPECT_EQ(*f_.Number("null", 0.25), 0.25);
  ExpectFieldError(f_.Number("str").status(), "str", "expected a number, got string");
  ExpectFieldError(f_.Number("bool", 1.0).status(), "bool", "expected a number, got boolean");
  ExpectFieldError(f_.Number("missing").status(), "missing", "required but missing");
}

TEST_F(JsonFieldsTest, Bool) {
  EXPECT_TRUE(*f_.Bool("bool", false));
  EXPECT_FALSE(*f_.Bool("missing", false));
  EXPECT_TRUE(*f_.Bool("null", true));
  ExpectFieldError(f_.Bool("int", false).status(), "int", "expected true or false, got integer");
  ExpectFieldError(f_.Bool("str", false).status(), "str", "expected true or false, got string");
}

TEST_F(JsonFieldsTest, String) {
  EXPECT_EQ(*f_.String("str"), "128");
  EXPECT_EQ(*f_.String("missing", "dflt"), "dflt");
  EXPECT_EQ(*f_.String("null", "dflt"), "dflt");
  ExpectFieldError(f_.String("int").status(), "int", "expected a string, got integer");
  ExpectFieldError(f_.String("obj", "x").status(), "obj", "expected a string, got object");
  ExpectFieldError(f_.String("missing").status(), "missing", "required but missing");
}

TEST_F(JsonFieldsTest, IntOrIntList) {
  EXPECT_EQ(*f_.IntOrIntList("int"), std::vector<int64_t>({4096}));
  EXPECT_EQ(*f_.IntOrIntList("list"), std::vector<int64_t>({1, 2, 3}));
  EXPECT_TRUE(f_.IntOrIntList("missing")->empty());
  EXPECT_TRUE(f_.IntOrIntList("null")->empty());
  ExpectFieldError(f_.IntOrIntList("list_bad").status(), "list_bad", "expected an integer, got string");
  ExpectFieldError(f_.IntOrIntList("str").status(), "str", "expected an integer, got string");
  ExpectFieldError(f_.IntOrIntList("obj").status(), "obj", "expected an integer, got object");
}

TEST_F(JsonFieldsTest, IntList) {
  EXPECT_EQ(*f_.IntList("list"), std::vector<int64_t>({1, 2, 3}));
  EXPECT_TRUE(f_.IntList("missing")->empty());
  ExpectFieldError(f_.IntList("int").status(), "int", "expected a list of integers, got integer");
  ExpectFieldError(f_.IntList("list_bad").status(), "list_bad", "expected an integer");
}

TEST_F(JsonFieldsTest, FieldErrorFormat) {
  const absl::Status s = f_.FieldError("hidden_size", "must be positive, got 0");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "m/config.json: field 'hidden_size': must be positive, got 0");
}

TEST(JsonFieldsOnNonObjectTest, EverythingIsAbsent) {
  const Json arr = Json::array({1, 2});
  JsonFields f(arr, "x.json");
  EXPECT_FALSE(f.Has("a"));
  EXPECT_FALSE(f.Contains("a"));
  EXPECT_EQ(*f.Int("a", 3), 3);
  EXPECT_EQ(f.Int("a").status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace odmoe
