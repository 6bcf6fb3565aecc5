// Fuzzes structured output's JSON Schema and regular expression compilers and the grammars they give
// (src/engine/json_schema.h, src/engine/pattern_dfa.h, src/engine/output_grammar.h): the input up to its first NUL
// byte is a schema, and also a whole-text regular expression (guided_regex), the rest a text to read with each.
// Checked: a refused schema or expression is InvalidArgument with a message; the grammar of an accepted one reads
// the text byte by byte without crashing; a text it takes whole is JSON (valid UTF-8 included; a number past a
// double, which nlohmann's parser refuses, apart), for json_object's grammar an object, for an expression valid
// UTF-8; MarkAllowed over a small vocabulary, at the state the text reached, equals feeding each token alone.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "src/common/json.h"
#include "src/common/utf8.h"
#include "src/engine/json_schema.h"
#include "src/engine/output_grammar.h"
#include "src/engine/pattern_dfa.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

// What a whole answer of a grammar is.
enum class Whole { kJson, kJsonObject, kUtf8 };

// Reads `text` with `g`; checks what a whole answer must be, and the vocabulary walk where the text stopped.
void Read(const odmoe::ByteGrammar& g, std::string_view text, Whole whole) {
  odmoe::GrammarState s = g.Start();
  size_t taken = 0;
  for (; taken < text.size(); ++taken) {
    odmoe::GrammarState next = s;
    if (!g.Advance(next, static_cast<uint8_t>(text[taken]))) break;
    s = next;
  }
  if (g.Complete(s) && whole == Whole::kUtf8) {
    Check(!odmoe::FirstInvalidUtf8(text.substr(0, taken)).has_value());
  } else if (g.Complete(s)) {
    // JSON (RFC 8259) puts no bound on a number's size; nlohmann's parser refuses one past a double
    // (out_of_range.406), and that alone.
    absl::StatusOr<odmoe::Json> parsed = odmoe::ParseJson(text.substr(0, taken), "answer");
    Check(parsed.ok() || parsed.status().message().find("out_of_range.406") != std::string_view::npos);
    if (whole == Whole::kJsonObject && parsed.ok()) Check(parsed->is_object());
  }
  static const odmoe::TokenVocabulary vocabulary(std::vector<std::string>{
      "{", "}", "[", "]", ":", ",", "\"", " ", "\n", "\t", "0", "1", "-", ".", "e", "true", "false", "null", "{\"",
      "\":", "\",", "\"}", "a", "ab", "\\", "\\u00", "\xc3", "\xa9", "\xc3\xa9", "\xe2\x82\xac", "\xff", ""});
  std::vector<char> allowed(static_cast<size_t>(vocabulary.size()), 0);
  vocabulary.MarkAllowed(g, s, &allowed);
  for (int32_t id = 0; id < vocabulary.size(); ++id) {
    odmoe::GrammarState t = s;
    bool ok = !vocabulary.bytes(id).empty();
    for (const char c : vocabulary.bytes(id)) ok = ok && g.Advance(t, static_cast<uint8_t>(c));
    Check(ok == (allowed[static_cast<size_t>(id)] != 0));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view schema = input.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);
  absl::StatusOr<odmoe::GrammarProgram> program = odmoe::CompileJsonSchema(schema);
  if (!program.ok()) {
    Check(program.status().code() == absl::StatusCode::kInvalidArgument && !program.status().message().empty());
  } else {
    Read(odmoe::StructuredGrammar(*std::move(program)), text, Whole::kJson);
  }
  absl::StatusOr<odmoe::PatternDfa> regex = odmoe::CompilePattern(schema, odmoe::PatternScope::kWholeText);
  if (!regex.ok()) {
    Check(regex.status().code() == absl::StatusCode::kInvalidArgument && !regex.status().message().empty());
  } else {
    Read(odmoe::StructuredGrammar(odmoe::GrammarProgram::Text(*std::move(regex))), text, Whole::kUtf8);
  }
  Read(odmoe::JsonObjectGrammar(), text, Whole::kJsonObject);
  return 0;
}
