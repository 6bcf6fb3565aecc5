// The subcommands of the `odmoe` program. Each takes the arguments after its name and returns the process exit
// code (src/common/status.h: ExitCode). On failure a command prints exactly one line to stderr,
// "odmoe <command>: <message>", where the message names the file, tensor, field or flag at fault.
#pragma once

#include <string>
#include <vector>

namespace odmoe::cli {

// odmoe inspect --model DIR [--json]: opens and validates a checkpoint (config, every shard, every tensor the
// config needs), then prints a summary.
int RunInspect(const std::vector<std::string>& args);

// odmoe generate (--model DIR | --endpoint HOST:PORT) (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N
// [...]: in this process, or through a cluster's main node.
int RunGenerate(const std::vector<std::string>& args);

// odmoe tokenize --model DIR (--text TEXT | --ids 1,2,3) [--for-model] [--json]: the checkpoint's tokenizer
// alone, text to ids or ids to text.
int RunTokenize(const std::vector<std::string>& args);

// odmoe cluster up|down|status --config FILE ...: runs a cluster file's daemons on this machine.
int RunCluster(const std::vector<std::string>& args);

}  // namespace odmoe::cli
