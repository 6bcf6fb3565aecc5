#include "tests/engine/golden_support.h"

#include <algorithm>
#include <cmath>

#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"

namespace odmoe::testing {

absl::StatusOr<Golden> LoadGolden(const std::string& model_dir) {
  const std::string path = model_dir + "/golden.json";
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ODMOE_ASSIGN_OR_RETURN(Json j, ParseJson(text, path));
  Golden g;
  for (const Json& c : j.at("cases")) {
    GoldenCase gc;
    gc.prompt_ids = c.at("prompt_ids").get<std::vector<int32_t>>();
    gc.last_logits = c.at("last_logits").get<std::vector<float>>();
    for (const Json& s : c.at("greedy")) {
      const Json& top5 = s.at("top5");
      gc.greedy.push_back({s.at("id").get<int32_t>(), top5[0][1].get<double>() - top5[1][1].get<double>()});
    }
    gc.routing_sequence = c.at("routing_sequence").get<std::vector<int32_t>>();
    for (const Json& pos : c.at("routing")) {
      std::vector<GoldenRouting> layers;
      for (const Json& l : pos) {
        layers.push_back({l.at("experts").get<std::vector<int32_t>>(), l.at("margin").get<double>()});
      }
      gc.routing.push_back(std::move(layers));
    }
    if (c.contains("text")) gc.text = c.at("text").get<std::string>();
    g.cases.push_back(std::move(gc));
  }
  return g;
}

void CheckGolden(const GenerateFn& generate, const Golden& golden, const GoldenThresholds& t,
                 const std::string& label, GoldenCounts& counts) {
  for (size_t ci = 0; ci < golden.cases.size(); ++ci) {
    const GoldenCase& gc = golden.cases[ci];
    SCOPED_TRACE(label + ", case " + std::to_string(ci));
    ++counts.cases;

    // Logits at the last prompt position, and the greedy continuation.
    GenerateOptions opt;
    opt.max_new_tokens = static_cast<int64_t>(gc.greedy.size());
    opt.ignore_eos = true;
    opt.keep_last_logits = true;
    auto r = generate(gc.prompt_ids, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->last_logits.size(), gc.last_logits.size());
    double max_err = 0, max_ref = 0;
    for (size_t i = 0; i < gc.last_logits.size(); ++i) {
      ASSERT_TRUE(std::isfinite(r->last_logits[i])) << "logit " << i << " is " << r->last_logits[i];
      max_err = std::max(max_err, std::fabs(static_cast<double>(r->last_logits[i]) - gc.last_logits[i]));
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(gc.last_logits[i])));
    }
    const double ratio = max_err / max_ref;
    counts.max_logit_ratio = std::max(counts.max_logit_ratio, ratio);
    counts.logits += static_cast<int64_t>(gc.last_logits.size());
    EXPECT_LE(ratio, t.logit_ratio) << "last_logits: max abs error " << max_err << " / max abs golden " << max_ref;
    for (size_t s = 0; s < gc.greedy.size() && s < r->tokens.size(); ++s) {
      if (gc.greedy[s].margin < t.greedy_margin) break;
      EXPECT_EQ(r->tokens[s], gc.greedy[s].id) << "greedy step " << s;
      if (r->tokens[s] != gc.greedy[s].id) break;
      ++counts.tokens;
    }

    // Routing of routing_sequence fed in one pass.
    GenerateOptions ropt;
    ropt.max_new_tokens = 0;
    ropt.record_routing = true;
    auto rr = generate(gc.routing_sequence, ropt);
    ASSERT_TRUE(rr.ok()) << rr.status();
    ASSERT_EQ(rr->routing.size(), gc.routing.size());
    for (size_t p = 0; p < gc.routing.size(); ++p) {
      ASSERT_EQ(rr->routing[p].size(), gc.routing[p].size()) << "position " << p;
      for (size_t l = 0; l < gc.routing[p].size(); ++l) {
        const GoldenRouting& want = gc.routing[p][l];
        if (want.margin <= t.routing_margin) {
          ++counts.routing_skipped;
          continue;
        }
        std::vector<int32_t> a = rr->routing[p][l], b = want.experts;
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        EXPECT_EQ(a, b) << "routing at position " << p << ", sparse layer " << l;
        ++counts.routing;
      }
    }
  }
}

GoldenCounts CheckGolden(LocalModel& model, const Golden& golden, const GoldenThresholds& t,
                         const std::string& label) {
  GoldenCounts counts;
  CheckGolden(
      [&](const std::vector<int32_t>& prompt, const GenerateOptions& options) {
        return Generate(model.engine(), prompt, options);
      },
      golden, t, label, counts);
  return counts;
}

}  // namespace odmoe::testing
