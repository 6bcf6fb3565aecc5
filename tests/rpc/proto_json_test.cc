#include "src/rpc/proto_json.h"

#include <cstdint>
#include <limits>

#include "gtest/gtest.h"
#include "odmoe/v1/common.pb.h"
#include "odmoe/v1/main.pb.h"

namespace odmoe {
namespace {

TEST(ProtoToJsonTest, EveryFieldByItsProtoNameDefaultsIncluded) {
  const v1::RequestStats empty;
  const Json j = ProtoToJson(empty);
  const auto* d = v1::RequestStats::descriptor();
  ASSERT_EQ(j.size(), static_cast<size_t>(d->field_count()));
  for (int i = 0; i < d->field_count(); ++i) EXPECT_TRUE(j.contains(d->field(i)->name())) << d->field(i)->name();
  EXPECT_EQ(j["ttft_ms"], 0.0);
  EXPECT_EQ(j["io_bound"], false);
  EXPECT_EQ(j["prediction"], "");
  EXPECT_TRUE(j["workers"].is_array() && j["workers"].empty());
  EXPECT_TRUE(j["recall_per_token"].is_array() && j["recall_per_token"].empty());
}

TEST(ProtoToJsonTest, ValuesNestedAndRepeated) {
  v1::RequestStats st;
  st.set_ttft_ms(12.5);
  st.set_bytes_loaded(std::numeric_limits<uint64_t>::max());  // no double holds it: must stay an exact integer
  st.set_groups(-3);
  st.set_io_bound(true);
  st.set_prediction("shadow");
  st.add_recall_per_token(0.25);
  st.add_recall_per_token(1.0);
  v1::WorkerRequestStats* w = st.add_workers();
  w->set_node("worker3");
  w->set_rows_computed(48);
  const Json j = ProtoToJson(st);
  EXPECT_EQ(j["ttft_ms"].get<double>(), 12.5);
  ASSERT_TRUE(j["bytes_loaded"].is_number_unsigned());
  EXPECT_EQ(j["bytes_loaded"].get<uint64_t>(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(j["groups"].get<int>(), -3);
  EXPECT_EQ(j["io_bound"], true);
  EXPECT_EQ(j["prediction"], "shadow");
  EXPECT_EQ(j["recall_per_token"], Json::array({0.25, 1.0}));
  ASSERT_EQ(j["workers"].size(), 1u);
  EXPECT_EQ(j["workers"][0]["node"], "worker3");
  EXPECT_EQ(j["workers"][0]["rows_computed"].get<uint64_t>(), 48u);
  EXPECT_EQ(j["workers"][0]["calls"].get<uint64_t>(), 0u);
  // A dump parses back to the same values (the form `odmoe generate --json` prints).
  EXPECT_EQ(Json::parse(DumpJson(j)), j);
}

TEST(ProtoToJsonTest, EnumsByNameBytesAsBase64) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.set_data(std::string("\x00\xff\x10", 3));
  const Json j = ProtoToJson(t);
  EXPECT_EQ(j["dtype"], "DTYPE_BF16");
  EXPECT_EQ(j["data"], "AP8Q");
}

}  // namespace
}  // namespace odmoe
