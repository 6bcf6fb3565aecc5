// odmoe-bench grammar: what structured output costs per pick (src/engine/output_grammar.h). For a vocabulary (a
// model's tokenizer, or N synthetic word-like tokens) it times the vocabulary's sorting once and the compiling
// of a JSON Schema and of a regex, then, at states along a JSON object, the schema's answer, a choice list and the
// regexes' answers, the walk that finds the tokens a state allows (the work of one pick whose grammar state
// changed; a pick inside a JSON string keeps the state and walks nothing, unless the string's length is bounded;
// a regex's stays the same only where its DFA's does, as in an unbounded loop). One JSON line per state, then a
// table.
#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/json_schema.h"
#include "src/engine/output_grammar.h"
#include "src/engine/pattern_dfa.h"
#include "src/model/model_config.h"
#include "src/model/tokenizer.h"

namespace odmoe::bench {
namespace {

// `n` tokens shaped like a BPE vocabulary's: half with a leading space, 1 to 8 letters, about one byte in six
// punctuation or a digit. Seeded: the same vocabulary for the same seed.
std::vector<std::string> SyntheticVocabulary(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::string letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  const std::string other = "{}[]:,\" \n0123456789-.\\/'!?";
  std::vector<std::string> bytes(static_cast<size_t>(n));
  for (std::string& b : bytes) {
    if (rng() % 2 == 0) b += ' ';
    for (int i = 1 + static_cast<int>(rng() % 8); i > 0; --i) {
      b += rng() % 6 == 0 ? other[rng() % other.size()] : letters[rng() % letters.size()];
    }
  }
  return bytes;
}

struct Row {
  std::string grammar, text;
  double walk_ms = 0;
  int64_t allowed = 0;
};

}  // namespace

absl::Status RunGrammar(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args, {"model", "synthetic-vocab", "seed", "repeat"}, {}));
  if (f.Has("model") == f.Has("synthetic-vocab")) {
    return absl::InvalidArgumentError("give one of --model DIR and --synthetic-vocab N");
  }
  ODMOE_ASSIGN_OR_RETURN(const int64_t repeat, f.Int("repeat", 20));
  ODMOE_ASSIGN_OR_RETURN(const int64_t seed, f.Int("seed", 1));
  if (repeat < 1) return absl::InvalidArgumentError(StrCat("--repeat must be >= 1, got ", repeat));
  std::string source;
  std::vector<std::string> bytes;
  if (auto dir = f.Get("model")) {
    ODMOE_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(*dir));
    ODMOE_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(*dir));
    const std::shared_ptr<const TokenVocabulary> v = TokenVocabulary::FromTokenizer(*tokenizer, config.vocab_size);
    for (int32_t id = 0; id < v->size(); ++id) bytes.push_back(v->bytes(id));
    source = *dir;
  } else {
    ODMOE_ASSIGN_OR_RETURN(const int64_t n, f.Int("synthetic-vocab", 0));
    if (n < 1 || n > (int64_t{1} << 22)) {
      return absl::InvalidArgumentError(StrCat("--synthetic-vocab must be in [1, 4194304], got ", n));
    }
    bytes = SyntheticVocabulary(n, static_cast<uint64_t>(seed));
    source = StrCat("synthetic:", n);
  }
  const Clock::time_point start = Clock::now();
  const TokenVocabulary vocabulary(bytes);
  const double sort_ms = SecondsSince(start) * 1e3;
  PrintJsonLine({{"bench", "grammar"}, {"vocabulary", source}, {"tokens", vocabulary.size()}, {"sort_ms", sort_ms}});

  // A schema of the kind a client sends: bounded strings, integers and numbers, a date pattern, an enum, an array
  // of objects, optional properties.
  constexpr char kSchema[] = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "nick": {"type": "string"},
      "born": {"type": "string", "pattern": "^\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])$"},
      "tags": {"type": "array", "maxItems": 8, "items": {"type": "object",
      "properties": {"k": {"enum": ["colour", "size", "shape"]},
                     "v": {"type": "number", "minimum": -1000, "exclusiveMaximum": 1000}},
      "required": ["k", "v"]}}},
      "required": ["name", "age", "tags"], "additionalProperties": false})";
  std::vector<double> compile_times;
  std::optional<GrammarProgram> program;
  for (int64_t r = 0; r < repeat; ++r) {
    const Clock::time_point t = Clock::now();
    absl::StatusOr<GrammarProgram> compiled = CompileJsonSchema(kSchema);
    compile_times.push_back(SecondsSince(t) * 1e3);
    if (!compiled.ok()) return compiled.status();
    program = *std::move(compiled);
  }
  const double compile_ms = Median(compile_times);
  const size_t schema_nodes = program->nodes.size();
  PrintJsonLine({{"bench", "grammar"}, {"schema_nodes", schema_nodes}, {"compile_ms", compile_ms}});

  // guided_regex: a sentence of a given shape, and a line of free text (the walk's worst case: most tokens go on).
  constexpr char kSentence[] = R"([A-Z][a-z]{1,8} (said|spake) unto [A-Z][a-z]{1,8}, "[^"\n]{1,60}"\.)";
  std::vector<double> regex_times;
  std::optional<PatternDfa> sentence_dfa;
  for (int64_t r = 0; r < repeat; ++r) {
    const Clock::time_point t = Clock::now();
    absl::StatusOr<PatternDfa> compiled = CompilePattern(kSentence, PatternScope::kWholeText);
    regex_times.push_back(SecondsSince(t) * 1e3);
    if (!compiled.ok()) return compiled.status();
    sentence_dfa = *std::move(compiled);
  }
  const double regex_compile_ms = Median(regex_times);
  PrintJsonLine(
      {{"bench", "grammar"}, {"regex_states", sentence_dfa->states()}, {"regex_compile_ms", regex_compile_ms}});
  absl::StatusOr<PatternDfa> line_dfa = CompilePattern("[^\n]{1,200}", PatternScope::kWholeText);
  if (!line_dfa.ok()) return line_dfa.status();

  const JsonObjectGrammar json;
  const StructuredGrammar schema(*std::move(program));
  const ChoiceGrammar choice({"Yes", "No", "Let there be light"});
  const StructuredGrammar sentence(GrammarProgram::Text(*std::move(sentence_dfa)));
  const StructuredGrammar line(GrammarProgram::Text(*std::move(line_dfa)));
  const std::vector<std::pair<const ByteGrammar*, std::string>> states = {
      {&json, ""},
      {&json, "{"},
      {&json, "{\"ke"},
      {&json, "{\"key\": "},
      {&json, "{\"key\": 12"},
      {&json, "{\"key\": \"some text"},
      {&json, "{\"key\": [true,\n  "},
      {&schema, ""},
      {&schema, "{\"name\": \"Ann"},
      {&schema, "{\"name\": \"Ann\", "},
      {&schema, "{\"name\": \"Ann\", \"age\": 4"},
      {&schema, "{\"name\": \"Ann\", \"age\": 42, \"born\": \"1983-1"},
      {&schema, "{\"name\": \"Ann\", \"age\": 42, \"tags\": [{\"k\": \"size\", \"v\": "},
      {&schema, "{\"name\": \"Ann\", \"age\": 42, \"tags\": [{\"k\": \"size\", \"v\": -12.5"},
      {&choice, ""},
      {&choice, "Let th"},
      {&sentence, ""},
      {&sentence, "Moses spake unto Aar"},
      {&sentence, "Moses spake unto Aaron, \"Go"},
      {&line, "And "},
  };
  std::vector<Row> rows;
  for (const auto& [grammar, text] : states) {
    GrammarState state = grammar->Start();
    for (const char c : text) {
      if (!grammar->Advance(state, static_cast<uint8_t>(c))) {
        return absl::InternalError(StrCat("the grammar refused its own example '", text, "'"));
      }
    }
    std::vector<char> allowed(bytes.size());
    std::vector<double> times;
    for (int64_t r = 0; r < repeat; ++r) {
      std::fill(allowed.begin(), allowed.end(), 0);
      const Clock::time_point t = Clock::now();
      vocabulary.MarkAllowed(*grammar, state, &allowed);
      times.push_back(SecondsSince(t) * 1e3);
    }
    const char* name = grammar == &json     ? "json_object"
                       : grammar == &schema ? "json_schema"
                       : grammar == &choice ? "choice"
                                            : "regex";
    Row row{name, text, Median(times), static_cast<int64_t>(std::count(allowed.begin(), allowed.end(), 1))};
    PrintJsonLine({{"bench", "grammar"},
                   {"vocabulary", source},
                   {"grammar", row.grammar},
                   {"text", row.text},
                   {"repeat", repeat},
                   {"walk_ms", row.walk_ms},
                   {"allowed", row.allowed}});
    rows.push_back(std::move(row));
  }
  int width = 5;
  for (const Row& r : rows) width = std::max(width, static_cast<int>(Json(r.text).dump().size()));
  std::printf(
      "\n%s: %lld tokens, sorted in %.1f ms; a schema of %zu nodes compiled in %.3f ms, a regex in %.3f ms\n"
      "%-12s %-*s %10s %10s\n",
      source.c_str(), static_cast<long long>(vocabulary.size()), sort_ms, schema_nodes, compile_ms, regex_compile_ms,
      "grammar", width, "after", "walk_ms", "allowed");
  for (const Row& r : rows) {
    std::string shown = Json(r.text).dump();
    std::printf("%-12s %-*s %10.3f %10lld\n", r.grammar.c_str(), width, shown.c_str(), r.walk_ms,
                static_cast<long long>(r.allowed));
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
