// The TCP connection an HTTP request came on, watched so that a handler can see its client go before it answers.
//
// A streamed answer sees a departed client through cpp-httplib's DataSink (is_writable); a whole answer (one write
// at the end) has no such hook, and Debian's cpp-httplib (0.11) gives a handler the request's addresses but not
// its socket. ClientConnection finds the socket among the process's open descriptors (/proc/self/fd) by the
// request's four addresses: while the connection is open no other socket has them, and httplib closes it only
// after the handler has returned, so the descriptor found stays this connection's for the handler's whole life.
// The descriptors of other threads, which they may close meanwhile, are asked only their sockets' addresses.
//
// Gone() polls the socket without reading from it (httplib's reader keeps what is buffered): the client has gone
// once it has closed its side of the connection (or reset it), as httplib's DataSink judges a stream's client.
// A client that half-closes after its request and still waits for the answer would read as gone; HTTP clients
// (curl, Python's, the OpenAI SDKs) do not.
//
// Thread safety: a ClientConnection may be used from any thread, one at a time; it owns nothing (the descriptor
// stays httplib's).
#pragma once

#include <string>

namespace odmoe {

class ClientConnection {
 public:
  // The connection from remote_addr:remote_port to local_addr:local_port (numeric addresses, as httplib::Request
  // gives them), or one that is never found (found() false, Gone() always false) when no open socket has them:
  // the caller then answers as before, when the client may have gone unnoticed.
  static ClientConnection Find(const std::string& local_addr, int local_port, const std::string& remote_addr,
                               int remote_port);

  bool found() const { return fd_ >= 0; }
  // True once the client has closed or reset the connection; never blocks. REQUIRES: the connection is still open
  // on the server's side (the handler that found it has not returned).
  bool Gone() const;

 private:
  explicit ClientConnection(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace odmoe
