// Sampling and generation options (src/engine/sampler.h, generator.h) to and from main's API messages
// (GenerateRequest and its sampling) and the shadow's PickRule: the one conversion the CLI, the HTTP API, main and
// the shadow share, so that a request runs on main as its client asked and the shadow replays main's picks.
// Header-only: plain fields; no checks here (the receivers' Validate calls do them).
#pragma once

#include <algorithm>

#include "odmoe/v1/main.pb.h"
#include "odmoe/v1/shadow.pb.h"
#include "src/engine/generator.h"
#include "src/engine/sampler.h"

namespace odmoe::rpc {

inline void SamplingToProto(const SamplingOptions& in, v1::SamplingParams* out) {
  out->set_temperature(in.temperature);
  out->set_top_k(in.top_k);
  out->set_top_p(in.top_p);
  out->set_seed(in.seed);
  out->set_min_p(in.min_p);
  out->set_presence_penalty(in.presence_penalty);
  out->set_frequency_penalty(in.frequency_penalty);
  out->set_repetition_penalty(in.repetition_penalty);
  for (const auto& [id, bias] : in.logit_bias) (*out->mutable_logit_bias())[id] = bias;
}

// A top_p or repetition_penalty of 0 (the field unset) is 1: no cut, no penalty.
inline SamplingOptions SamplingFromProto(const v1::SamplingParams& in) {
  SamplingOptions out;
  out.temperature = in.temperature();
  out.top_k = in.top_k();
  out.top_p = in.top_p() == 0 ? 1.0 : in.top_p();
  out.seed = in.seed();
  out.min_p = in.min_p();
  out.presence_penalty = in.presence_penalty();
  out.frequency_penalty = in.frequency_penalty();
  out.repetition_penalty = in.repetition_penalty() == 0 ? 1.0 : in.repetition_penalty();
  for (const auto& [id, bias] : in.logit_bias()) out.logit_bias.emplace_back(id, bias);
  return out;
}

inline void ConstraintToProto(const OutputConstraint& in, v1::OutputConstraint* out) {
  out->set_compact(in.compact);
  switch (in.kind) {
    case OutputConstraint::Kind::kJsonObject:
      out->set_json_object(true);
      break;
    case OutputConstraint::Kind::kChoice:
      for (const std::string& c : in.choices) out->mutable_choice()->add_choices(c);
      break;
    case OutputConstraint::Kind::kJsonSchema:
      out->set_json_schema(in.schema);
      break;
    case OutputConstraint::Kind::kRegex:
      out->set_regex(in.regex);
      break;
    case OutputConstraint::Kind::kNone:
      break;
  }
}

inline OutputConstraint ConstraintFromProto(const v1::OutputConstraint& in) {
  OutputConstraint out;
  if (in.kind_case() == v1::OutputConstraint::kJsonObject && in.json_object()) {
    out.kind = OutputConstraint::Kind::kJsonObject;
  } else if (in.kind_case() == v1::OutputConstraint::kChoice) {
    out.kind = OutputConstraint::Kind::kChoice;
    out.choices.assign(in.choice().choices().begin(), in.choice().choices().end());
  } else if (in.kind_case() == v1::OutputConstraint::kJsonSchema) {
    out.kind = OutputConstraint::Kind::kJsonSchema;
    out.schema = in.json_schema();
  } else if (in.kind_case() == v1::OutputConstraint::kRegex) {
    out.kind = OutputConstraint::Kind::kRegex;
    out.regex = in.regex();
  }
  out.compact = in.compact();
  return out;
}

// A request's generation options into `out` (every GenerateRequest field but the prompt): the one conversion the
// CLI's --endpoint and the HTTP API share; main reads them back, with its checks, in MainNode::OptionsOf.
inline void OptionsToProto(const GenerateOptions& in, v1::GenerateRequest* out) {
  out->set_max_new_tokens(in.max_new_tokens);
  SamplingToProto(in.sampling, out->mutable_sampling());
  out->set_ignore_eos(in.ignore_eos);
  out->mutable_stop_token_ids()->Add(in.stop_token_ids.begin(), in.stop_token_ids.end());
  out->set_min_tokens(in.min_tokens);
  out->set_include_stop_str_in_output(in.include_stop_str_in_output);
  out->set_dump_logits(in.keep_last_logits);
  out->set_dump_routing(in.record_routing);
  out->set_logprobs(in.logprobs >= 0);
  out->set_top_logprobs(std::max(in.logprobs, 0));
  out->set_prompt_logprobs(in.prompt_logprobs);
  if (in.constraint.active()) ConstraintToProto(in.constraint, out->mutable_constraint());
}

// The fields of `in` that decide how main picks each token (sampling, ignore_eos, min_tokens, stop_token_ids,
// constraint).
inline void PickRuleToProto(const GenerateOptions& in, v1::PickRule* out) {
  SamplingToProto(in.sampling, out->mutable_sampling());
  out->set_ignore_eos(in.ignore_eos);
  out->set_min_tokens(in.min_tokens);
  out->mutable_stop_token_ids()->Add(in.stop_token_ids.begin(), in.stop_token_ids.end());
  if (in.constraint.active()) ConstraintToProto(in.constraint, out->mutable_constraint());
}

// Options with `in`'s pick rule and `max_new_tokens`, the rest at their defaults.
inline GenerateOptions PickRuleFromProto(const v1::PickRule& in, int64_t max_new_tokens) {
  GenerateOptions out;
  out.max_new_tokens = max_new_tokens;
  out.sampling = SamplingFromProto(in.sampling());
  out.ignore_eos = in.ignore_eos();
  out.min_tokens = in.min_tokens();
  out.stop_token_ids.assign(in.stop_token_ids().begin(), in.stop_token_ids().end());
  out.constraint = ConstraintFromProto(in.constraint());
  return out;
}

}  // namespace odmoe::rpc
