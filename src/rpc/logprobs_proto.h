// Token log-probabilities (src/engine/logprobs.h) to and from main's API messages (GenerateResponse.logprobs):
// the one conversion main, the HTTP API and the cluster client share. Header-only: plain fields both ways.
#pragma once

#include "odmoe/v1/main.pb.h"
#include "src/engine/logprobs.h"

namespace odmoe::rpc {

inline void LogprobsToProto(const PositionLogprobs& in, v1::PositionLogprobs* out) {
  out->mutable_token()->set_token(in.token.id);
  out->mutable_token()->set_logprob(in.token.logprob);
  for (const TokenLogprob& t : in.top) {
    v1::TokenLogprob* p = out->add_top();
    p->set_token(t.id);
    p->set_logprob(t.logprob);
  }
}

inline PositionLogprobs LogprobsFromProto(const v1::PositionLogprobs& in) {
  PositionLogprobs out;
  out.token = {in.token().token(), in.token().logprob()};
  out.top.reserve(static_cast<size_t>(in.top_size()));
  for (const v1::TokenLogprob& t : in.top()) out.top.push_back({t.token(), t.logprob()});
  return out;
}

}  // namespace odmoe::rpc
