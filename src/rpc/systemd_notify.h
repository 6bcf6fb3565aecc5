// The daemon's side of systemd's notify protocol (Type=notify units, configs/systemd/), through libsystemd.
// Every call is a no-op when the process was not started by systemd (no NOTIFY_SOCKET in the environment),
// and a failure to send is ignored: notification never stops a daemon from serving.
#pragma once

#include <optional>
#include <string_view>

#include "absl/time/time.h"

namespace odmoe::rpc::systemd {

// READY=1 with a STATUS= line: this daemon has loaded its weights and listens (not: the cluster is ready).
void NotifyReady(std::string_view status);
// STATUS=...: a one-line state shown by `systemctl status`.
void NotifyStatus(std::string_view status);
// WATCHDOG=1: the serving loop is alive.
void NotifyWatchdog();
// STOPPING=1: shutdown began.
void NotifyStopping();
// How often to send WATCHDOG=1 (half the unit's WatchdogSec) when systemd asks for it, else nullopt.
std::optional<absl::Duration> WatchdogPingInterval();

}  // namespace odmoe::rpc::systemd
