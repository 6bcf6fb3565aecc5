// The build version every odmoe program reports: the CMake project version, then `+` and `git describe` of the
// source tree when it was configured from a git checkout (e.g. "0.1.0+3f7383a" or "0.1.0+3f7383a.dirty"),
// else the project version alone. Generated from src/common/version.cc.in at configure time and checked at every
// build (src/common/version.cmake), so it names the tree the program was built from.
#pragma once

#include <string_view>

namespace odmoe {

// This program's build version. Constant for the life of the process.
std::string_view BuildVersion();

}  // namespace odmoe
