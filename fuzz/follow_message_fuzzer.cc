// Fuzzes the shadow's Follow stream decoding without a stream: the input is a serialized FollowMessage, checked
// by ShadowNode::CheckFollowMessages of a shadow of the shared mixtral-tiny model (fuzz_nodes.h) twice: as the
// stream's first message (a FollowStart, its header completed with the shadow's epoch and fingerprint when
// empty), and as a later message after a valid start (a FollowStep or FollowKv: positions, tokens, K/V shapes).
// Either may be refused; neither may crash, leak or hang.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_nodes.h"
#include "odmoe/v1/shadow.pb.h"
#include "src/rpc/rpc_util.h"

namespace {
odmoe::ShadowNode* shadow = nullptr;
odmoe::v1::FollowMessage good_start;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  shadow = odmoe::fuzz::FuzzShadow("follow_message_fuzzer");
  odmoe::v1::FollowStart* start = good_start.mutable_start();
  odmoe::rpc::FillHeader(start->mutable_header(), 7, shadow->fingerprint(), "main", 1);
  for (int32_t id : {1, 40, 7}) start->add_prompt_ids(id);
  start->set_max_new_tokens(8);
  start->set_align_token(1);
  start->set_align_kv(1);
  start->set_max_lead_tokens(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  odmoe::v1::FollowMessage message;
  if (!message.ParseFromArray(data, static_cast<int>(size))) return 0;
  odmoe::v1::FollowMessage first = message;
  if (first.has_start()) {
    odmoe::v1::RequestHeader* h = first.mutable_start()->mutable_header();
    if (h->model_fingerprint().empty()) h->set_model_fingerprint(shadow->fingerprint());
    if (h->epoch() == 0) h->set_epoch(7);
  }
  (void)shadow->CheckFollowMessages(first, {});
  (void)shadow->CheckFollowMessages(good_start, {message, message});
  return 0;
}
