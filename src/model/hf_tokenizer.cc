#include "src/model/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <queue>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "unicode/locid.h"
#include "unicode/normalizer2.h"
#include "unicode/regex.h"
#include "unicode/uchar.h"
#include "unicode/unistr.h"
#include "unicode/utf8.h"

// The pipeline mirrors Hugging Face tokenizers (tokenizers/src/tokenizer/{mod.rs,added_vocabulary.rs},
// models/bpe/{model.rs,word.rs}, pre_tokenizers/{byte_level.rs,split.rs}, processors/template.rs); the comments
// name the part each piece follows.

namespace odmoe {
namespace {

// ---- errors ---------------------------------------------------------------------------------------------------

absl::Status FieldError(std::string_view where, std::string_view field, std::string_view problem) {
  return absl::FailedPreconditionError(StrCat(where, ": field '", field, "': ", problem));
}
absl::Status Unsupported(std::string_view where, std::string_view field, std::string_view problem) {
  return absl::UnimplementedError(StrCat(where, ": field '", field, "': ", problem));
}

// The string at `key` of `object` (`path` names the object in messages); `fallback` when absent or null.
absl::StatusOr<std::string> StringField(const Json& object, std::string_view key, std::string_view where,
                                        std::string_view path, std::string_view fallback = "") {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) {
    return FieldError(where, StrCat(path, key), StrCat("expected a string, got ", JsonTypeName(*it)));
  }
  return it->get<std::string>();
}
absl::StatusOr<bool> BoolField(const Json& object, std::string_view key, std::string_view where, std::string_view path,
                               bool fallback) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return FieldError(where, StrCat(path, key), StrCat("expected true or false, got ", JsonTypeName(*it)));
  }
  return it->get<bool>();
}
absl::StatusOr<const Json*> ObjectField(const Json& object, std::string_view key, std::string_view where,
                                        std::string_view path) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  if (!it->is_object()) {
    return FieldError(where, StrCat(path, key), StrCat("expected an object, got ", JsonTypeName(*it)));
  }
  return &*it;
}

// ---- the byte-level alphabet (GPT-2's bytes_to_unicode; tokenizers pre_tokenizers/byte_level.rs) --------------

// Printable Latin-1 bytes stand for themselves; the other 68 map, in byte order, to U+0100 and up.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;          // UTF-8 of the character standing for each byte
  std::unordered_map<UChar32, uint8_t> char_to_byte;  // and back
};

const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet* alphabet = [] {
    auto* a = new ByteLevelAlphabet;
    UChar32 next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const UChar32 c = printable ? b : next++;
      icu::UnicodeString(c).toUTF8String(a->byte_to_char[b]);
      a->char_to_byte[c] = static_cast<uint8_t>(b);
    }
    return a;
  }();
  return *alphabet;
}

}  // namespace

std::string ByteLevelChar(uint8_t byte) { return Alphabet().byte_to_char[byte]; }

namespace {

// The bytes a token string stands for, as the ByteLevel decoder reads it: each character mapped back to its
// byte when all of them are in the alphabet, else the string's own UTF-8 (an added token such as "\n\n").
std::string TokenStringBytes(std::string_view token) {
  const icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(token.data(), token.size()));
  std::string bytes;
  const auto& to_byte = Alphabet().char_to_byte;
  for (int32_t i = 0; i < u.length(); i = u.moveIndex32(i, 1)) {
    auto it = to_byte.find(u.char32At(i));
    if (it == to_byte.end()) return std::string(token);
    bytes.push_back(static_cast<char>(it->second));
  }
  return bytes;
}

// ---- regular expressions -----------------------------------------------------------------------------------------

// `pattern` for ICU with Oniguruma's meaning: \s and \S are Unicode White_Space (ICU's \s lacks U+000B and
// U+0085), inside a character class too.
std::string OnigurumaToIcu(std::string_view pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char c = pattern[++i];
      if (c == 's') {
        out += "\\p{White_Space}";
      } else if (c == 'S') {
        out += "\\P{White_Space}";
      } else {
        out += '\\';
        out += c;
      }
    } else {
      out += pattern[i];
    }
  }
  return out;
}

// ICU quotes a literal between \Q and \E; a literal \E is written \E\\E\Q.
std::string QuoteLiteral(std::string_view text) {
  std::string out = "\\Q";
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.substr(i, 2) == "\\E") {
      out += "\\E\\\\E\\Q";
      ++i;
    } else {
      out += text[i];
    }
  }
  return out + "\\E";
}

absl::StatusOr<std::unique_ptr<icu::RegexPattern>> CompileRegex(const std::string& icu_pattern,
                                                                std::string_view original, std::string_view where,
                                                                std::string_view field) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError parse_error;
  std::unique_ptr<icu::RegexPattern> pattern(
      icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(icu_pattern), 0, parse_error, status));
  if (U_FAILURE(status)) {
    return Unsupported(where, field,
                       StrCat("the regular expression '", original, "' does not compile (", u_errorName(status),
                              " at offset ", parse_error.offset, ")"));
  }
  return pattern;
}

// GPT-2's pre-tokenizer pattern, which ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- the pipeline's steps ------------------------------------------------------------------------------------

enum class Normalization { kNfc, kNfd, kNfkc, kNfkd, kLowercase };

// One pre-tokenizer step: a regex split, or the byte-level mapping.
struct PreTokenizeStep {
  enum Kind { kSplit, kByteLevel } kind = kSplit;
  std::unique_ptr<icu::RegexPattern> pattern;  // kSplit, and kByteLevel with use_regex
  bool remove_matches = false;                 // kSplit: behavior "Removed" (else "Isolated")
  bool invert = false;                         // kSplit: the pieces between matches are the matches
  bool add_prefix_space = false;               // kByteLevel
};

using Pieces = std::vector<icu::UnicodeString>;

// Splits each piece at `pattern`'s matches (split.rs with SplitDelimiterBehavior::Isolated / Removed): matches
// and the text between them become pieces of their own; empty pieces are dropped.
Pieces SplitPieces(const Pieces& in, const icu::RegexPattern& pattern, bool remove_matches, bool invert) {
  Pieces out;
  UErrorCode status = U_ZERO_ERROR;
  std::unique_ptr<icu::RegexMatcher> matcher(pattern.matcher(status));
  for (const icu::UnicodeString& piece : in) {
    matcher->reset(piece);
    int32_t last = 0;
    const auto emit = [&](int32_t from, int32_t to, bool is_match) {
      if (to <= from) return;
      if (remove_matches && is_match != invert) return;
      out.emplace_back(piece, from, to - from);
    };
    while (matcher->find(status) && U_SUCCESS(status)) {
      const int32_t start = matcher->start(status);
      const int32_t end = matcher->end(status);
      if (end == start) {  // an empty match splits nothing
        continue;
      }
      emit(last, start, false);
      emit(start, end, true);
      last = end;
    }
    emit(last, piece.length(), false);
  }
  return out;
}

// ---- added tokens (added_vocabulary.rs) ---------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;       // the match takes the whitespace before it
  bool rstrip = false;       // and after it
  bool single_word = false;  // matches only between non-word characters
};

bool IsWordChar(UChar32 c) { return u_isalnum(c) || c == '_'; }

// The code point that ends just before byte `at` of `s`, and the one at `at` (U+FFFD where the bytes are not
// well-formed). REQUIRES: `s` shorter than 2^31 bytes.
UChar32 CodePointBefore(std::string_view s, size_t at) {
  int32_t i = static_cast<int32_t>(at);
  UChar32 c;
  U8_PREV(s.data(), 0, i, c);
  return c < 0 ? 0xFFFD : c;
}
UChar32 CodePointAt(std::string_view s, size_t at) {
  int32_t i = static_cast<int32_t>(at);
  UChar32 c;
  U8_NEXT(s.data(), i, static_cast<int32_t>(s.size()), c);
  return c < 0 ? 0xFFFD : c;
}

// The key of the merge of (left, right) in Impl::merges.
uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

// ---- the tokenizer ----------------------------------------------------------------------------------------------

struct HfTokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;  // token string (byte-level alphabet) -> id
  // What each id decodes to (ByteLevel's bytes; "" for special tokens and unused ids), made once at load so
  // that decoding a token is a lookup.
  std::vector<std::string> id_bytes;
  // (left id, right id) -> (rank, merged id), the key packed as left << 32 | right.
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool ignore_merges = false;  // a word that is a whole token is taken as it is
  int32_t unk_id = -1;

  std::vector<AddedToken> added;                               // by content length, longest first
  std::unordered_map<int32_t, const AddedToken*> added_by_id;  // into `added`
  std::array<std::vector<const AddedToken*>, 256> added_by_first_byte;

  std::vector<Normalization> normalizers;
  std::vector<PreTokenizeStep> pre_tokenizers;
  // EncodeForModel: the ids before and after the text (TemplateProcessing's `single`).
  std::vector<int32_t> prefix_ids, suffix_ids;

  int32_t vocab_size = 0;
  int32_t bos_id = -1;
  int32_t eos_id = -1;

  // The added token that matches at byte `at` of `text`, longest first, with single_word checked.
  const AddedToken* AddedTokenAt(std::string_view text, size_t at) const;
  // Normalizes, pre-tokenizes and BPE-encodes text that holds no added token (mod.rs: do_normalize,
  // do_pre_tokenize, do_tokenize).
  void EncodeSegment(std::string_view text, std::vector<int32_t>* ids) const;
  // word.rs merge_all: merges the pair of lowest rank, leftmost first, until none applies.
  void EncodeWord(const std::string& word, std::vector<int32_t>* ids) const;
  std::string_view TokenBytes(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_bytes.size() ? std::string_view(id_bytes[id]) : "";
  }
  bool IsSpecial(int32_t id) const {
    auto it = added_by_id.find(id);
    return it != added_by_id.end() && it->second->special;
  }
  int32_t IdOf(std::string_view content) const;
};

const AddedToken* HfTokenizer::Impl::AddedTokenAt(std::string_view text, size_t at) const {
  for (const AddedToken* t : added_by_first_byte[static_cast<uint8_t>(text[at])]) {
    if (text.compare(at, t->content.size(), t->content) != 0) continue;
    if (t->single_word) {
      const size_t end = at + t->content.size();
      if (at > 0 && IsWordChar(CodePointBefore(text, at))) continue;
      if (end < text.size() && IsWordChar(CodePointAt(text, end))) continue;
    }
    return t;
  }
  return nullptr;
}

void HfTokenizer::Impl::EncodeWord(const std::string& word, std::vector<int32_t>* ids) const {
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  // One symbol per character; characters outside the vocabulary become unk, or are dropped without one.
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the current segmentation, -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols;
  for (size_t at = 0, length = 0; at < word.size(); at += length) {
    length = std::max<size_t>(1, Utf8SequenceLength(word, at));  // `word` is valid UTF-8 (made by ICU)
    auto it = vocab.find(word.substr(at, length));
    const int32_t id = it != vocab.end() ? it->second : unk_id;
    if (id < 0) continue;
    const int32_t n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, -1, true});
    if (n > 0) symbols[n - 1].next = n;
  }
  // Candidate merges (rank, position of the left symbol, merged id): the heap's top is the lowest rank, then the
  // leftmost. Entries go stale as symbols merge and are checked when they come up.
  using Candidate = std::tuple<int32_t, int32_t, int32_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  const auto consider = [&](int32_t left) {
    if (left < 0 || symbols[left].next < 0) return;
    auto it = merges.find(PairKey(symbols[left].id, symbols[symbols[left].next].id));
    if (it != merges.end()) heap.emplace(it->second.first, left, it->second.second);
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!heap.empty()) {
    const auto [rank, left, merged] = heap.top();
    heap.pop();
    Symbol& l = symbols[left];
    if (!l.alive || l.next < 0) continue;
    auto it = merges.find(PairKey(l.id, symbols[l.next].id));
    if (it == merges.end() || it->second.second != merged || it->second.first != rank) continue;
    Symbol& r = symbols[l.next];
    l.id = merged;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = left;
    consider(l.prev);
    consider(left);
  }
  for (const Symbol& s : symbols) {
    if (s.alive) ids->push_back(s.id);
  }
}

void HfTokenizer::Impl::EncodeSegment(std::string_view text, std::vector<int32_t>* ids) const {
  if (text.empty()) return;
  icu::UnicodeString s = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), text.size()));
  for (const Normalization n : normalizers) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* normalizer = nullptr;
    switch (n) {
      case Normalization::kNfc:
        normalizer = icu::Normalizer2::getNFCInstance(status);
        break;
      case Normalization::kNfd:
        normalizer = icu::Normalizer2::getNFDInstance(status);
        break;
      case Normalization::kNfkc:
        normalizer = icu::Normalizer2::getNFKCInstance(status);
        break;
      case Normalization::kNfkd:
        normalizer = icu::Normalizer2::getNFKDInstance(status);
        break;
      case Normalization::kLowercase:
        s.toLower(icu::Locale::getRoot());
        continue;
    }
    if (normalizer != nullptr && U_SUCCESS(status)) s = normalizer->normalize(s, status);
  }
  Pieces pieces = {s};
  for (const PreTokenizeStep& step : pre_tokenizers) {
    if (step.kind == PreTokenizeStep::kSplit) {
      pieces = SplitPieces(pieces, *step.pattern, step.remove_matches, step.invert);
      continue;
    }
    // ByteLevel (byte_level.rs): an optional leading space, the GPT-2 split, then each byte as its character.
    if (step.add_prefix_space) {
      for (icu::UnicodeString& p : pieces) {
        if (!p.startsWith(icu::UnicodeString(u' '))) p.insert(0, u' ');
      }
    }
    if (step.pattern != nullptr) pieces = SplitPieces(pieces, *step.pattern, false, false);
    for (icu::UnicodeString& p : pieces) {
      std::string bytes, mapped;
      p.toUTF8String(bytes);
      for (const char b : bytes) mapped += Alphabet().byte_to_char[static_cast<uint8_t>(b)];
      p = icu::UnicodeString::fromUTF8(mapped);
    }
  }
  std::string word;
  for (const icu::UnicodeString& p : pieces) {
    word.clear();
    p.toUTF8String(word);
    EncodeWord(word, ids);
  }
}

int32_t HfTokenizer::Impl::IdOf(std::string_view content) const {
  for (const AddedToken& t : added) {
    if (t.content == content) return t.id;
  }
  auto it = vocab.find(std::string(content));
  return it != vocab.end() ? it->second : -1;
}

namespace {

// ---- loading ------------------------------------------------------------------------------------------------------

// The `type` of the pipeline component `j` at `path` (a normalizer, pre-tokenizer or post-processor): "" when it
// is null (none). A "Sequence" has its elements (the array at `elements`) parsed by `parse(element, path)` here.
template <typename Parse>
absl::StatusOr<std::string> ComponentType(const Json& j, std::string_view where, const std::string& path,
                                          std::string_view elements, const Parse& parse) {
  if (j.is_null()) return std::string();
  if (!j.is_object()) return FieldError(where, path, StrCat("expected an object, got ", JsonTypeName(j)));
  ODMOE_ASSIGN_OR_RETURN(std::string type, StringField(j, "type", where, path + "."));
  if (type == "Sequence") {
    auto it = j.find(elements);
    if (it == j.end() || !it->is_array()) return FieldError(where, StrCat(path, ".", elements), "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      ODMOE_RETURN_IF_ERROR(parse((*it)[i], StrCat(path, ".", elements, "[", i, "]")));
    }
  }
  return type;
}

absl::Status ParseNormalizer(const Json& n, std::string_view where, const std::string& path,
                             std::vector<Normalization>* out) {
  ODMOE_ASSIGN_OR_RETURN(const std::string type,
                         ComponentType(n, where, path, "normalizers", [&](const Json& e, const std::string& p) {
                           return ParseNormalizer(e, where, p, out);
                         }));
  if (type.empty() || type == "Sequence") return absl::OkStatus();
  static const std::pair<std::string_view, Normalization> kKinds[] = {{"NFC", Normalization::kNfc},
                                                                      {"NFD", Normalization::kNfd},
                                                                      {"NFKC", Normalization::kNfkc},
                                                                      {"NFKD", Normalization::kNfkd},
                                                                      {"Lowercase", Normalization::kLowercase}};
  for (const auto& [name, kind] : kKinds) {
    if (type == name) {
      out->push_back(kind);
      return absl::OkStatus();
    }
  }
  return Unsupported(where, path + ".type",
                     StrCat("normalizer '", type, "'; odmoe implements NFC, NFD, NFKC, NFKD, Lowercase and Sequence"));
}

absl::Status ParsePreTokenizer(const Json& p, std::string_view where, const std::string& path,
                               std::vector<PreTokenizeStep>* out) {
  ODMOE_ASSIGN_OR_RETURN(const std::string type,
                         ComponentType(p, where, path, "pretokenizers", [&](const Json& e, const std::string& q) {
                           return ParsePreTokenizer(e, where, q, out);
                         }));
  if (type.empty() || type == "Sequence") return absl::OkStatus();
  PreTokenizeStep step;
  if (type == "ByteLevel") {
    step.kind = PreTokenizeStep::kByteLevel;
    ODMOE_ASSIGN_OR_RETURN(step.add_prefix_space, BoolField(p, "add_prefix_space", where, path + ".", true));
    ODMOE_ASSIGN_OR_RETURN(const bool use_regex, BoolField(p, "use_regex", where, path + ".", true));
    if (use_regex) {
      ODMOE_ASSIGN_OR_RETURN(step.pattern, CompileRegex(OnigurumaToIcu(kGpt2Pattern), kGpt2Pattern, where, path));
    }
  } else if (type == "Split") {
    ODMOE_ASSIGN_OR_RETURN(const Json* pattern, ObjectField(p, "pattern", where, path + "."));
    if (pattern == nullptr) return FieldError(where, path + ".pattern", "missing");
    std::string icu_pattern, original;
    if (pattern->contains("Regex")) {
      ODMOE_ASSIGN_OR_RETURN(original, StringField(*pattern, "Regex", where, path + ".pattern."));
      icu_pattern = OnigurumaToIcu(original);
    } else if (pattern->contains("String")) {
      ODMOE_ASSIGN_OR_RETURN(original, StringField(*pattern, "String", where, path + ".pattern."));
      icu_pattern = QuoteLiteral(original);
    } else {
      return FieldError(where, path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    ODMOE_ASSIGN_OR_RETURN(step.pattern, CompileRegex(icu_pattern, original, where, path + ".pattern"));
    ODMOE_ASSIGN_OR_RETURN(const std::string behavior, StringField(p, "behavior", where, path + "."));
    if (behavior == "Removed") {
      step.remove_matches = true;
    } else if (behavior != "Isolated") {
      return Unsupported(where, path + ".behavior",
                         StrCat("split behavior '", behavior, "'; odmoe implements Isolated and Removed"));
    }
    ODMOE_ASSIGN_OR_RETURN(step.invert, BoolField(p, "invert", where, path + ".", false));
  } else {
    return Unsupported(where, path + ".type",
                       StrCat("pre-tokenizer '", type, "'; odmoe implements ByteLevel, Split and Sequence"));
  }
  out->push_back(std::move(step));
  return absl::OkStatus();
}

// The ids of TemplateProcessing's `single` template before and after $A (processors/template.rs).
absl::Status ParsePostProcessor(const Json& p, std::string_view where, const std::string& path,
                                std::vector<int32_t>* prefix, std::vector<int32_t>* suffix) {
  ODMOE_ASSIGN_OR_RETURN(const std::string type,
                         ComponentType(p, where, path, "processors", [&](const Json& e, const std::string& q) {
                           return ParsePostProcessor(e, where, q, prefix, suffix);
                         }));
  if (type.empty() || type == "Sequence" || type == "ByteLevel") return absl::OkStatus();  // ByteLevel: offsets only
  if (type != "TemplateProcessing") {
    return Unsupported(
        where, path + ".type",
        StrCat("post-processor '", type, "'; odmoe implements ByteLevel, TemplateProcessing and Sequence"));
  }
  auto single = p.find("single");
  if (single == p.end() || !single->is_array()) return FieldError(where, path + ".single", "expected an array");
  auto specials = p.find("special_tokens");
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const Json& item = (*single)[i];
    const std::string item_path = StrCat(path, ".single[", i, "]");
    if (item.is_object() && item.contains("Sequence")) {
      if (seen_sequence) return Unsupported(where, item_path, "a second sequence in the single template");
      seen_sequence = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].is_object()) {
      return FieldError(where, item_path, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    ODMOE_ASSIGN_OR_RETURN(const std::string name,
                           StringField(item["SpecialToken"], "id", where, item_path + ".SpecialToken."));
    if (specials == p.end() || !specials->is_object() || !specials->contains(name) ||
        !(*specials)[name].contains("ids") || !(*specials)[name]["ids"].is_array()) {
      return FieldError(where, StrCat(path, ".special_tokens"), StrCat("no ids for '", name, "'"));
    }
    for (const Json& id : (*specials)[name]["ids"]) {
      if (!id.is_number_integer()) {
        return FieldError(where, StrCat(path, ".special_tokens.", name, ".ids"), "expected integers");
      }
      (seen_sequence ? suffix : prefix)->push_back(id.get<int32_t>());
    }
  }
  if (!seen_sequence) return FieldError(where, path + ".single", "the template has no $A sequence");
  return absl::OkStatus();
}

// A token id as tokenizer.json may hold one.
bool IsTokenId(const Json& id) {
  return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= (1 << 30);
}

// tokenizer_config.json's bos_token / eos_token: a string, {"content": ...} (a serialized AddedToken) or null.
absl::StatusOr<std::string> SpecialTokenName(const Json& config, std::string_view key, std::string_view where) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) return StringField(*it, "content", where, StrCat(key, "."));
  return FieldError(where, key, StrCat("expected a string or an object, got ", JsonTypeName(*it)));
}

}  // namespace

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  if (!FileExists(path)) return absl::NotFoundError(StrCat(path, ": no such file"));
  ODMOE_ASSIGN_OR_RETURN(const std::string json, ReadFileToString(path));
  std::string config;
  const std::string config_path = dir + "/tokenizer_config.json";
  if (FileExists(config_path)) {
    ODMOE_ASSIGN_OR_RETURN(config, ReadFileToString(config_path));
  }
  return FromJson(json, config, path);
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(std::string_view tokenizer_json,
                                                                   std::string_view tokenizer_config,
                                                                   const std::string& where) {
  ODMOE_ASSIGN_OR_RETURN(const Json root, ParseJson(tokenizer_json, where));
  if (!root.is_object()) {
    return absl::FailedPreconditionError(StrCat(where, ": expected a JSON object, got ", JsonTypeName(root)));
  }
  auto impl = std::make_unique<Impl>();

  // The model (models/bpe/model.rs).
  ODMOE_ASSIGN_OR_RETURN(const Json* model, ObjectField(root, "model", where, ""));
  if (model == nullptr) return FieldError(where, "model", "missing");
  ODMOE_ASSIGN_OR_RETURN(const std::string type, StringField(*model, "type", where, "model.", "BPE"));
  if (type != "BPE") {
    return Unsupported(where, "model.type", StrCat("'", type, "'; odmoe implements BPE tokenizer.json models"));
  }
  ODMOE_ASSIGN_OR_RETURN(const bool byte_fallback, BoolField(*model, "byte_fallback", where, "model.", false));
  if (byte_fallback) {
    return Unsupported(where, "model.byte_fallback",
                       "true (a SentencePiece-style BPE): odmoe reads such models from tokenizer.model");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    ODMOE_ASSIGN_OR_RETURN(const std::string affix, StringField(*model, key, where, "model."));
    if (!affix.empty()) return Unsupported(where, StrCat("model.", key), StrCat("'", affix, "'; odmoe needs ''"));
  }
  if (auto d = model->find("dropout");
      d != model->end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0)) {
    return Unsupported(where, "model.dropout", "BPE dropout is for training; odmoe needs null");
  }
  ODMOE_ASSIGN_OR_RETURN(impl->ignore_merges, BoolField(*model, "ignore_merges", where, "model.", false));
  ODMOE_ASSIGN_OR_RETURN(const Json* vocab, ObjectField(*model, "vocab", where, "model."));
  if (vocab == nullptr || vocab->empty()) return FieldError(where, "model.vocab", "missing or empty");
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab->items()) {
    if (!IsTokenId(id)) {
      return FieldError(where, StrCat("model.vocab.", token), "expected an id in [0, 2^30]");
    }
    const int32_t i = id.get<int32_t>();
    impl->vocab[token] = i;
    max_id = std::max(max_id, i);
  }
  auto merges = model->find("merges");
  if (merges == model->end() || !merges->is_array()) return FieldError(where, "model.merges", "expected an array");
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const Json& m = (*merges)[rank];
    std::string left, right;
    if (m.is_string()) {  // "left right"
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) return FieldError(where, StrCat("model.merges[", rank, "]"), "expected 'a b'");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["left", "right"]
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return FieldError(where, StrCat("model.merges[", rank, "]"), "expected \"a b\" or [\"a\", \"b\"]");
    }
    auto l = impl->vocab.find(left), r = impl->vocab.find(right), merged = impl->vocab.find(left + right);
    if (l == impl->vocab.end() || r == impl->vocab.end() || merged == impl->vocab.end()) {
      return FieldError(where, StrCat("model.merges[", rank, "]"),
                        StrCat("'", left, "' + '", right, "': a part or the merged token is not in the vocab"));
    }
    // A pair listed twice takes its last rank, as the HashMap tokenizers collects the merges into does.
    impl->merges.insert_or_assign(PairKey(l->second, r->second),
                                  std::make_pair(static_cast<int32_t>(rank), merged->second));
  }
  ODMOE_ASSIGN_OR_RETURN(const std::string unk, StringField(*model, "unk_token", where, "model."));
  if (!unk.empty()) {
    auto it = impl->vocab.find(unk);
    if (it == impl->vocab.end()) return FieldError(where, "model.unk_token", StrCat("'", unk, "' is not in the vocab"));
    impl->unk_id = it->second;
  }

  // Added tokens (added_vocabulary.rs).
  if (auto a = root.find("added_tokens"); a != root.end() && !a->is_null()) {
    if (!a->is_array()) return FieldError(where, "added_tokens", "expected an array");
    for (size_t i = 0; i < a->size(); ++i) {
      const Json& t = (*a)[i];
      const std::string path = StrCat("added_tokens[", i, "].");
      if (!t.is_object() || !t.contains("id") || !IsTokenId(t["id"])) {
        return FieldError(where, path + "id", "expected an id in [0, 2^30]");
      }
      AddedToken token;
      token.id = t["id"].get<int32_t>();
      ODMOE_ASSIGN_OR_RETURN(token.content, StringField(t, "content", where, path));
      if (token.content.empty()) return FieldError(where, path + "content", "empty");
      ODMOE_ASSIGN_OR_RETURN(token.special, BoolField(t, "special", where, path, false));
      ODMOE_ASSIGN_OR_RETURN(token.lstrip, BoolField(t, "lstrip", where, path, false));
      ODMOE_ASSIGN_OR_RETURN(token.rstrip, BoolField(t, "rstrip", where, path, false));
      ODMOE_ASSIGN_OR_RETURN(token.single_word, BoolField(t, "single_word", where, path, false));
      impl->added.push_back(std::move(token));
      max_id = std::max(max_id, impl->added.back().id);
    }
  }
  std::stable_sort(impl->added.begin(), impl->added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (const AddedToken& t : impl->added) {
    impl->added_by_id[t.id] = &t;
    impl->added_by_first_byte[static_cast<uint8_t>(t.content[0])].push_back(&t);
  }
  impl->vocab_size = max_id + 1;
  impl->id_bytes.resize(impl->vocab_size);
  for (const auto& [token, id] : impl->vocab) impl->id_bytes[id] = TokenStringBytes(token);
  for (const AddedToken& t : impl->added) impl->id_bytes[t.id] = t.special ? "" : TokenStringBytes(t.content);

  // The pipeline around the model.
  const auto section = [&](std::string_view key) -> const Json& {
    static const Json null_json;
    auto it = root.find(key);
    return it == root.end() ? null_json : *it;
  };
  ODMOE_RETURN_IF_ERROR(ParseNormalizer(section("normalizer"), where, "normalizer", &impl->normalizers));
  ODMOE_RETURN_IF_ERROR(ParsePreTokenizer(section("pre_tokenizer"), where, "pre_tokenizer", &impl->pre_tokenizers));
  if (std::none_of(impl->pre_tokenizers.begin(), impl->pre_tokenizers.end(),
                   [](const PreTokenizeStep& s) { return s.kind == PreTokenizeStep::kByteLevel; })) {
    return Unsupported(where, "pre_tokenizer", "no ByteLevel step: odmoe implements byte-level BPE tokenizers");
  }
  ODMOE_RETURN_IF_ERROR(
      ParsePostProcessor(section("post_processor"), where, "post_processor", &impl->prefix_ids, &impl->suffix_ids));
  const Json& decoder = section("decoder");
  if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") {
    return Unsupported(where, "decoder.type",
                       StrCat(decoder.is_object() ? StrCat("'", decoder.value("type", ""), "'") : "none",
                              "; odmoe implements the ByteLevel decoder"));
  }

  // BOS / EOS named by tokenizer_config.json.
  if (!tokenizer_config.empty()) {
    const std::string config_where = StrCat(where.substr(0, where.rfind('/') + 1), "tokenizer_config.json");
    ODMOE_ASSIGN_OR_RETURN(const Json config, ParseJson(tokenizer_config, config_where));
    if (!config.is_object()) {
      return absl::FailedPreconditionError(
          StrCat(config_where, ": expected a JSON object, got ", JsonTypeName(config)));
    }
    ODMOE_ASSIGN_OR_RETURN(const std::string bos, SpecialTokenName(config, "bos_token", config_where));
    ODMOE_ASSIGN_OR_RETURN(const std::string eos, SpecialTokenName(config, "eos_token", config_where));
    if (!bos.empty()) impl->bos_id = impl->IdOf(bos);
    if (!eos.empty()) impl->eos_id = impl->IdOf(eos);
  }
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

std::vector<int32_t> HfTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  const Impl& impl = *impl_;
  size_t segment = 0;  // start of the text not yet encoded
  for (size_t at = 0; at < text.size();) {
    const AddedToken* t = impl.AddedTokenAt(text, at);
    if (t == nullptr) {
      ++at;
      continue;
    }
    size_t before = at, after = at + t->content.size();
    if (t->lstrip) {  // Rust's trim_end: Unicode White_Space
      for (UChar32 c; before > segment && u_isUWhiteSpace(c = CodePointBefore(text, before));) before -= U8_LENGTH(c);
    }
    if (t->rstrip) {
      for (UChar32 c; after < text.size() && u_isUWhiteSpace(c = CodePointAt(text, after));) after += U8_LENGTH(c);
    }
    impl.EncodeSegment(text.substr(segment, before - segment), &ids);
    ids.push_back(t->id);
    segment = at = after;
  }
  impl.EncodeSegment(text.substr(segment), &ids);
  return ids;
}

std::vector<int32_t> HfTokenizer::EncodeForModel(std::string_view text) const {
  std::vector<int32_t> ids = impl_->prefix_ids;
  const std::vector<int32_t> body = Encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  return ids;
}

std::string HfTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string bytes;
  for (const int32_t id : ids) bytes += impl_->TokenBytes(id);
  return Utf8Lossy(bytes);
}

std::string_view HfTokenizer::TokenBytes(int32_t id) const { return impl_->TokenBytes(id); }
std::string HfTokenizer::TokenText(int32_t id) const {
  if (impl_->IsSpecial(id)) return impl_->added_by_id.at(id)->content;
  return std::string(impl_->TokenBytes(id));
}
bool HfTokenizer::IsSpecial(int32_t id) const { return impl_->IsSpecial(id); }
int32_t HfTokenizer::vocab_size() const { return impl_->vocab_size; }
int32_t HfTokenizer::bos_id() const { return impl_->bos_id; }
int32_t HfTokenizer::eos_id() const { return impl_->eos_id; }

namespace {

// Decode's bytes, released as they form whole characters. The context's bytes are decoded too, but only to
// know whether they end inside a character: those bytes (shown as one U+FFFD by Decode(context)) are held.
class HfDecoder final : public IncrementalDecoder {
 public:
  HfDecoder(const HfTokenizer& tokenizer, std::span<const int32_t> context) : tokenizer_(tokenizer) {
    std::string bytes;
    for (const int32_t id : context) bytes += tokenizer.TokenBytes(id);
    for (size_t at = 0; at < bytes.size();) {
      const Utf8Unit unit = NextUtf8Unit(bytes, at);
      if (unit.kind == Utf8Unit::kTruncated) {
        pending_ = bytes.substr(at);
        context_shown_ = true;
      }
      at += unit.length;
    }
  }

  std::string Push(int32_t id) override {
    pending_ += tokenizer_.TokenBytes(id);
    return Drain(/*final=*/false);
  }
  std::string Finish() override { return Drain(/*final=*/true); }

 private:
  std::string Drain(bool final) {
    std::string out;
    size_t at = 0;
    while (at < pending_.size()) {
      const Utf8Unit unit = NextUtf8Unit(pending_, at);
      if (unit.kind == Utf8Unit::kTruncated && !final) break;
      if (unit.kind == Utf8Unit::kChar) {
        out.append(pending_, at, unit.length);
      } else if (!(context_shown_ && at == 0)) {  // the context's own U+FFFD was already shown
        out.append(kUtf8ReplacementChar);
      }
      context_shown_ = false;
      at += unit.length;
    }
    pending_.erase(0, at);
    return out;
  }

  const HfTokenizer& tokenizer_;
  std::string pending_;         // bytes not yet released: the start of a character
  bool context_shown_ = false;  // pending_ starts with the context's last, unfinished character
};

}  // namespace

std::unique_ptr<IncrementalDecoder> HfTokenizer::NewDecoder(std::span<const int32_t> context) const {
  return std::make_unique<HfDecoder>(*this, context);
}

}  // namespace odmoe
