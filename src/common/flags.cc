#include "src/common/flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

absl::StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
    return absl::InvalidArgumentError(StrCat("--", flag, ": expected an integer, got '", text, "'"));
  }
  return static_cast<int64_t>(v);
}

// Levenshtein distance between `a` and `b`.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substituted = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substituted});
    }
  }
  return row[b.size()];
}

// The known flag `name` most likely meant, "" when none is close: the closest flag with every word of it
// (--max-tokens: --max-new-tokens, not --min-tokens), else the closest within two edits of it (a typo).
std::string Suggestion(const std::string& name, const std::set<std::string>& with_value,
                       const std::set<std::string>& booleans) {
  if (name.size() > 64) return "";  // no flag is that long; and the distance costs its length times theirs
  const std::vector<std::string> words = absl::StrSplit(name, '-', absl::SkipEmpty());
  std::string best;
  std::pair<bool, size_t> best_rank;  // (lacks a word, edit distance): lower is likelier
  for (const std::set<std::string>* known : {&with_value, &booleans}) {
    for (const std::string& flag : *known) {
      const std::vector<std::string> flag_words = absl::StrSplit(flag, '-', absl::SkipEmpty());
      const bool has_every_word = !words.empty() && std::all_of(words.begin(), words.end(), [&](const std::string& w) {
        return std::find(flag_words.begin(), flag_words.end(), w) != flag_words.end();
      });
      const std::pair<bool, size_t> rank{!has_every_word, EditDistance(name, flag)};
      if ((has_every_word || rank.second <= 2) && (best.empty() || rank < best_rank)) {
        best = flag;
        best_rank = rank;
      }
    }
  }
  return best;
}

}  // namespace

absl::StatusOr<Flags> Flags::Parse(const std::vector<std::string>& args, const std::set<std::string>& with_value,
                                   const std::set<std::string>& booleans) {
  Flags flags;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      return absl::InvalidArgumentError(StrCat("unexpected argument '", arg, "' (flags start with --)"));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (booleans.count(name) > 0) {
      if (has_value) return absl::InvalidArgumentError(StrCat("--", name, " takes no value"));
      flags.values_[name] = "true";
    } else if (with_value.count(name) > 0) {
      if (!has_value) {
        if (i + 1 >= args.size()) return absl::InvalidArgumentError(StrCat("--", name, " needs a value"));
        value = args[++i];
      }
      flags.values_[name] = value;
    } else {
      const std::string meant = Suggestion(name, with_value, booleans);
      return absl::InvalidArgumentError(
          StrCat("unknown flag --", name, meant.empty() ? "" : StrCat(" (did you mean --", meant, "?)")));
    }
  }
  return flags;
}

std::optional<std::string> Flags::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> Flags::Required(const std::string& name) const {
  auto v = Get(name);
  if (!v) return absl::InvalidArgumentError(StrCat("--", name, " is required"));
  return *v;
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name, int64_t fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  return ParseInt(name, *v);
}

absl::StatusOr<double> Flags::Double(const std::string& name, double fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  const double d = std::strtod(v->c_str(), &end);
  if (v->empty() || end != v->c_str() + v->size() || errno == ERANGE || !std::isfinite(d)) {
    return absl::InvalidArgumentError(StrCat("--", name, ": expected a number, got '", *v, "'"));
  }
  return d;
}

absl::StatusOr<std::vector<std::string>> Flags::List(const std::string& name) const {
  std::vector<std::string> out;
  const std::optional<std::string> v = Get(name);
  if (!v) return out;
  for (absl::string_view item : absl::StrSplit(*v, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) return absl::InvalidArgumentError(StrCat("--", name, ": empty item in '", *v, "'"));
    out.emplace_back(item);
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> Flags::IntList(const std::string& name) const {
  ODMOE_ASSIGN_OR_RETURN(const std::vector<std::string> items, List(name));
  std::vector<int64_t> out;
  for (const std::string& item : items) {
    ODMOE_ASSIGN_OR_RETURN(const int64_t parsed, ParseInt(name, item));
    out.push_back(parsed);
  }
  return out;
}

}  // namespace odmoe
