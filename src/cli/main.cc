// odmoe: the command-line front end. Thin: picks the subcommand and hands it the rest of the arguments.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "src/cli/commands.h"
#include "src/common/logging.h"
#include "src/common/status.h"

namespace {

constexpr std::string_view kUsage =
    "usage: odmoe <command> [flags]\n"
    "commands:\n"
    "  generate   generate text from a prompt, here or through a cluster (odmoe generate --help)\n"
    "  cluster    start, stop and inspect a cluster's daemons on this machine (odmoe cluster --help)\n"
    "  inspect    validate a checkpoint and print what it holds (odmoe inspect --help)\n"
    "  tokenize   text to token ids and back with a checkpoint's tokenizer (odmoe tokenize --help)\n";

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr: stdout is the commands' output (generate's text or --json object, tokenize's ids), which
  // scripts read whole; a warning from a library (a peer of another build) must not land in it.
  odmoe::logging::Setup("odmoe", odmoe::logging::LogFormat::kText);
  if (argc < 2) {
    std::fputs(kUsage.data(), stderr);
    return odmoe::kExitUsage;
  }
  const std::string command = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "generate") return odmoe::cli::RunGenerate(args);
  if (command == "inspect") return odmoe::cli::RunInspect(args);
  if (command == "tokenize") return odmoe::cli::RunTokenize(args);
  if (command == "cluster") return odmoe::cli::RunCluster(args);
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage.data(), stdout);
    return odmoe::kExitOk;
  }
  std::fprintf(stderr, "odmoe: unknown command '%s'\n%s", command.c_str(), kUsage.data());
  return odmoe::kExitUsage;
}
