// Continuous batching (src/engine/batching.h): requests decoded together give exactly their solo tokens.
#include "src/engine/batching.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/common/json.h"
#include "src/engine/generator.h"
#include "tests/engine/logit_changes_check.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

constexpr char kModel[] = "tiny-mixtral-kjv";

std::unique_ptr<LocalModel> Open(const std::string& device_spec) {
  auto device = CreateDevice(device_spec);
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return nullptr;
  EngineOptions options;
  options.max_sequences_per_forward = 8;
  auto model = LocalModel::Open(odmoe::testing::SharedModel(kModel), std::move(device).value(), options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(model).value() : nullptr;
}

// The 16 held-out prompts of the model (16 ids each).
std::vector<std::vector<int32_t>> RecallPrompts() {
  const std::string path = odmoe::testing::SharedModel(kModel) + "/recall_prompts.json";
  auto doc = ParseJson(odmoe::testing::ReadFile(path), path);
  EXPECT_TRUE(doc.ok()) << doc.status();
  std::vector<std::vector<int32_t>> prompts;
  if (!doc.ok()) return prompts;
  for (const Json& p : (*doc)["prompts"]) prompts.push_back(p.get<std::vector<int32_t>>());
  return prompts;
}

struct Case {
  std::vector<int32_t> prompt;
  GenerateOptions options;
  int join_at_step = 0;  // the batch step before which it joins
};

// Eight requests of different prompts (3 to 40 tokens) and lengths, some joining while others decode.
std::vector<Case> EightCases(bool sampled) {
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts();
  std::vector<Case> cases;
  if (prompts.size() < 8) return cases;
  const int prompt_lens[8] = {16, 3, 40, 9, 1, 16, 27, 12};
  const int new_tokens[8] = {24, 40, 17, 33, 8, 1, 29, 20};
  const int join[8] = {0, 0, 0, 3, 5, 5, 11, 30};
  for (int i = 0; i < 8; ++i) {
    Case c;
    for (int j = 0; static_cast<int>(c.prompt.size()) < prompt_lens[i]; ++j) {  // long prompts continue with others
      const std::vector<int32_t>& p = prompts[static_cast<size_t>((i + j) % 16)];
      c.prompt.insert(c.prompt.end(), p.begin(), p.end());
    }
    c.prompt.resize(static_cast<size_t>(prompt_lens[i]));
    c.options.max_new_tokens = new_tokens[i];
    c.options.keep_last_logits = true;
    c.options.record_routing = i % 2 == 0;
    c.options.ignore_eos = i % 3 == 0;
    c.options.logprobs = i % 4 == 1 ? 5 : (i % 4 == 3 || i == 2 ? 0 : -1);  // rows with logits back among others
    c.options.prompt_logprobs = i == 2 || i == 3;                           // 40 and 9 tokens: several prefill chunks
    if (sampled) {
      // Each request its own options, so that one decode step picks rows of several kinds (a greedy one among
      // them) on the device, each by its own choice and draw.
      const SamplingOptions kinds[4] = {{0.9, 20, 0.95}, {1.3, 0, 0.8}, {0.0, 0, 1.0}, {0.6, 5, 1.0}};
      c.options.sampling = kinds[i % 4];
      c.options.sampling.seed = 1000 + static_cast<uint64_t>(i);
    }
    // Logit changes on some rows (penalties, a bias, a repetition penalty), beside rows without.
    if (i % 3 == 1) {
      c.options.sampling.presence_penalty = 0.4;
      c.options.sampling.frequency_penalty = 0.8;
    }
    if (i == 3) c.options.sampling.logit_bias = {{c.prompt.back(), -5.0}, {13, 2.5}};
    if (i % 4 == 2) c.options.sampling.repetition_penalty = 1.2;  // over its prompt, beside other requests' prompts
    if (i == 2) c.options.min_tokens = c.options.max_new_tokens / 2;        // EOS banned for its first picks
    if (i == 6) c.options.stop_token_ids = {c.prompt[1], c.prompt.back()};  // may end before its limit
    c.join_at_step = join[i];
    cases.push_back(std::move(c));
  }
  return cases;
}

void ExpectBatchEqualsSolo(const std::string& device_spec, bool sampled, int64_t prefill_chunk) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  std::unique_ptr<LocalModel> model = Open(device_spec);
  ASSERT_NE(model, nullptr);
  const std::vector<Case> cases = EightCases(sampled);
  ASSERT_EQ(cases.size(), 8u);

  std::vector<GenerateResult> solo;
  for (const Case& c : cases) {
    auto r = Generate(model->engine(), c.prompt, c.options);
    ASSERT_TRUE(r.ok()) << r.status();
    solo.push_back(std::move(r).value());
  }

  BatchRunner runner(model->engine(), BatchOptions{.prefill_chunk_tokens = prefill_chunk});
  std::vector<std::unique_ptr<BatchRequest>> requests;
  std::vector<std::vector<std::pair<int32_t, bool>>> streamed(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    requests.push_back(std::make_unique<BatchRequest>(100 + i, model->config(), cases[i].prompt, cases[i].options,
                                                      [&streamed, i](int32_t id, bool last) {
                                                        streamed[i].push_back({id, last});
                                                      }));
  }
  size_t joined = 0, finished = 0;
  int most_decoded_together = 0;
  for (int step = 0; finished < cases.size(); ++step) {
    ASSERT_LT(step, 10000) << "the batch never drained";
    while (joined < cases.size() && cases[joined].join_at_step <= step) {
      ASSERT_TRUE(runner.Add(requests[joined].get()).ok());
      ++joined;
    }
    const BatchRunner::Plan plan = runner.Schedule();
    if (plan.empty()) continue;  // nothing to run until the next request joins
    if (plan.kind == ForwardKind::kDecode) {
      most_decoded_together = std::max(most_decoded_together, static_cast<int>(plan.requests.size()));
    }
    ASSERT_TRUE(runner.Run(plan).ok());
    for (BatchRequest* done : runner.Postprocess(plan)) {
      ASSERT_TRUE(done->status().ok()) << done->status();
      runner.Remove(done);
      ++finished;
    }
  }
  EXPECT_GE(most_decoded_together, 5) << "the cases should overlap";
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const GenerateResult& batched = requests[i]->result();
    EXPECT_EQ(batched.tokens, solo[i].tokens);
    EXPECT_EQ(batched.stop_reason, solo[i].stop_reason);
    EXPECT_EQ(batched.last_logits, solo[i].last_logits);  // bit for bit
    EXPECT_EQ(batched.routing, solo[i].routing);
    EXPECT_EQ(batched.logprobs, solo[i].logprobs);  // bit for bit
    EXPECT_EQ(batched.prompt_logprobs, solo[i].prompt_logprobs);
    EXPECT_EQ(batched.prompt_logprobs.size(), cases[i].options.prompt_logprobs ? cases[i].prompt.size() - 1 : 0);
    if (cases[i].options.logprobs >= 0) {
      ASSERT_EQ(batched.logprobs.size(), batched.tokens.size());
      for (size_t t = 0; t < batched.tokens.size(); ++t) {
        const PositionLogprobs& lp = batched.logprobs[t];
        EXPECT_EQ(lp.token.id, batched.tokens[t]);
        ASSERT_EQ(lp.top.size(), static_cast<size_t>(cases[i].options.logprobs));
        EXPECT_LE(lp.token.logprob, 0.0f);
        if (lp.top.empty()) continue;
        EXPECT_GE(lp.top[0].logprob, lp.token.logprob);
        if (cases[i].options.sampling.temperature == 0 && !cases[i].options.sampling.ChangesLogits() &&
            cases[i].options.min_tokens == 0) {
          EXPECT_EQ(lp.top[0].id, lp.token.id);  // greedy picks the likeliest (of the logits before any change)
        }
      }
    } else {
      EXPECT_TRUE(batched.logprobs.empty());
    }
    ASSERT_EQ(streamed[i].size(), batched.tokens.size());
    for (size_t t = 0; t < streamed[i].size(); ++t) {
      EXPECT_EQ(streamed[i][t].first, batched.tokens[t]);
      EXPECT_EQ(streamed[i][t].second, t + 1 == streamed[i].size());
    }
  }
}

// A prompt's logprobs are those of its prefixes: row i's logits are bitwise the last logits of prompt[0..i], whatever
// the chunk the row ran in.
void ExpectPromptLogprobsOfEachPrefix(const std::string& device_spec) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  std::unique_ptr<LocalModel> model = Open(device_spec);
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts();
  ASSERT_GE(prompts.size(), 2u);
  std::vector<int32_t> prompt = prompts[0];
  prompt.insert(prompt.end(), prompts[1].begin(), prompts[1].end());  // 32 tokens
  GenerateOptions options;
  options.max_new_tokens = 1;
  options.logprobs = 3;
  options.prompt_logprobs = true;
  auto whole = Generate(model->engine(), prompt, options);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ(whole->prompt_logprobs.size(), prompt.size() - 1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    GenerateOptions prefix;
    prefix.max_new_tokens = 0;
    prefix.keep_last_logits = true;
    auto r = Generate(model->engine(), std::span<const int32_t>(prompt).first(i + 1), prefix);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(whole->prompt_logprobs[i], LogprobsOf(r->last_logits, prompt[i + 1], 3)) << "prompt token " << i + 1;
  }
  // Without generating: the same, and through a BatchRunner's chunks of 5 rows.
  options.max_new_tokens = 0;
  auto alone = Generate(model->engine(), prompt, options);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->prompt_logprobs, whole->prompt_logprobs);
  EXPECT_TRUE(alone->logprobs.empty());
  BatchRunner runner(model->engine(), BatchOptions{.prefill_chunk_tokens = 5});
  // A request decoding meanwhile, so that the prompt goes in chunks.
  BatchRequest decoding(1, model->config(), prompts[2], GenerateOptions{.max_new_tokens = 40, .ignore_eos = true});
  options.max_new_tokens = 1;
  BatchRequest scored(2, model->config(), prompt, options);
  ASSERT_TRUE(runner.Add(&decoding).ok());
  ASSERT_TRUE(runner.Add(&scored).ok());
  for (int step = 0; !scored.finished(); ++step) {
    ASSERT_LT(step, 1000);
    for (BatchRequest* done : runner.Step()) runner.Remove(done);
  }
  EXPECT_FALSE(decoding.finished()) << "the prompt should have gone in chunks between decode steps";
  ASSERT_TRUE(scored.status().ok()) << scored.status();
  EXPECT_EQ(scored.result().prompt_logprobs, whole->prompt_logprobs);
  EXPECT_EQ(scored.result().logprobs, whole->logprobs);
}

TEST(BatchingTest, LogitChangesPickAsTheHostRuleOnCpu) { testing::ExpectLogitChangesPickAsTheHostRule("cpu", 24); }
TEST(BatchingTest, LogitChangesPickAsTheHostRuleOnTheMockGpu) {
  testing::ExpectLogitChangesPickAsTheHostRule("mock-gpu", 24);
}

TEST(BatchingTest, PromptLogprobsAreThoseOfEachPrefixOnCpu) { ExpectPromptLogprobsOfEachPrefix("cpu"); }
TEST(BatchingTest, PromptLogprobsAreThoseOfEachPrefixOnTheMockGpu) { ExpectPromptLogprobsOfEachPrefix("mock-gpu"); }

TEST(BatchingTest, GreedyRequestsDecodedTogetherGiveTheirSoloTokensOnCpu) { ExpectBatchEqualsSolo("cpu", false, 8); }
TEST(BatchingTest, SampledRequestsDecodedTogetherGiveTheirSoloTokensOnCpu) { ExpectBatchEqualsSolo("cpu", true, 64); }
TEST(BatchingTest, GreedyRequestsDecodedTogetherGiveTheirSoloTokensOnTheMockGpu) {
  ExpectBatchEqualsSolo("mock-gpu", false, 16);
}
TEST(BatchingTest, SampledRequestsDecodedTogetherGiveTheirSoloTokensOnTheMockGpu) {
  ExpectBatchEqualsSolo("mock-gpu", true, 16);
}

TEST(BatchingTest, APromptGoesInChunksBetweenDecodeSteps) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  std::unique_ptr<LocalModel> model = Open("cpu");
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts();
  ASSERT_GE(prompts.size(), 2u);
  GenerateOptions options;
  options.max_new_tokens = 12;
  options.ignore_eos = true;
  BatchRequest running(1, model->config(), prompts[0], options),
      arriving(2, model->config(), std::vector<int32_t>(40, 5), options);
  BatchRunner runner(model->engine(), BatchOptions{.prefill_chunk_tokens = 16});
  ASSERT_TRUE(runner.Add(&running).ok());
  while (running.result().tokens.size() < 2) runner.Step();
  ASSERT_TRUE(runner.Add(&arriving).ok());
  // 40 prompt tokens in chunks of 16, 16 and 8, each followed by a decode step of the running request.
  std::vector<std::pair<ForwardKind, size_t>> steps;
  for (int i = 0; i < 6; ++i) {
    const BatchRunner::Plan plan = runner.Schedule();
    steps.push_back({plan.kind, plan.ids.empty() ? 0 : plan.ids[0].size()});
    ASSERT_TRUE(runner.Run(plan).ok());
    runner.Postprocess(plan);
  }
  const std::vector<std::pair<ForwardKind, size_t>> expected = {{ForwardKind::kPrefill, 16}, {ForwardKind::kDecode, 1},
                                                                {ForwardKind::kPrefill, 16}, {ForwardKind::kDecode, 1},
                                                                {ForwardKind::kPrefill, 8},  {ForwardKind::kDecode, 1}};
  EXPECT_EQ(steps, expected);
  EXPECT_EQ(arriving.result().tokens.size(), 2u);  // its first token came with its last chunk
  const BatchRunner::Plan both = runner.Schedule();
  EXPECT_EQ(both.requests.size(), 2u);
}

// A long request does not starve a short one that arrives after it: the short one is prefilled between the
// long one's decode steps and decoded beside it, so it ends long before the long one does.
TEST(BatchingTest, AShortRequestArrivingLaterIsNotStarvedByALongOne) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  std::unique_ptr<LocalModel> model = Open("cpu");
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts();
  ASSERT_GE(prompts.size(), 2u);
  GenerateOptions long_options, short_options;
  long_options.max_new_tokens = 120;
  long_options.ignore_eos = true;
  short_options.max_new_tokens = 6;
  short_options.ignore_eos = true;
  std::vector<int32_t> short_prompt;  // 48 tokens: three chunks of 16
  for (int i = 0; i < 3; ++i) short_prompt.insert(short_prompt.end(), prompts[1].begin(), prompts[1].end());
  BatchRequest long_request(1, model->config(), prompts[0], long_options),
      short_request(2, model->config(), short_prompt, short_options);
  BatchRunner runner(model->engine(), BatchOptions{.prefill_chunk_tokens = 16});
  ASSERT_TRUE(runner.Add(&long_request).ok());
  while (long_request.result().tokens.size() < 10) runner.Step();
  ASSERT_TRUE(runner.Add(&short_request).ok());
  int steps = 0;
  while (!short_request.finished()) {
    for (BatchRequest* done : runner.Step()) runner.Remove(done);
    ASSERT_LT(++steps, 100);
  }
  // 3 prompt chunks, each followed by a decode step (the first token comes with the last chunk), then 5 more
  // decode steps: 3 + 2 + 5 = 10 steps.
  EXPECT_EQ(steps, 10);
  EXPECT_TRUE(short_request.status().ok());
  EXPECT_EQ(short_request.result().tokens.size(), 6u);
  EXPECT_FALSE(long_request.finished());
  EXPECT_EQ(long_request.result().tokens.size(), 10u + 7u) << "the long request decoded all along";
}

// Each request's KV cache is allocated as it joins: one that does not fit the device is refused with the
// device's ResourceExhausted naming the cache, and the request already running goes on untouched.
TEST(BatchingTest, ARequestWhoseCacheDoesNotFitIsRefusedAndTheOthersRunOn) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  uint64_t in_use = 0;
  {
    std::unique_ptr<LocalModel> probe = Open("mock-gpu");
    ASSERT_NE(probe, nullptr);
    in_use = probe->device().memory_info().in_use;
  }
  // Room for the weights and workspace and about 2 MiB more: a short request's cache fits, a long one's not.
  const uint64_t mib = (in_use >> 20) + 3;
  std::unique_ptr<LocalModel> model = Open("mock-gpu:" + std::to_string(mib));
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts();
  ASSERT_GE(prompts.size(), 2u);
  GenerateOptions short_options, long_options;
  short_options.max_new_tokens = 8;
  short_options.ignore_eos = true;
  long_options.max_new_tokens = model->config().max_position_embeddings - 16;  // 4 KiB of cache per position
  const GenerateResult solo = *Generate(model->engine(), prompts[0], short_options);
  BatchRequest fits(1, model->config(), prompts[0], short_options),
      too_long(2, model->config(), prompts[1], long_options);
  BatchRunner runner(model->engine(), BatchOptions{});
  ASSERT_TRUE(runner.Add(&fits).ok());
  runner.Step();
  const absl::Status refused = runner.Add(&too_long);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_NE(refused.message().find("cache"), std::string::npos) << refused;
  EXPECT_EQ(runner.size(), 1u);
  while (!fits.finished()) runner.Step();
  EXPECT_TRUE(fits.status().ok()) << fits.status();
  EXPECT_EQ(fits.result().tokens, solo.tokens);
}

TEST(BatchingTest, ForwardBatchRefusesABadBatch) {
  if (!odmoe::testing::HaveSharedModel(kModel)) GTEST_SKIP() << "no ../shared/models/" << kModel;
  std::unique_ptr<LocalModel> model = Open("cpu");
  ASSERT_NE(model, nullptr);
  Engine& engine = model->engine();
  auto a = engine.NewSequence(8, 1);
  ASSERT_TRUE(a.ok());
  const std::vector<int32_t> two = {1, 2}, one = {1}, outside = {1 << 20};
  const BatchInput twice[2] = {{a->get(), one}, {a->get(), one}};
  absl::Status s = engine.ForwardBatch(twice, ForwardKind::kPrefill);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("same sequence"), std::string::npos) << s;
  const BatchInput decode_two[1] = {{a->get(), two}};
  s = engine.ForwardBatch(decode_two, ForwardKind::kDecode);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  const BatchInput bad_id[1] = {{a->get(), outside}};
  s = engine.ForwardBatch(bad_id, ForwardKind::kPrefill);
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  const std::vector<int32_t> nine(9, 3);
  const BatchInput too_long[1] = {{a->get(), nine}};
  s = engine.ForwardBatch(too_long, ForwardKind::kPrefill);
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_EQ((*a)->position(), 0) << "a refused batch advances no sequence";
  EXPECT_TRUE(absl::IsInvalidArgument(engine.ForwardBatch({}, ForwardKind::kDecode)));
}

}  // namespace
}  // namespace odmoe
