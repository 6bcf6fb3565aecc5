#include "tests/engine/logit_changes_check.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/generator.h"
#include "src/engine/sampler.h"
#include "tests/test_support.h"

namespace odmoe::testing {

void ExpectLogitChangesPickAsTheHostRule(const std::string& device_spec, int tokens) {
  const std::string name = "tiny-mixtral-kjv";
  if (!HaveSharedModel(name)) GTEST_SKIP() << "no " << SharedModel(name);
  auto device = CreateDevice(device_spec);
  ASSERT_TRUE(device.ok()) << device.status();
  auto model = LocalModel::Open(SharedModel(name), std::move(device).value());
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const std::vector<int32_t> prompt = {1, 415, 2936, 302, 7, 1725, 3169};
  for (const bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "sampled" : "greedy");
    GenerateOptions plain;
    plain.max_new_tokens = tokens;
    plain.ignore_eos = true;
    plain.keep_last_logits = true;
    if (sampled) plain.sampling = {.temperature = 0.8, .top_k = 0, .top_p = 0.95, .seed = 7};
    auto unchanged = Generate(engine, prompt, plain);
    ASSERT_TRUE(unchanged.ok()) << unchanged.status();
    // Bias and OpenAI's penalties, then the repetition penalty (over the prompt and the picks) as well.
    for (const double repetition : {1.0, 1.3}) {
      SCOPED_TRACE(repetition);
      GenerateOptions changed = plain;
      const int32_t banned = unchanged->tokens[0];
      changed.sampling.presence_penalty = 0.5;
      changed.sampling.frequency_penalty = 1.0;
      changed.sampling.repetition_penalty = repetition;
      changed.sampling.logit_bias = {{banned, -100.0}, {13, 3.0}};
      auto picked = Generate(engine, prompt, changed);
      ASSERT_TRUE(picked.ok()) << picked.status();
      EXPECT_EQ(picked->last_logits, unchanged->last_logits) << "the logits reported are the model's own";
      EXPECT_NE(picked->tokens, unchanged->tokens);
      EXPECT_EQ(std::count(picked->tokens.begin(), picked->tokens.end(), banned), 0);

      // The host rule over the same logits, step by step.
      ASSERT_TRUE(engine.StartSequence(static_cast<int64_t>(prompt.size()) + tokens).ok());
      Sampler sampler(changed.sampling, {}, prompt);
      absl::StatusOr<std::vector<float>> logits = engine.Forward(prompt, nullptr);
      std::vector<int32_t> host;
      for (int t = 0; t < tokens; ++t) {
        ASSERT_TRUE(logits.ok()) << logits.status();
        host.push_back(sampler.Next(*logits));
        logits = engine.Forward(std::span<const int32_t>(&host.back(), 1), nullptr, ForwardKind::kDecode);
      }
      EXPECT_EQ(picked->tokens, host);
    }
  }

  // min_tokens: EOS, made the greedy pick by a bias, is banned (-inf next to the logits) for the first picks.
  ASSERT_FALSE(engine.config().eos_token_ids.empty());
  const auto eos = static_cast<int32_t>(engine.config().eos_token_ids[0]);
  GenerateOptions eos_first;
  eos_first.max_new_tokens = tokens;
  eos_first.sampling.logit_bias = {{eos, 100.0}};
  auto at_once = Generate(engine, prompt, eos_first);
  ASSERT_TRUE(at_once.ok()) << at_once.status();
  EXPECT_EQ(at_once->tokens, std::vector<int32_t>{eos});
  eos_first.min_tokens = 3;
  auto later = Generate(engine, prompt, eos_first);
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_EQ(later->tokens.size(), 4u);
  EXPECT_EQ(std::count(later->tokens.begin(), later->tokens.begin() + 3, eos), 0);
  EXPECT_EQ(later->tokens[3], eos);
  EXPECT_EQ(later->stop_reason, "eos");

  // stop_token_ids: the request ends at the first of them, ignore_eos or not; its text is left out.
  GenerateOptions free;
  free.max_new_tokens = tokens;
  free.ignore_eos = true;
  auto free_run = Generate(engine, prompt, free);
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  const int32_t stop_id = free_run->tokens[2];
  const auto first = static_cast<size_t>(std::find(free_run->tokens.begin(), free_run->tokens.end(), stop_id) -
                                         free_run->tokens.begin());
  free.stop_token_ids = {stop_id};
  auto stopped = Generate(engine, prompt, free);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->tokens, std::vector<int32_t>(free_run->tokens.begin(), free_run->tokens.begin() + first + 1));
  EXPECT_EQ(stopped->stop_reason, "stop_token");
  EXPECT_EQ(ShownTokens(engine.config(), free, *stopped).size(), first);
  GenerateOptions kept = free;
  kept.include_stop_str_in_output = true;
  EXPECT_EQ(ShownTokens(engine.config(), kept, *stopped).size(), first + 1);
  EXPECT_EQ(ShownTokens(engine.config(), kept, *at_once).size(), 1u);  // an EOS counts as shown: its text is ""
  // With min_tokens past it, the stop id is banned like EOS: the answer runs to the limit without it.
  free.min_tokens = tokens;
  auto banned_stop = Generate(engine, prompt, free);
  ASSERT_TRUE(banned_stop.ok()) << banned_stop.status();
  EXPECT_EQ(banned_stop->tokens.size(), static_cast<size_t>(tokens));
  EXPECT_EQ(std::count(banned_stop->tokens.begin(), banned_stop->tokens.end(), stop_id), 0);
  EXPECT_EQ(banned_stop->stop_reason, "length");
}

}  // namespace odmoe::testing
