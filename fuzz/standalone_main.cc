// A main() for the fuzz targets where libFuzzer is not linked (the gcc build): runs LLVMFuzzerTestOneInput once
// on every file named on the command line, and on every regular file (recursively, in sorted order) of every
// folder named. Arguments starting with '-' are libFuzzer flags and are ignored, so the regression test runs
// either binary with the same command line. Exits 1 when a path cannot be read; a crash aborts as it would
// under libFuzzer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::fprintf(stderr, "Running: %s (%zu bytes)\n", path.c_str(), bytes.size());
  // A copy of exactly `size` bytes, so that reads past the end are caught by the sanitizers as under libFuzzer.
  std::vector<uint8_t> input(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(input.empty() ? nullptr : input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  bool ok = true;
  int ran = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("-")) continue;
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& entry : std::filesystem::recursive_directory_iterator(arg, ec)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
      if (ec) {
        std::fprintf(stderr, "cannot list %s: %s\n", arg.c_str(), ec.message().c_str());
        ok = false;
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        ok = RunFile(f) && ok;
        ++ran;
      }
    } else {
      ok = RunFile(arg) && ok;
      ++ran;
    }
  }
  std::fprintf(stderr, "Executed %d inputs\n", ran);
  return ok ? 0 : 1;
}
