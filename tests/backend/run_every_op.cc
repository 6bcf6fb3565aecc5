// RunEveryOp: see run_every_op.h.
#include "tests/backend/run_every_op.h"

#include <memory>
#include <random>
#include <string_view>

#include "gtest/gtest.h"
#include "src/common/dtype.h"

namespace odmoe {
namespace {

std::unique_ptr<Buffer> Alloc(Device& device, size_t bytes, std::string_view tag = "test") {
  auto buffer = device.Allocate(bytes, tag);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? std::move(*buffer) : nullptr;
}

template <typename T>
std::unique_ptr<Buffer> Upload(Device& device, const std::vector<T>& host) {
  auto buffer = Alloc(device, host.size() * sizeof(T));
  device.CopyToDevice(buffer->data(), host.data(), host.size() * sizeof(T), nullptr);
  return buffer;
}

}  // namespace

std::vector<std::vector<uint8_t>> RunEveryOp(Device& device) {
  std::mt19937 rng(4);
  auto floats = [&](size_t count, float scale) {
    std::vector<float> v(count);
    for (auto& f : v) f = std::uniform_real_distribution<float>(-scale, scale)(rng);
    return v;
  };
  auto bf16 = [&](size_t count) {
    std::vector<uint16_t> v(count);
    for (auto& h : v) h = F32ToBf16(std::uniform_real_distribution<float>(-1, 1)(rng));
    return v;
  };
  auto half = [&](size_t count) {
    std::vector<uint16_t> v(count);
    for (auto& h : v) h = F32ToF16(std::uniform_real_distribution<float>(-1, 1)(rng));
    return v;
  };
  const int64_t n = 3, vocab = 17, hidden = 36, heads = 4, kv_heads = 2, head_dim = 32, past = 5, experts = 8, k = 2;
  std::vector<std::vector<uint8_t>> results;
  auto keep = [&](const Buffer& buffer) {
    std::vector<uint8_t> host(buffer.size());
    device.CopyToHost(host.data(), buffer.data(), buffer.size(), nullptr);
    results.push_back(host);
  };

  auto ids = Upload(device, std::vector<int32_t>{4, 16, 0});
  auto table = Upload(device, bf16(vocab * hidden));
  auto h = Alloc(device, n * hidden * 4);
  device.Embedding(ids->as<int32_t>(), n, WeightRef{table->data(), DType::kBF16}, hidden, h->as<float>(), nullptr);
  keep(*h);
  auto norm_w = Upload(device, half(hidden));
  device.RmsNorm(h->as<float>(), WeightRef{norm_w->data(), DType::kF16}, n, hidden, 1e-6f, h->as<float>(), nullptr);
  keep(*h);
  auto w = Upload(device, bf16(heads * head_dim * hidden));
  auto bias = Upload(device, floats(heads * head_dim, 0.1f));
  auto q = Alloc(device, n * heads * head_dim * 4);
  device.MatMul(h->as<float>(), WeightRef{w->data(), DType::kBF16}, WeightRef{bias->data(), DType::kF32}, n, hidden,
                heads * head_dim, q->as<float>(), nullptr);
  keep(*q);
  auto positions = Upload(device, std::vector<int32_t>{5, 6, 7});
  device.Rope(q->as<float>(), positions->as<int32_t>(), n, heads, head_dim, 10000.0, nullptr);
  keep(*q);
  auto k_cache = Upload(device, floats((past + n) * kv_heads * head_dim, 1.0f));
  auto v_cache = Upload(device, floats((past + n) * kv_heads * head_dim, 1.0f));
  auto attn = Alloc(device, n * heads * head_dim * 4);
  device.Attention(q->as<float>(), KvCacheRef{k_cache->data()}, KvCacheRef{v_cache->data()}, n, past, heads, kv_heads,
                   head_dim, 0.17f, attn->as<float>(), nullptr);
  keep(*attn);
  auto logits = Upload(device, floats(n * experts, 3.0f));
  auto top_ids = Alloc(device, n * k * 4);
  auto top_w = Alloc(device, n * k * 4);
  device.RouterTopK(logits->as<float>(), n, experts, k, true, top_ids->as<int32_t>(), top_w->as<float>(), nullptr);
  keep(*top_ids);
  keep(*top_w);
  auto up = Upload(device, floats(n * heads * head_dim, 1.0f));
  device.SwiGlu(attn->as<float>(), up->as<float>(), n * heads * head_dim, attn->as<float>(), nullptr);
  keep(*attn);
  device.Add(up->as<float>(), n * heads * head_dim, attn->as<float>(), nullptr);
  keep(*attn);
  auto rows = Upload(device, std::vector<int32_t>{2, 0, 2, 1});
  auto gathered = Alloc(device, 4 * hidden * 4);
  device.GatherRows(h->as<float>(), rows->as<int32_t>(), 4, hidden, gathered->as<float>(), nullptr);
  keep(*gathered);
  auto scale = Upload(device, floats(4, 2.0f));
  device.ScatterAddScaled(gathered->as<float>(), rows->as<int32_t>(), scale->as<float>(), 4, hidden, true,
                          h->as<float>(), nullptr);
  keep(*h);
  // Greedy, sampled with top-k and with top-p: one row each, over `vocab` logits.
  auto token_logits = Upload(device, floats(3 * vocab, 2.0f));
  // A repetition penalty and a bias on row 1, a penalty of both kinds on row 2 (results stay finite).
  auto changes = Upload(
      device, std::vector<LogitChange>{{.index = static_cast<int32_t>(vocab + 3), .penalty = 1.3f},
                                       {.index = static_cast<int32_t>(vocab + 4), .delta = 0.5f},
                                       {.index = static_cast<int32_t>(2 * vocab), .penalty = 0.8f, .delta = -2.0f}});
  device.ChangeLogits(token_logits->as<float>(), changes->as<LogitChange>(), 3, nullptr);
  keep(*token_logits);
  auto choices = Upload(device, std::vector<TokenChoice>{{}, {0.8f, 5, 1.0f, 0.6f}, {1.3f, 0, 0.7f, 0.2f}});
  auto tokens = Alloc(device, 3 * 4);
  device.SelectTokens(token_logits->as<float>(), 3, vocab, choices->as<TokenChoice>(), tokens->as<int32_t>(), nullptr);
  keep(*tokens);
  auto copy = Alloc(device, h->size());
  device.CopyOnDevice(copy->data(), h->data(), h->size(), nullptr);
  keep(*copy);
  return results;
}

}  // namespace odmoe
