#include "src/rpc/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <cstdint>
#include <string>

namespace odmoe::rpc::systemd {
namespace {

void Send(const std::string& message) { (void)sd_notify(/*unset_environment=*/0, message.c_str()); }

// STATUS= ends at the newline: keep the status on one line.
std::string OneLine(std::string_view status) {
  std::string s(status);
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace

void NotifyReady(std::string_view status) { Send("READY=1\nSTATUS=" + OneLine(status)); }
void NotifyStatus(std::string_view status) { Send("STATUS=" + OneLine(status)); }
void NotifyWatchdog() { Send("WATCHDOG=1"); }
void NotifyStopping() { Send("STOPPING=1\nSTATUS=stopping"); }

std::optional<absl::Duration> WatchdogPingInterval() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(/*unset_environment=*/0, &usec) <= 0 || usec == 0) return std::nullopt;
  return absl::Microseconds(static_cast<int64_t>(usec / 2));
}

}  // namespace odmoe::rpc::systemd
