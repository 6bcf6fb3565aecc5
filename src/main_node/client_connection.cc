#include "src/main_node/client_connection.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstdlib>

namespace odmoe {
namespace {

// The numeric address and port of `addr`, as httplib writes a request's (getnameinfo, NI_NUMERICHOST); false for
// a socket that is not IPv4 or IPv6.
bool AddressOf(const sockaddr_storage& addr, socklen_t len, std::string* ip, int* port) {
  if (addr.ss_family == AF_INET) {
    *port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    *port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  } else {
    return false;
  }
  std::array<char, NI_MAXHOST> host{};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host.data(), host.size(), nullptr, 0,
                  NI_NUMERICHOST) != 0) {
    return false;
  }
  *ip = host.data();
  return true;
}

// Whether `fd` is a connected socket between exactly these two ends. Only getpeername and getsockname touch it:
// they fail on a descriptor that is no socket (ENOTSOCK) or no longer open (EBADF), and read nothing another
// thread closing it could change under them (an fstat would be, for ThreadSanitizer, a race with that close).
bool Connects(int fd, const std::string& local_addr, int local_port, const std::string& remote_addr, int remote_port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  std::string ip;
  int port = -1;
  // The ports first: they tell almost every other socket apart without a name lookup.
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  if (!AddressOf(addr, len, &ip, &port) || port != remote_port || ip != remote_addr) return false;
  len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  return AddressOf(addr, len, &ip, &port) && port == local_port && ip == local_addr;
}

}  // namespace

ClientConnection ClientConnection::Find(const std::string& local_addr, int local_port, const std::string& remote_addr,
                                        int remote_port) {
  if (local_port < 0 || remote_port < 0) return ClientConnection(-1);
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return ClientConnection(-1);
  int found = -1;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;  // ".", "..", the listing's own
    if (Connects(static_cast<int>(fd), local_addr, local_port, remote_addr, remote_port)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return ClientConnection(found);
}

bool ClientConnection::Gone() const {
  if (fd_ < 0) return false;
  pollfd p{.fd = fd_, .events = POLLRDHUP, .revents = 0};
  int ready = 0;
  do {
    ready = poll(&p, 1, 0);
  } while (ready < 0 && errno == EINTR);
  return ready > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace odmoe
