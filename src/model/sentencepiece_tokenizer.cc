#include "src/model/sentencepiece_tokenizer.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "odmoe/spm/sentencepiece_model.pb.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"

// The algorithms below follow SentencePiece (google/sentencepiece, src/normalizer.cc, bpe_model.cc,
// model_interface.cc, sentencepiece_processor.cc) step by step, so that ids match it exactly: the comments name
// the SentencePiece function each part mirrors.

namespace odmoe {
namespace {

using PieceType = spm::ModelProto::SentencePiece::Type;

constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";  // U+2581, SentencePiece's whitespace marker

// ---------------------------------------------------------------------------------------------------------------
// UTF-8, exactly as SentencePiece's string_util::DecodeUTF8 / IsValidDecodeUTF8 judge it.
// ---------------------------------------------------------------------------------------------------------------

bool IsTrailByte(uint8_t c) { return (c & 0xC0) == 0x80; }
bool IsValidCodepoint(uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); }

// The length of the well-formed UTF-8 character at the start of `s`, or 0 if it does not start with one (then
// SentencePiece consumes one byte and, where it decodes, writes U+FFFD). REQUIRES: !s.empty().
size_t ValidCharLen(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  if (b(0) < 0x80) return 1;
  if (s.size() >= 2 && (b(0) & 0xE0) == 0xC0) {
    const uint32_t cp = ((b(0) & 0x1Fu) << 6) | (b(1) & 0x3Fu);
    if (IsTrailByte(b(1)) && cp >= 0x80 && IsValidCodepoint(cp)) return 2;
  } else if (s.size() >= 3 && (b(0) & 0xF0) == 0xE0) {
    const uint32_t cp = ((b(0) & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
    if (IsTrailByte(b(1)) && IsTrailByte(b(2)) && cp >= 0x800 && IsValidCodepoint(cp)) return 3;
  } else if (s.size() >= 4 && (b(0) & 0xF8) == 0xF0) {
    const uint32_t cp = ((b(0) & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) | ((b(2) & 0x3Fu) << 6) | (b(3) & 0x3Fu);
    if (IsTrailByte(b(1)) && IsTrailByte(b(2)) && IsTrailByte(b(3)) && cp >= 0x10000 && IsValidCodepoint(cp)) {
      return 4;
    }
  }
  return 0;
}

// The byte count of a well-formed character that starts with `lead`; 0 if no well-formed character does.
size_t CharLenForLead(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// True if `s` (shorter than the character its first byte announces) can still be completed into a well-formed
// character by more bytes; false if ValidCharLen will say 0 whatever follows.
bool CanComplete(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  if (s.empty() || s.size() >= CharLenForLead(b(0))) return false;
  for (size_t i = 1; i < s.size(); ++i) {
    if (!IsTrailByte(b(i))) return false;
  }
  if (s.size() >= 2) {  // the second byte bounds the code point: no overlongs, surrogates or > U+10FFFF
    switch (b(0)) {
      case 0xE0:
        return b(1) >= 0xA0;
      case 0xED:
        return b(1) <= 0x9F;
      case 0xF0:
        return b(1) >= 0x90;
      case 0xF4:
        return b(1) <= 0x8F;
      default:
        break;
    }
  }
  return true;
}

// SentencePieceProcessor::Decode's ProcessBytePieces: one run of byte pieces to text; each byte that does not
// start a well-formed character becomes U+FFFD.
void AppendBytesAsText(std::string_view bytes, std::string* out) {
  while (!bytes.empty()) {
    const size_t n = ValidCharLen(bytes);
    if (n == 0) {
      out->append(kUtf8ReplacementChar);
      bytes.remove_prefix(1);
    } else {
      out->append(bytes.substr(0, n));
      bytes.remove_prefix(n);
    }
  }
}

// SentencePiece's PieceToByte: "<0x4A>" -> 0x4A; -1 unless the piece is exactly "<0x" + two upper-case hex
// digits + ">".
int PieceToByte(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') {
      value += c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value += c - 'A' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using PieceMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// SentencePiece's PrefixMatcher over the USER_DEFINED pieces: the longest piece that prefixes the text.
class PrefixMatcher {
 public:
  PrefixMatcher() : nodes_(1) {}

  void Add(std::string_view key) {
    int32_t node = 0;
    for (char c : key) {
      const uint8_t byte = static_cast<uint8_t>(c);
      if (const auto it = nodes_[node].next.find(byte); it != nodes_[node].next.end()) {
        node = it->second;
        continue;
      }
      const int32_t child = static_cast<int32_t>(nodes_.size());
      nodes_[node].next.emplace(byte, child);
      nodes_.emplace_back();  // may move the nodes: no reference into nodes_ is held across it
      node = child;
    }
    nodes_[node].terminal = true;
    empty_ = false;
  }

  // PrefixMatcher::PrefixMatch: the length of the longest key prefixing `text` (*found = true), else the length
  // of its first UTF-8 character as OneCharLen measures it (*found = false). REQUIRES: !text.empty().
  size_t Match(std::string_view text, bool* found) const {
    size_t longest = 0;
    if (!empty_) {
      int32_t node = 0;
      for (size_t i = 0; i < text.size(); ++i) {
        const auto it = nodes_[node].next.find(static_cast<uint8_t>(text[i]));
        if (it == nodes_[node].next.end()) break;
        node = it->second;
        if (nodes_[node].terminal) longest = i + 1;
      }
    }
    *found = longest > 0;
    if (longest > 0) return longest;
    static constexpr uint8_t kOneCharLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return std::min<size_t>(text.size(), kOneCharLen[static_cast<uint8_t>(text[0]) >> 4]);
  }

 private:
  struct Node {
    std::map<uint8_t, int32_t> next;
    bool terminal = false;
  };
  std::vector<Node> nodes_;  // nodes_[0] is the root
  bool empty_ = true;
};

}  // namespace

struct SentencePieceTokenizer::Impl {
  // Per id.
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::vector<PieceType> types;
  std::vector<int32_t> canonical;   // PieceToId(pieces[id]): what DecodeIds looks the piece up as
  std::vector<int16_t> byte_value;  // the byte of a BYTE piece, -1 for other pieces

  PieceMap normal;    // NORMAL, USER_DEFINED and UNUSED pieces (SentencePiece's pieces_)
  PieceMap reserved;  // CONTROL, UNKNOWN and BYTE pieces (reserved_id_map_)
  PrefixMatcher user_defined;
  std::array<int32_t, 256> byte_ids{};  // the BYTE piece of each byte value (all present with byte_fallback)

  int32_t unk_id = -1;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  bool byte_fallback = false;
  bool treat_whitespace_as_suffix = false;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
  std::string unk_surface;
  bool add_bos = true;
  bool add_eos = false;

  bool InRange(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < pieces.size(); }
  bool Is(int32_t id, PieceType type) const { return InRange(id) && types[id] == type; }

  // ModelInterface::PieceToId: reserved pieces first, then normal ones, else unk.
  int32_t PieceToId(std::string_view piece) const {
    if (const auto it = reserved.find(piece); it != reserved.end()) return it->second;
    if (const auto it = normal.find(piece); it != normal.end()) return it->second;
    return unk_id;
  }

  // Normalizer::NormalizePrefix without a character map: a user-defined piece as is, else one character, with a
  // malformed byte replaced by U+FFFD. Returns the normalized text and how many input bytes it consumed.
  std::pair<std::string_view, size_t> NormalizePrefix(std::string_view input) const {
    bool found = false;
    const size_t matched = user_defined.Match(input, &found);
    if (found) return {input.substr(0, matched), matched};
    const size_t n = ValidCharLen(input);
    if (n == 0) return {kUtf8ReplacementChar, 1};
    return {input.substr(0, n), n};
  }

  // Normalizer::Normalize (identity rules).
  std::string Normalize(std::string_view input) const {
    std::string out;
    if (remove_extra_whitespaces) {  // drops leading spaces
      while (!input.empty()) {
        const auto [text, consumed] = NormalizePrefix(input);
        if (text != " ") break;
        input.remove_prefix(consumed);
      }
    }
    if (input.empty()) return out;  // no dummy prefix for an empty (or all-space) text

    const std::string_view space = escape_whitespaces ? kSpaceSymbol : std::string_view(" ");
    if (!treat_whitespace_as_suffix && add_dummy_prefix) out.append(space);
    bool is_prev_space = remove_extra_whitespaces;
    while (!input.empty()) {
      auto [text, consumed] = NormalizePrefix(input);
      while (is_prev_space && !text.empty() && text.front() == ' ') text.remove_prefix(1);
      if (!text.empty()) {
        for (char c : text) {
          if (c == ' ' && escape_whitespaces) {
            out.append(kSpaceSymbol);
          } else {
            out.push_back(c);
          }
        }
        is_prev_space = text.back() == ' ';
      }
      input.remove_prefix(consumed);
      if (!remove_extra_whitespaces) is_prev_space = false;
    }
    if (remove_extra_whitespaces) {  // drops trailing spaces
      while (out.size() >= space.size() && std::string_view(out).substr(out.size() - space.size()) == space) {
        out.resize(out.size() - space.size());
      }
    }
    if (treat_whitespace_as_suffix && add_dummy_prefix) out.append(space);
    return out;
  }

  using RevMerge = std::unordered_map<std::string_view, std::pair<std::string_view, std::string_view>>;

  // bpe::Model's `resegment`: an UNUSED piece is split back into the two symbols it was merged from.
  void Resegment(std::string_view w, const RevMerge& rev_merge,
                 std::vector<std::pair<std::string_view, int32_t>>* out) const {
    const int32_t id = PieceToId(w);
    if (!Is(id, spm::ModelProto::SentencePiece::UNUSED)) {
      out->emplace_back(w, id);
      return;
    }
    const auto it = rev_merge.find(w);
    if (it == rev_merge.end()) {
      out->emplace_back(w, id);
      return;
    }
    Resegment(it->second.first, rev_merge, out);
    Resegment(it->second.second, rev_merge, out);
  }

  // bpe::Model::SampleEncode without dropout: pieces of the normalized text with their ids (unk for unknown
  // symbols).
  std::vector<std::pair<std::string_view, int32_t>> EncodeBpe(std::string_view normalized) const {
    std::vector<std::pair<std::string_view, int32_t>> result;
    if (normalized.empty()) return result;

    struct Symbol {
      int prev;     // previous symbol, -1 at the start
      int next;     // next symbol, -1 at the end
      bool freeze;  // a user-defined piece: never merged
      std::string_view piece;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(normalized.size());
    for (std::string_view rest = normalized; !rest.empty();) {
      const int index = static_cast<int>(symbols.size());
      Symbol s;
      const size_t len = user_defined.Match(rest, &s.freeze);
      s.piece = rest.substr(0, len);
      s.prev = index - 1;
      rest.remove_prefix(len);
      s.next = rest.empty() ? -1 : index + 1;
      symbols.push_back(s);
    }

    struct SymbolPair {
      int left;
      int right;
      float score;
      size_t size;  // byte length of the merged piece; a popped pair whose symbols changed no longer matches
    };
    // The agenda's top is the highest score, and among equal scores the leftmost pair.
    const auto lower_priority = [](const SymbolPair& a, const SymbolPair& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<SymbolPair, std::vector<SymbolPair>, decltype(lower_priority)> agenda(lower_priority);
    RevMerge rev_merge;

    const auto maybe_add_pair = [&](int left, int right) {
      if (left == -1 || right == -1 || symbols[left].freeze || symbols[right].freeze) return;
      // Adjacent symbols are adjacent in `normalized`, so their concatenation is a view into it.
      const std::string_view piece(symbols[left].piece.data(),
                                   symbols[left].piece.size() + symbols[right].piece.size());
      const auto it = normal.find(piece);
      if (it == normal.end()) return;
      agenda.push(SymbolPair{left, right, scores[it->second], piece.size()});
      if (types[it->second] == spm::ModelProto::SentencePiece::UNUSED) {
        rev_merge[piece] = {symbols[left].piece, symbols[right].piece};
      }
    };

    for (size_t i = 1; i < symbols.size(); ++i) maybe_add_pair(static_cast<int>(i) - 1, static_cast<int>(i));

    while (!agenda.empty()) {
      const SymbolPair top = agenda.top();
      agenda.pop();
      Symbol& left = symbols[top.left];
      Symbol& right = symbols[top.right];
      if (left.piece.empty() || right.piece.empty() || left.piece.size() + right.piece.size() != top.size) {
        continue;  // stale: one side was merged since this pair was queued
      }
      left.piece = std::string_view(left.piece.data(), left.piece.size() + right.piece.size());
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.left;
      right.piece = std::string_view();
      maybe_add_pair(left.prev, top.left);
      maybe_add_pair(top.left, left.next);
    }

    for (int index = 0; index != -1; index = symbols[index].next) {
      Resegment(symbols[index].piece, rev_merge, &result);
    }
    return result;
  }

  // SentencePieceProcessor::Encode (PopulateSentencePieceText): unknown pieces become byte pieces with
  // byte_fallback; without it, a run of unknown pieces becomes one unk id.
  std::vector<int32_t> Encode(std::string_view text) const {
    const std::string normalized = Normalize(text);
    std::vector<int32_t> ids;
    bool prev_unk = false;
    for (const auto& [piece, id] : EncodeBpe(normalized)) {
      const bool is_unk = Is(id, spm::ModelProto::SentencePiece::UNKNOWN);
      if (is_unk && byte_fallback) {
        for (char c : piece) ids.push_back(byte_ids[static_cast<uint8_t>(c)]);
      } else if (!(is_unk && prev_unk)) {
        ids.push_back(id);
      }
      prev_unk = is_unk;
    }
    return ids;
  }

  // SentencePieceProcessor::Decode's DecodeSentencePiece for a piece that is not a byte piece. Returns its text
  // and whether it consumed a leading "▁" (bos_ws_seen). `id` is canonical or out of range.
  std::pair<std::string, bool> DecodePiece(int32_t id, bool is_bos_ws) const {
    if (!InRange(id) || types[id] == spm::ModelProto::SentencePiece::CONTROL) return {"", false};
    if (types[id] == spm::ModelProto::SentencePiece::UNKNOWN) return {unk_surface, false};
    std::string_view piece = pieces[id];
    bool has_bos_ws = false;
    if (is_bos_ws && (add_dummy_prefix || remove_extra_whitespaces)) {
      if (piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
        piece.remove_prefix(kSpaceSymbol.size());
        has_bos_ws = true;
      }
      // With remove_extra_whitespaces every leading "▁" goes: keep consuming.
      if (remove_extra_whitespaces) has_bos_ws = false;
    }
    std::string text;
    text.reserve(piece.size());
    while (!piece.empty()) {
      if (piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
        text.push_back(' ');
        piece.remove_prefix(kSpaceSymbol.size());
      } else {
        text.push_back(piece.front());
        piece.remove_prefix(1);
      }
    }
    return {std::move(text), has_bos_ws};
  }

  int32_t Canonical(int32_t id) const { return InRange(id) ? canonical[id] : id; }
  int ByteOf(int32_t canonical_id) const { return InRange(canonical_id) ? byte_value[canonical_id] : -1; }
};

namespace {

absl::Status ModelError(const std::string& where, std::string_view problem) {
  return absl::DataLossError(StrCat(where, ": ", problem));
}

}  // namespace

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(const std::string& dir) {
  const std::string model_path = dir + "/tokenizer.model";
  if (!FileExists(model_path)) return absl::NotFoundError(StrCat(model_path, ": no SentencePiece model"));
  ODMOE_ASSIGN_OR_RETURN(const std::string model, ReadFileToString(model_path));

  bool add_bos = true;
  bool add_eos = false;
  const std::string config_path = dir + "/tokenizer_config.json";
  if (FileExists(config_path)) {
    ODMOE_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(config_path));
    ODMOE_ASSIGN_OR_RETURN(const Json config, ParseJson(text, config_path));
    if (!config.is_object()) {
      return absl::DataLossError(StrCat(config_path, ": expected a JSON object, got ", JsonTypeName(config)));
    }
    const JsonFields fields(config, config_path);
    ODMOE_ASSIGN_OR_RETURN(add_bos, fields.Bool("add_bos_token", true));
    ODMOE_ASSIGN_OR_RETURN(add_eos, fields.Bool("add_eos_token", false));
  }
  return FromSerializedModel(model, add_bos, add_eos, model_path);
}

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::FromSerializedModel(
    std::string_view model, bool add_bos, bool add_eos, const std::string& where) {
  spm::ModelProto proto;
  if (model.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !proto.ParseFromArray(model.data(), static_cast<int>(model.size()))) {
    return ModelError(where, "not a SentencePiece model (the protobuf does not parse; truncated or corrupt?)");
  }
  if (proto.pieces_size() == 0) {
    return ModelError(where, "not a SentencePiece model (it has no pieces; empty or truncated?)");
  }
  const spm::TrainerSpec& trainer = proto.trainer_spec();
  if (trainer.model_type() != spm::TrainerSpec::BPE) {
    return absl::UnimplementedError(StrCat(where, ": field 'trainer_spec.model_type' is ",
                                           spm::TrainerSpec::ModelType_Name(trainer.model_type()),
                                           "; odmoe implements only BPE SentencePiece models"));
  }
  const spm::NormalizerSpec& norm = proto.normalizer_spec();
  if (!norm.precompiled_charsmap().empty()) {
    return absl::UnimplementedError(StrCat(where, ": field 'normalizer_spec.precompiled_charsmap' is set (normalizer '",
                                           norm.name(), "', ", norm.precompiled_charsmap().size(),
                                           " bytes); odmoe implements only the identity normalizer"));
  }

  auto impl = std::make_unique<Impl>();
  impl->byte_fallback = trainer.byte_fallback();
  impl->treat_whitespace_as_suffix = trainer.treat_whitespace_as_suffix();
  impl->add_dummy_prefix = norm.add_dummy_prefix();
  impl->remove_extra_whitespaces = norm.remove_extra_whitespaces();
  impl->escape_whitespaces = norm.escape_whitespaces();
  impl->unk_surface = trainer.unk_surface();
  impl->add_bos = add_bos;
  impl->add_eos = add_eos;
  impl->byte_ids.fill(-1);

  // ModelInterface::InitializePieces, with its checks.
  const int n = proto.pieces_size();
  impl->pieces.reserve(n);
  impl->scores.reserve(n);
  impl->types.reserve(n);
  impl->byte_value.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    const auto& sp = proto.pieces(i);
    const std::string& piece = sp.piece();
    if (piece.empty()) return ModelError(where, StrCat("piece ", i, " is empty"));
    if (piece.find('\0') != std::string::npos) return ModelError(where, StrCat("piece ", i, " has a NUL character"));
    const PieceType type = sp.type();
    const bool is_normal = type == spm::ModelProto::SentencePiece::NORMAL ||
                           type == spm::ModelProto::SentencePiece::USER_DEFINED ||
                           type == spm::ModelProto::SentencePiece::UNUSED;
    if (!(is_normal ? impl->normal : impl->reserved).emplace(piece, i).second) {
      return ModelError(where, StrCat("piece ", i, " '", piece, "' is defined twice"));
    }
    if (type == spm::ModelProto::SentencePiece::USER_DEFINED) impl->user_defined.Add(piece);
    if (type == spm::ModelProto::SentencePiece::UNKNOWN) {
      if (impl->unk_id >= 0) return ModelError(where, StrCat("pieces ", impl->unk_id, " and ", i, " are both unk"));
      impl->unk_id = i;
    }
    if (type == spm::ModelProto::SentencePiece::BYTE) {
      if (!impl->byte_fallback) {
        return ModelError(where,
                          StrCat("byte piece ", i, " '", piece, "' although trainer_spec.byte_fallback is false"));
      }
      const int byte = PieceToByte(piece);
      if (byte < 0) return ModelError(where, StrCat("byte piece ", i, " '", piece, "' is not of the form <0xXX>"));
      impl->byte_value[i] = static_cast<int16_t>(byte);
      if (impl->byte_ids[byte] < 0) impl->byte_ids[byte] = i;
    }
    impl->pieces.push_back(piece);
    impl->scores.push_back(sp.score());
    impl->types.push_back(type);
  }
  if (impl->unk_id < 0) return ModelError(where, "no piece of type UNKNOWN");
  if (impl->byte_fallback && std::find(impl->byte_ids.begin(), impl->byte_ids.end(), -1) != impl->byte_ids.end()) {
    return ModelError(where,
                      "trainer_spec.byte_fallback is set but the 256 byte pieces <0x00>..<0xFF> are not all there");
  }
  impl->canonical.resize(n);
  for (int i = 0; i < n; ++i) impl->canonical[i] = impl->PieceToId(impl->pieces[i]);

  // BOS / EOS: the control pieces the trainer spec names (SentencePiece looks up bos_piece, "<s>" by default,
  // which the trainer placed at bos_id).
  const auto control_id = [&](int32_t spec_id, std::string_view default_piece) -> int32_t {
    if (impl->Is(spec_id, spm::ModelProto::SentencePiece::CONTROL)) return spec_id;
    const auto it = impl->reserved.find(default_piece);
    if (it != impl->reserved.end() && impl->Is(it->second, spm::ModelProto::SentencePiece::CONTROL)) {
      return it->second;
    }
    return -1;
  };
  impl->bos_id = control_id(trainer.bos_id(), "<s>");
  impl->eos_id = control_id(trainer.eos_id(), "</s>");

  return std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(impl)));
}

std::vector<int32_t> SentencePieceTokenizer::Encode(std::string_view text) const { return impl_->Encode(text); }

std::vector<int32_t> SentencePieceTokenizer::EncodeForModel(std::string_view text) const {
  std::vector<int32_t> ids;
  if (impl_->add_bos && impl_->bos_id >= 0) ids.push_back(impl_->bos_id);
  const std::vector<int32_t> body = impl_->Encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  if (impl_->add_eos && impl_->eos_id >= 0) ids.push_back(impl_->eos_id);
  return ids;
}

std::string SentencePieceTokenizer::Decode(std::span<const int32_t> ids) const {
  // SentencePieceProcessor::Decode: runs of byte pieces are decoded together; a piece loses its leading "▁"
  // while the text is still empty and no earlier piece has lost one.
  std::string text;
  std::string bytes;
  bool is_bos_ws = true;
  bool bos_ws_seen = false;
  for (const int32_t raw_id : ids) {
    const int32_t id = impl_->Canonical(raw_id);
    if (const int byte = impl_->ByteOf(id); byte >= 0) {
      bytes.push_back(static_cast<char>(byte));
      continue;
    }
    AppendBytesAsText(bytes, &text);
    bytes.clear();
    if (bos_ws_seen || !text.empty()) is_bos_ws = false;
    auto [piece_text, seen] = impl_->DecodePiece(id, is_bos_ws);
    text += piece_text;
    bos_ws_seen = seen;
  }
  AppendBytesAsText(bytes, &text);
  return text;
}

int32_t SentencePieceTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->pieces.size()); }
int32_t SentencePieceTokenizer::bos_id() const { return impl_->bos_id; }
int32_t SentencePieceTokenizer::eos_id() const { return impl_->eos_id; }
int32_t SentencePieceTokenizer::unk_id() const { return impl_->unk_id; }
bool SentencePieceTokenizer::add_bos() const { return impl_->add_bos; }

std::string SentencePieceTokenizer::TokenText(int32_t id) const {
  if (!impl_->InRange(id)) return "";
  if (const int byte = impl_->ByteOf(impl_->Canonical(id)); byte >= 0) return std::string(1, static_cast<char>(byte));
  if (IsControl(id)) return impl_->pieces[id];
  return impl_->DecodePiece(impl_->Canonical(id), /*is_bos_ws=*/false).first;
}

std::string_view SentencePieceTokenizer::IdToPiece(int32_t id) const {
  return impl_->InRange(id) ? std::string_view(impl_->pieces[id]) : std::string_view();
}
bool SentencePieceTokenizer::IsControl(int32_t id) const {
  return impl_->Is(id, spm::ModelProto::SentencePiece::CONTROL);
}
bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  return IsControl(id) || impl_->Is(id, spm::ModelProto::SentencePiece::UNKNOWN);
}
bool SentencePieceTokenizer::IsByte(int32_t id) const { return impl_->Is(id, spm::ModelProto::SentencePiece::BYTE); }

std::unique_ptr<IncrementalDecoder> SentencePieceTokenizer::NewDecoder(std::span<const int32_t> context) const {
  return std::make_unique<SentencePieceDecoder>(*this, context);
}

// ---------------------------------------------------------------------------------------------------------------
// SentencePieceDecoder: SentencePieceTokenizer::Decode's loop, run one id at a time, holding back a byte run's tail
// while it can still become a character. Whether bytes decode as a character or as U+FFFD depends only on the bytes
// from the character's first byte up to its announced length, so what is emitted early never changes later.
// ---------------------------------------------------------------------------------------------------------------

SentencePieceDecoder::SentencePieceDecoder(const SentencePieceTokenizer& tokenizer, std::span<const int32_t> context)
    : tokenizer_(tokenizer) {
  for (const int32_t id : context) Push(id);  // output discarded: the caller has the context's text
  // Decode(context) ended the byte run there: each byte still held showed as one U+FFFD.
  for (size_t i = 0; i < pending_bytes_.size(); ++i) context_tail_.append(kUtf8ReplacementChar);
}

std::string SentencePieceDecoder::SkipShown(std::string out) {
  if (context_tail_.empty()) return out;
  size_t same = 0;
  while (same < out.size() && same < context_tail_.size() && out[same] == context_tail_[same]) ++same;
  if (same == context_tail_.size()) {  // all shown: the rest is new (cut at a U+FFFD boundary)
    context_tail_.clear();
    return out.substr(same);
  }
  if (same == out.size()) {  // `out` is U+FFFDs that were shown already
    context_tail_.erase(0, same);
    return "";
  }
  // The text differs from what Decode(context) showed (a held character was completed): emit it all.
  context_tail_.clear();
  return out;
}

std::string SentencePieceDecoder::DrainBytes(bool final) {
  std::string out;
  std::string_view rest = pending_bytes_;
  while (!rest.empty()) {
    const size_t n = ValidCharLen(rest);
    if (n > 0) {
      out.append(rest.substr(0, n));
      rest.remove_prefix(n);
    } else if (!final && CanComplete(rest)) {
      break;  // wait for the rest of the character
    } else {
      out.append(kUtf8ReplacementChar);
      rest.remove_prefix(1);
    }
  }
  pending_bytes_.erase(0, pending_bytes_.size() - rest.size());
  return out;
}

std::string SentencePieceDecoder::Push(int32_t raw_id) {
  const SentencePieceTokenizer::Impl& impl = *tokenizer_.impl_;
  const int32_t id = impl.Canonical(raw_id);
  if (const int byte = impl.ByteOf(id); byte >= 0) {
    pending_bytes_.push_back(static_cast<char>(byte));
    text_empty_ = false;  // a byte always decodes to something, a character or U+FFFD
    return SkipShown(DrainBytes(/*final=*/false));
  }
  std::string out = DrainBytes(/*final=*/true);
  if (bos_ws_seen_ || !text_empty_) at_start_ = false;
  auto [piece_text, seen] = impl.DecodePiece(id, at_start_);
  bos_ws_seen_ = seen;
  if (!piece_text.empty()) text_empty_ = false;
  out += piece_text;
  return SkipShown(std::move(out));
}

std::string SentencePieceDecoder::Finish() { return SkipShown(DrainBytes(/*final=*/true)); }

}  // namespace odmoe
