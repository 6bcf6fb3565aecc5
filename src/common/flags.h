// A small command-line flag parser for the odmoe programs: "--name value", "--name=value" and boolean
// "--name". Every error is InvalidArgument with a message that names the flag.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

class Flags {
 public:
  // `with_value`: flags that take a value; `booleans`: flags that take none. Anything else is an error.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args, const std::set<std::string>& with_value,
                                     const std::set<std::string>& booleans);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  absl::StatusOr<std::string> Required(const std::string& name) const;
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t fallback) const;
  absl::StatusOr<double> Double(const std::string& name, double fallback) const;
  // A comma-separated list ("a, b,c"): its items with the spaces around them stripped; none when the flag is
  // absent. An empty item is an error.
  absl::StatusOr<std::vector<std::string>> List(const std::string& name) const;
  // A comma-separated list of integers ("1,2,3").
  absl::StatusOr<std::vector<int64_t>> IntList(const std::string& name) const;

 private:
  std::map<std::string, std::string> values_;  // without the leading "--"
};

}  // namespace odmoe
