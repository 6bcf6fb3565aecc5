// The check of logit bias, penalties, min_tokens and stop_token_ids (BatchInput::deltas) that the CPU and mock GPU devices' tests
// (batching_test.cc) and the emulated CUDA device's (logit_changes_cuda_test.cc) share.
#pragma once

#include <string>

namespace odmoe::testing {

// On tiny-mixtral-kjv loaded onto CreateDevice(device), greedy and sampled, `tokens` new tokens, with presence and
// frequency penalties and a logit bias (one of -100 on the first token the request picks without them): checks,
// with gtest failures, that Generate picks every token as the host rule does (Sampler::Next over the logits
// Forward returns), that the changes change the answer and the banned token never comes, and that the logits
// reported are the model's own. Then min_tokens: EOS, biased to be the first pick, comes only after min_tokens; and
// stop_token_ids: a request ends at the first of them, and one banned by min_tokens never comes.
void ExpectLogitChangesPickAsTheHostRule(const std::string& device, int tokens);

}  // namespace odmoe::testing
