// Sampling options (src/engine/sampler.h) to and from main's API messages (GenerateRequest.sampling): the one
// conversion the CLI, the HTTP API and main share, so that a request samples on main as its client asked.
// Header-only: plain fields both ways; no checks here (SamplingOptions::Validate does them on main).
#pragma once

#include "odmoe/v1/main.pb.h"
#include "src/engine/sampler.h"

namespace odmoe::rpc {

inline void SamplingToProto(const SamplingOptions& in, v1::SamplingParams* out) {
  out->set_temperature(in.temperature);
  out->set_top_k(in.top_k);
  out->set_top_p(in.top_p);
  out->set_seed(in.seed);
  out->set_presence_penalty(in.presence_penalty);
  out->set_frequency_penalty(in.frequency_penalty);
  for (const auto& [id, bias] : in.logit_bias) (*out->mutable_logit_bias())[id] = bias;
}

// A top_p of 0 (the field unset) is 1: no cut.
inline SamplingOptions SamplingFromProto(const v1::SamplingParams& in) {
  SamplingOptions out;
  out.temperature = in.temperature();
  out.top_k = in.top_k();
  out.top_p = in.top_p() == 0 ? 1.0 : in.top_p();
  out.seed = in.seed();
  out.presence_penalty = in.presence_penalty();
  out.frequency_penalty = in.frequency_penalty();
  for (const auto& [id, bias] : in.logit_bias()) out.logit_bias.emplace_back(id, bias);
  return out;
}

}  // namespace odmoe::rpc
